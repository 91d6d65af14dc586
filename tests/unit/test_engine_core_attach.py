"""A shared engine's reads of connections that have not attached (`actors.engine_core.EngineCore`): bounded in
size and time, so that a stray client cannot hold the engine's event loop."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import pytest

from actors import engine_core
from actors.engine_core import EngineCore
from tests.unit.test_output_sender import _TinyEngine


@pytest.mark.parametrize("stray, most_s", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 0.1),  # its first bytes read as a 1.2 GB length: refused unread
    (struct.pack("!i", 100) + b"0123456789", engine_core.PENDING_RECV_TIMEOUT_S + 0.3),  # a message cut short
])
def test_a_stray_connection_is_dropped_without_holding_the_loop(stray, most_s):
    async def drive() -> tuple[float, bool]:
        loop = asyncio.get_running_loop()
        core = EngineCore(None, Pipe()[0], engine_factory=_TinyEngine)
        ours, theirs = socket.socketpair()
        engine_core._set_recv_timeout(ours.fileno(), engine_core.PENDING_RECV_TIMEOUT_S)  # as _accept does
        client = core._add_client(loop, Connection(ours.detach()), attached=False)
        theirs.sendall(stray)
        start = time.monotonic()
        core._on_readable(client)
        took = time.monotonic() - start
        theirs.close()
        return took, client.dropped

    took, dropped = asyncio.run(drive())
    assert dropped and took < most_s


@pytest.mark.parametrize("engine_len, attach_len, differ", [
    (0, 512, "max_model_len=512 (engine: 16, its default from the model)"),  # 16: _TinyEngine's effective one
    (512, 0, "max_model_len=0, the model's default (engine: 512)"),
])
def test_an_attach_with_another_max_model_len_names_what_0_means(engine_len, attach_len, differ):
    """0 is "the model's default", not a length: the engine's side shows what it came to (it said "engine: 0")."""
    from actors.engine_ipc import AttachMsg
    from voltserve.config import EngineConfig
    from voltserve.errors import ConfigError

    core = EngineCore(EngineConfig(max_model_len=engine_len).validate(), Pipe()[0], engine_factory=_TinyEngine)
    with pytest.raises(ConfigError, match="runs other settings: ") as info:
        core._attach(None, AttachMsg(EngineConfig(max_model_len=attach_len).validate()))
    assert str(info.value).endswith(differ)
