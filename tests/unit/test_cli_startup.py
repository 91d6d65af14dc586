"""`voltserve serve` with bad startup input: one line and exit status 2 before the model loads (the address, the
model file, the KV pool against max_model_len, flag values), never a traceback after it."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from tests.loaders.test_gguf import write_tiny_gguf
from voltserve import cli
from voltserve.config import ConfigError, EngineConfig


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)  # context length 256, 2 layers, 2 KV heads of 16
    return path


@pytest.fixture
def taken_port():
    """A port another socket listens on (with SO_REUSEADDR, as a server's)."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_taken_port_is_one_line_before_the_model_loads(caplog, tiny_gguf, taken_port, processes):
    """One API process or several: the same line naming host:port and the OS's reason, status 2 (one API process
    used to load the model first, then fail with hypercorn's traceback and status 1)."""
    args = ["serve", str(tiny_gguf), "--device", "cpu", "--port", str(taken_port), "--api-processes", processes]
    assert cli.main(args) == 2
    assert _errors(caplog) == [f"bad configuration: cannot listen on 127.0.0.1:{taken_port}: Address already in use "
                               "(--host / --port)"]


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_uds_path_too_long_for_a_unix_socket_is_one_line_naming_it(caplog, tiny_gguf, processes):
    """Linux binds a Unix socket path of up to 107 bytes; one longer is refused before anything starts, in a line
    that names the path, its length and the limit (it said "uds must be a path of at most 100 bytes", and refused
    paths of 101-107 bytes that Linux binds)."""
    path = "/tmp/" + "u" * 103
    args = ["serve", str(tiny_gguf), "--device", "cpu", "--uds", path, "--api-processes", processes]
    assert cli.main(args) == 2
    assert _errors(caplog) == [f"bad configuration: uds {path!r} is 108 bytes long: a Unix socket's path holds at "
                               "most 107 bytes (choose a shorter one)"]


def test_the_port_is_held_from_before_the_load_and_served(monkeypatch, caplog, tiny_gguf):
    """One API process listens before anything loads and hands that socket to hypercorn (`fd://`): no other
    process can take the port during the load, and `--port 0` logs the port the OS chose."""
    import hypercorn.asyncio

    seen = {}

    async def fake_serve(app, hconfig, shutdown_trigger=None):
        (bind,) = hconfig.bind
        with socket.socket(fileno=int(bind.removeprefix("fd://"))) as served:  # as hypercorn: it closes it
            seen["port"] = served.getsockname()[1]
            assert not served.get_inheritable()  # the engine process never holds the port
            with socket.socket() as other, pytest.raises(OSError):  # taken while the model would load
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                other.bind(("127.0.0.1", seen["port"]))

    monkeypatch.setattr(hypercorn.asyncio, "serve", fake_serve)
    caplog.set_level(logging.INFO)
    assert cli.main(["serve", str(tiny_gguf), "--device", "cpu", "--port", "0"]) == 0
    assert seen["port"] > 0
    assert any(f"on http://127.0.0.1:{seen['port']} (" in r.getMessage() for r in caplog.records)


def test_the_served_socket_is_closed_once(monkeypatch, tiny_gguf):
    """hypercorn owns the fd it serves (`fd://`: it wraps and closes it on shutdown), so `voltserve serve` must not
    close it again: its socket object did once it was collected, closing whatever reused that fd number since;
    and a startup that fails before hypercorn takes the socket closes it (the port is free again)."""
    import gc

    import hypercorn.asyncio
    from hypercorn.utils import LifespanFailureError

    seen = {}

    async def fake_serve(app, hconfig, shutdown_trigger=None):  # as hypercorn: wrap the fd, serve, close it
        (bind,) = hconfig.bind
        socket.socket(fileno=int(bind.removeprefix("fd://"))).close()
        seen["fds"] = os.pipe()  # takes the fd number just freed

    monkeypatch.setattr(hypercorn.asyncio, "serve", fake_serve)
    assert cli.main(["serve", str(tiny_gguf), "--device", "cpu", "--port", "0"]) == 0
    gc.collect()
    for fd in seen["fds"]:
        os.fstat(fd)  # still open
        os.close(fd)

    async def failed_startup(app, hconfig, shutdown_trigger=None):
        with socket.socket(fileno=os.dup(int(hconfig.bind[0].removeprefix("fd://")))) as served:
            seen["port"] = served.getsockname()[1]
        raise LifespanFailureError("startup", "no engine today")

    monkeypatch.setattr(hypercorn.asyncio, "serve", failed_startup)
    assert cli.main(["serve", str(tiny_gguf), "--device", "cpu", "--port", "0"]) == 1
    with socket.socket() as again:  # the port is free: the socket was closed, not left open
        again.bind(("127.0.0.1", seen["port"]))


@pytest.mark.parametrize("host, port, message", [
    ("192.0.2.1", "0", "cannot listen on 192.0.2.1:0: "),  # TEST-NET-1: no address of this host
    ("no-such-host.invalid", "0", "cannot listen on no-such-host.invalid:0: "),
    ("127.0.0.1", "70000", "port must be in 0..65535, not 70000"),
])
def test_a_bad_host_or_port_is_one_line(caplog, tiny_gguf, host, port, message):
    assert cli.main(["serve", str(tiny_gguf), "--device", "cpu", "--host", host, "--port", port]) == 2
    (line,) = _errors(caplog)
    assert line.startswith("bad configuration: " + message)


@pytest.mark.parametrize("keep", [0, 3, 200, "half"])
def test_an_empty_truncated_or_corrupt_gguf_is_one_line_naming_it(caplog, tiny_gguf, keep):
    """Cut in the magic, in the metadata or in the tensor data: refused before the engine starts, in words."""
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[:len(data) // 2 if keep == "half" else keep])
    assert cli.main(["serve", str(tiny_gguf), "--device", "cpu", "--port", "0"]) == 2
    (line,) = _errors(caplog)
    assert line.startswith(f"bad configuration: {tiny_gguf} is ")
    assert "truncated or corrupt" in line


@pytest.mark.parametrize("flags, message", [
    (["--num-kv-blocks", "4", "--max-model-len", "65"],
     "the KV pool (4 blocks of 16 tokens = 64 tokens) cannot hold one sequence of max_model_len 65"),
    (["--kv-cache-memory-gb", "1e-6", "--max-model-len", "16"], "kv_cache_memory_gb 1e-06 GiB holds no KV block"),
    (["--kv-cache-memory-gb", "0"], "kv_cache_memory_gb must be > 0, not 0"),
    (["--kv-cache-memory-gb", "-1"], "kv_cache_memory_gb must be > 0, not -1"),
    (["--kv-cache-memory-gb", "nan"], "kv_cache_memory_gb must be > 0, not nan"),  # was a ValueError traceback
    (["--kv-cache-memory-gb", "inf"], "kv_cache_memory_gb must be > 0, not inf"),
    (["--num-threads", "-1"], "num_threads must be >= 0 (0 = auto), not -1"),
    (["--shutdown-timeout", "nan"], "shutdown_timeout must be a number of seconds >= 0, not nan"),  # was accepted
    (["--sse-keep-alive-interval", "inf"], "sse_keep_alive_interval must be a number of seconds >= 0, not inf"),
    (["--gpu-busy-log-interval", "-2"], "gpu_busy_log_interval must be a number of seconds >= 0, not -2"),
])
def test_a_kv_pool_or_thread_count_that_cannot_work_is_one_line(caplog, tiny_gguf, flags, message):
    assert cli.main(["serve", str(tiny_gguf), "--device", "cpu", "--port", "0", *flags]) == 2
    (line,) = _errors(caplog)
    assert line.startswith("bad configuration: " + message)


def test_the_kv_pool_check_matches_the_engines_sizing(tiny_gguf, monkeypatch):
    """The CPU pool from kv_cache_memory_gb: 2 layers x K,V x 16 tokens x 2 KV heads x 16 x 4 bytes = 8 KiB a block;
    64 KiB hold 8 blocks = 128 tokens: max_model_len 128 fits, 129 does not (the engine's `pool_max_model_len`)."""
    from voltserve import preflight

    def config(max_model_len):
        return EngineConfig(model=str(tiny_gguf), device="cpu", kv_cache_memory_gb=64 / 2**20,
                            max_model_len=max_model_len).validate()

    preflight.check_model(config(128))
    with pytest.raises(ConfigError, match="8 blocks of 16 tokens = 128 tokens"):
        preflight.check_model(config(129))
    monkeypatch.setattr(preflight, "NVIDIA_SIGNS", (str(tiny_gguf),))  # "auto" may mean a GPU: not checked
    preflight.check_model(EngineConfig(model=str(tiny_gguf), kv_cache_memory_gb=64 / 2**20,
                                       max_model_len=129).validate())


def test_kv_cache_memory_gb_zero_is_unused_beside_num_kv_blocks():
    """--num-kv-blocks sizes the pool: --kv-cache-memory-gb is unused then, and 0 (accepted before the check that
    refuses 0 GiB came) still starts; alone, 0 GiB holds no block."""
    assert EngineConfig(num_kv_blocks=64, kv_cache_memory_gb=0).validate().num_kv_blocks == 64
    with pytest.raises(ConfigError, match="kv_cache_memory_gb must be > 0, not 0"):
        EngineConfig(kv_cache_memory_gb=0).validate()
    with pytest.raises(ConfigError, match="kv_cache_memory_gb must be > 0, not -1"):
        EngineConfig(num_kv_blocks=64, kv_cache_memory_gb=-1).validate()


def test_num_threads_zero_is_auto_and_negative_an_error():
    assert EngineConfig(num_threads=0).validate().num_threads == 0
    with pytest.raises(ConfigError, match="num_threads must be >= 0"):
        EngineConfig(num_threads=-2).validate()


def test_model_and_dash_dash_model_must_agree(caplog, tiny_gguf, monkeypatch):
    """Both MODEL and --model: different ones are refused (--model used to win silently); the same one (also as
    another path of the same file) is taken."""
    assert cli.main(["serve", str(tiny_gguf), "--model", "other.gguf", "--port", "0"]) == 2
    assert _errors(caplog) == [f"bad configuration: MODEL {str(tiny_gguf)!r} and --model 'other.gguf' name "
                               "different models: give one of them"]
    monkeypatch.chdir(tiny_gguf.parent)
    for same in (str(tiny_gguf), "tiny.gguf", "./tiny.gguf"):
        monkeypatch.delenv("VOLTSERVE_MODEL", raising=False)
        cli._export_env(cli.build_parser().parse_args(["serve", str(tiny_gguf), "--model", same]))
        assert os.environ["VOLTSERVE_MODEL"] == str(tiny_gguf)


def test_api_processes_that_waited_for_a_shared_start_report_a_bad_model_as_the_starter_does(tmp_path):
    """`--api-processes N` / `hypercorn -w N` on a shared engine whose start fails on a bad model file (what only
    the load tells, e.g. a missing tokenizer.json): the API processes that waited for it fail with the same error
    type (so `voltserve serve` says one line and exits 2 in each), not an EngineDeadError with a traceback and
    status 1 in all but the first; any other error stays an EngineDeadError."""
    from actors import engine_socket
    from actors.engine_process import _raise_if_failed_meanwhile
    from voltserve.errors import EngineDeadError, LoaderError, UnsupportedModelError

    path = str(tmp_path / "engine.sock")
    for error in (LoaderError("/m has no tokenizer.json"), UnsupportedModelError("rope scaling"),
                  ConfigError("the KV pool cannot hold one sequence")):
        engine_socket.record_failure(path, error)
        with pytest.raises(type(error)) as info:
            _raise_if_failed_meanwhile(path, None)
        assert str(info.value) == (f"the shared engine at {path} failed to start while this API process waited for "
                                   f"it: {type(error).__name__}: {error}")
    engine_socket.record_failure(path, RuntimeError("CUDA error: out of memory"))
    with pytest.raises(EngineDeadError, match="waited for it: RuntimeError: CUDA error: out of memory"):
        _raise_if_failed_meanwhile(path, None)


def test_model_and_dash_dash_model_may_spell_one_alias_differently(monkeypatch):
    """The loader reads an alias case-insensitively, spaces aside: MODEL SmolLM2-135M-Instruct with --model
    smollm2-135m-instruct name one model (refused before as "different models"); an alias and a path do not."""
    for model, flag in (("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
                        (" smollm2-135m-instruct", "SMOLLM2-135M-INSTRUCT")):
        monkeypatch.delenv("VOLTSERVE_MODEL", raising=False)
        cli._export_env(cli.build_parser().parse_args(["serve", model, "--model", flag]))
        assert os.environ["VOLTSERVE_MODEL"] == model
    with pytest.raises(ConfigError, match="name different models"):
        cli._export_env(cli.build_parser().parse_args(["serve", "smollm2-135m-instruct", "--model", "x.gguf"]))


def test_the_engine_refuses_device_cuda_where_torch_sees_no_gpu(monkeypatch):
    """A driver but no GPU for torch (a CPU-only build, CUDA_VISIBLE_DEVICES=""): a ConfigError (one line, exit 2
    from `voltserve serve`), not an AttributeError from torch's first CUDA call."""
    import torch

    from actors.build import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^device cuda: torch \S+ sees no CUDA GPU \(a CPU-only torch build, no "
                                          r"NVIDIA driver, or CUDA_VISIBLE_DEVICES hides the GPUs\); use device "
                                          r"auto or cpu$"):
        resolve_device("cuda")
    assert resolve_device("cpu") == resolve_device("auto") == "cpu"


@pytest.mark.parametrize("sig, status, line", [
    ("SIGINT", 130, "interrupted before the server started: exiting with status 130"),
    ("SIGTERM", 0, "SIGTERM before the server started: exiting with status 0")])
def test_a_signal_before_the_server_starts_is_one_line(tiny_gguf, sig, status, line):
    """SIGINT while `voltserve serve` imports and checks (before its own handlers) was a KeyboardInterrupt
    traceback; now one warning line and exit status 130, as a SIGINT that cuts the shutdown short. SIGTERM there
    (`systemctl stop` in a start's first seconds) killed the process with no line (status 143, seen on the GPU
    machine 3 s into a start); now a clean stop, status 0, as during the model's load."""
    import subprocess
    import sys

    script = ("import os, signal, sys\nfrom voltserve import cli, preflight\n"
              f"preflight.check_model = lambda config: os.kill(os.getpid(), signal.{sig})\n"
              f"sys.exit(cli.main(['serve', {str(tiny_gguf)!r}, '--device', 'cpu', '--port', '0']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr
    assert [ln.split(" ", 2)[2] for ln in done.stderr.splitlines()] == [f"WARNING voltserve.cli: {line}"]


def test_a_kv_pool_the_host_cannot_allocate_is_a_config_error():
    """torch's allocator refusing the pool (`--kv-cache-memory-gb 200` on a 23 GiB host) was a RuntimeError
    traceback and exit status 1; now a ConfigError (one 'bad configuration' line, exit 2) giving the pool's size."""
    from types import SimpleNamespace

    import torch

    from actors.build import allocate_kv

    def refuse(*shape):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 214748282880 bytes. Error code 12 (Cannot allocate memory)")

    cfg = SimpleNamespace(num_layers=30, head_dim=64)
    model = SimpleNamespace(config=cfg, num_kv_heads=3,
                            backend=SimpleNamespace(dtype=torch.float32, allocate_kv_cache=refuse))
    with pytest.raises(ConfigError, match=r"^the KV pool \(291271 blocks of 16 tokens, 200\.0 GiB\) cannot be "
                                          r"allocated: not enough memory; lower kv_cache_memory_gb \(GPU: "
                                          r"gpu_memory_utilization\) or num_kv_blocks$"):
        allocate_kv(model, 291271, 16)

    def other(*shape):
        raise RuntimeError("some other failure")

    model.backend.allocate_kv_cache = other
    with pytest.raises(RuntimeError, match="some other failure"):  # not every RuntimeError is the operator's
        allocate_kv(model, 1, 16)


@pytest.mark.parametrize("tp, message", [
    ("3", "num_attention_heads (4) must divide by tensor_parallel_size (3)"),
    ("4", "num_key_value_heads (2) must divide by tensor_parallel_size (4)"),
])
def test_a_tp_size_that_does_not_divide_the_model_is_one_line_before_anything_starts(caplog, tiny_gguf, monkeypatch,
                                                                                     tp, message):
    """Read from the model's header: refused before the port, the engine and its rank processes (each of which
    used to load the whole model first, to fail with the same line seconds or minutes later)."""
    def started(*args):
        raise AssertionError("the server started")

    monkeypatch.setattr(cli.preflight, "listen", started)
    assert cli.main(["serve", str(tiny_gguf), "--device", "cpu", "--tensor-parallel-size", tp]) == 2
    assert _errors(caplog) == [f"bad configuration: tensor parallel: {message}"]


def test_the_tp_check_covers_the_mlp_and_imports_no_torch(tmp_path):
    """intermediate_size 258 over 4 ranks (heads 8 and KV heads 4 divide); the check reads config.json only and
    leaves torch unimported, as the rest of the model check."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 128,
        "intermediate_size": 258, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5}))
    code = ("import sys\nfrom voltserve import preflight\nfrom voltserve.config import EngineConfig\n"
            f"config = EngineConfig(model={str(tmp_path)!r}, device='cpu', tensor_parallel_size=4).validate()\n"
            "try:\n    preflight.check_model(config)\nexcept Exception as exc:\n    print(exc)\n"
            "print('torch' in sys.modules)\n")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == [
        "tensor parallel: intermediate_size (258) must divide by tensor_parallel_size (4)", "False"]


def test_only_a_missing_cuda_python_is_a_config_error_for_device_cuda(monkeypatch):
    """cuda-python absent: the operator's to install (ConfigError); any other import failure is a defect of
    ours and keeps its traceback."""
    import builtins

    import torch

    from actors.build import resolve_device

    real_import = builtins.__import__
    missing = {}

    def fake_import(name, *args, **kwargs):
        if name == "cuda.bindings.driver":
            raise ModuleNotFoundError(f"No module named {missing['name']!r}", name=missing["name"])
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    missing["name"] = "cuda"
    with pytest.raises(ConfigError, match=r"^device cuda: the CUDA backend cannot load \(No module named 'cuda'"):
        resolve_device("cuda")
    missing["name"] = "voltserve.backends.cuda.typo"
    with pytest.raises(ModuleNotFoundError, match="typo"):
        resolve_device("cuda")
