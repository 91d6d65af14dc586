"""The engine process runs on the event loop its config names (`event_loop`: auto -> uvloop when installed), under
an API process on either loop, with messages larger than the socket buffer (uvloop's add_reader makes the socket
non-blocking unless `engine_ipc.watch_readable` restores it); a uvloop that is not there is a start error."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from actors.engine_ipc import watch_readable
from actors.engine_process import ProcessEngine
from voltserve import event_loop
from voltserve.config import EngineConfig, ModelConfig
from voltserve.errors import ConfigError


class LoopProbeEngine:
    """Engine double built in the engine process (no model): kv_stats(), which ReadyMsg carries to the API
    process, names the event loop its start() ran on, with 4 MiB of padding (a real tokenizer makes ReadyMsg
    megabytes long too)."""

    def __init__(self, config, on_death=None):
        from tests.api.fake_engine import ByteTokenizer, ChatMLTemplate

        self.config = config
        self.tokenizer, self.chat_template = ByteTokenizer(), ChatMLTemplate()
        self.model_config = ModelConfig("probe", self.tokenizer.vocab_size, 64, 64, 1, 1, 1, 64)
        self.max_model_len = 64
        self.loop = ""

    async def start(self) -> None:
        self.loop = type(asyncio.get_running_loop()).__module__.split(".")[0]

    async def stop(self) -> None:
        pass

    def kv_stats(self) -> dict:
        return {"num_blocks": 0, "loop": self.loop, "pad": PAD}


ROOT = Path(__file__).resolve().parents[2]
PAD = "x" * (4 << 20)


def _probe(config, on_death=None) -> LoopProbeEngine:
    return LoopProbeEngine(config, on_death)


async def _child_loop(kind: str) -> str:
    engine = ProcessEngine(EngineConfig(model="probe", event_loop=kind), engine_factory=functools.partial(_probe))
    await engine.start()
    try:
        return engine.kv_stats()["loop"]
    finally:
        await engine.stop()
        assert engine.process.returncode == 0


# Run in a subprocess with a time limit: a ReadyMsg cut short by a non-blocking socket leaves the API process's
# blocking recv() waiting for ever on its event loop thread, where no timeout (asyncio's or pytest's) can end it.
_CASES = """
import json, sys
from tests.e2e.test_engine_process_loop import _child_loop
from voltserve import event_loop
print(json.dumps({f"{parent}/{kind}": event_loop.run(_child_loop(kind), parent)
                  for parent in ("asyncio", "uvloop") for kind in ("auto", "uvloop", "asyncio")}))
"""


def test_engine_process_runs_on_the_configured_loop():
    pytest.importorskip("uvloop")
    out = subprocess.run([sys.executable, "-c", _CASES], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == {f"{parent}/{kind}": {"asyncio": "asyncio"}.get(kind, "uvloop")
                                      for parent in ("asyncio", "uvloop") for kind in ("auto", "uvloop", "asyncio")}


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_watch_readable_keeps_the_socket_blocking(kind):
    if kind == "uvloop":
        pytest.importorskip("uvloop")
    from multiprocessing.connection import Connection

    async def check() -> bool:
        ours, theirs = socket.socketpair()
        conn = Connection(ours.detach())
        loop = asyncio.get_running_loop()
        got = loop.create_future()
        watch_readable(loop, conn, lambda: got.done() or got.set_result(conn.recv_bytes()))
        blocking = os.get_blocking(conn.fileno())
        theirs.sendall(b"\0\0\0\x05hello")  # Connection framing: 4-byte big-endian length, then the bytes
        assert await got == b"hello"
        loop.remove_reader(conn.fileno())
        conn.close()
        theirs.close()
        return blocking

    assert event_loop.run(check(), kind) is True


async def test_engine_process_without_uvloop(tmp_path, monkeypatch):
    """A `uvloop` that fails to import in the child (shadowed on the sys.path it is sent): auto falls back to
    asyncio's loop, uvloop is a ConfigError from start()."""
    (tmp_path / "uvloop").mkdir()
    (tmp_path / "uvloop" / "__init__.py").write_text("raise ImportError('uvloop hidden by a test')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert await _child_loop("auto") == "asyncio"
    engine = ProcessEngine(EngineConfig(model="probe", event_loop="uvloop"), engine_factory=functools.partial(_probe))
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        await engine.start()
    assert engine.process.returncode == 1
