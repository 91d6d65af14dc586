"""The CLI (flags -> VOLTSERVE_* environment) and tools/bench_serving.py against the app with a ScriptedEngine."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tests.api.conftest import fixed_id
from tests.api.fake_engine import ScriptedEngine

from api import create_app
from voltserve import cli
from voltserve.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def test_cli_flags_become_environment(monkeypatch):
    for name in ("MODEL", "MAX_MODEL_LEN", "API_KEY", "SSE_KEEP_ALIVE_INTERVAL", "ENABLE_PREFIX_CACHING"):
        monkeypatch.delenv(f"VOLTSERVE_{name}", raising=False)
    args = cli.build_parser().parse_args([
        "serve", "some.gguf", "--max-model-len", "512", "--api-key", "k", "--sse-keep-alive-interval", "0.5",
        "--no-enable-prefix-caching"])
    cli._export_env(args)
    config = EngineConfig.from_env()
    assert (config.model, config.max_model_len, config.api_key) == ("some.gguf", 512, "k")
    assert (config.sse_keep_alive_interval, config.enable_prefix_caching) == (0.5, False)


def test_engine_process_flag_picks_the_engine(monkeypatch):
    from actors.engine_process import ProcessEngine
    from api.app import make_engine

    monkeypatch.setenv("VOLTSERVE_ENGINE_PROCESS", "")  # "" = unset; and undone after the test
    assert EngineConfig.from_env().engine_process is True  # the HTTP server's default
    cli._export_env(cli.build_parser().parse_args(["serve", "--no-engine-process"]))
    config = EngineConfig.from_env()
    assert config.engine_process is False and type(make_engine(config)).__name__ == "AsyncEngine"
    monkeypatch.setenv("VOLTSERVE_ENGINE_PROCESS", "1")
    assert isinstance(make_engine(EngineConfig.from_env()), ProcessEngine)


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == "voltserve 0.1.0"


def test_cli_bad_config_exits_2(monkeypatch):
    monkeypatch.delenv("VOLTSERVE_DEVICE", raising=False)
    assert cli.main(["serve", "--device", "tpu"]) == 2


@pytest.mark.parametrize("processes", ["1", "3"])
def test_cli_unknown_model_exits_2_before_anything_starts(monkeypatch, caplog, processes):
    """A wrong model name or path: one error line and status 2, before a port, a process or torch is touched."""
    monkeypatch.delenv("VOLTSERVE_DEVICE", raising=False)
    with caplog.at_level(logging.ERROR, logger="voltserve.cli"):
        assert cli.main(["serve", "/no/such/model", "--api-processes", processes, "--port", "1"]) == 2
    assert [r.getMessage() for r in caplog.records] == [
        "bad configuration: unknown model '/no/such/model': pass a local .gguf file, a local Hugging Face directory "
        "(with config.json) or one of the built-in aliases: smollm2-135m-instruct"]


def test_cli_imports_no_torch():
    """`voltserve --help` and the --api-processes supervisor stay light (the model check included)."""
    code = "import sys, voltserve.cli, loaders.sources; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_cli_signal_during_the_stop_exits_130_with_one_line(monkeypatch, caplog):
    """A SIGINT after the drain (the handlers are gone then, so Python raises KeyboardInterrupt in the engine's
    stop): status 130 and one warning, not a traceback."""
    def interrupted(coro, kind):
        coro.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.event_loop, "run", interrupted)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "VOLTSERVE_ENGINE_SOCKET"})
    with caplog.at_level(logging.WARNING, logger="voltserve.cli"):
        assert cli.main(["serve", "smollm2-135m-instruct", "--device", "cpu", "--port", "0"]) == 130
    assert [r.getMessage() for r in caplog.records if r.name == "voltserve.cli"] == [
        "interrupted while shutting down: exiting with status 130 (the engine process ends on its own once this "
        "process is gone)"]


def test_cli_unreadable_model_dir_exits_2_before_loading(caplog, tmp_path):
    """A Hugging Face directory whose config.json says nothing: read as the loader reads it, before the engine
    starts; one line naming the file and the keys it lacks, status 2 (it used to fail the app's startup, status 1;
    then it said "no readable config.json")."""
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["serve", str(tmp_path), "--device", "cpu", "--port", "0"]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        f"bad configuration: {tmp_path / 'config.json'} lacks required key(s): 'architectures', 'vocab_size', "
        "'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads'"]


def _serve_subprocess(argv: list[str], setup: str = "") -> subprocess.CompletedProcess:
    """`voltserve serve ARGV` in a fresh interpreter (its app is built from the environment at import), after
    `setup` (Python run first)."""
    code = f"import sys\n{setup}\nfrom voltserve.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "serve", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "VOLTSERVE_API_KEY": "", "VOLTSERVE_ENGINE_SOCKET": ""})


@pytest.mark.parametrize("engine_process", ["--engine-process", "--no-engine-process"])
def test_cli_model_that_fails_to_load_exits_2_with_one_line(tmp_path, engine_process):
    """A model that passes the checks before the load and fails in it (no tokenizer.json): the engine's
    LoaderError is one error line (no traceback, none from the engine process) and status 2."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
        "num_hidden_layers": 2, "vocab_size": 320}))
    done = _serve_subprocess([str(tmp_path), "--device", "cpu", "--port", "0", engine_process])
    assert done.returncode == 2, done.stderr[-2000:]
    assert [line.partition(" ERROR ")[2] for line in done.stderr.splitlines() if " ERROR " in line] == [
        f"api.app: bad configuration: {tmp_path} has no tokenizer.json"]
    assert "Traceback" not in done.stderr


def test_cli_failed_startup_exits_1_with_one_line():
    """The engine's start fails unexpectedly (not a bad setting or model file): the app's startup fails; status
    1 and a line naming the cause (no traceback of hypercorn's own)."""
    setup = ("from actors.engine_process import ProcessEngine\n"
             "async def start(self): raise RuntimeError('no engine today')\n"
             "ProcessEngine.start = start")
    done = _serve_subprocess(["--device", "cpu", "--port", "0"], setup)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "exiting with status 1: the server did not start: Lifespan failure in startup. 'no engine today'" \
        in done.stderr
    assert "LifespanFailureError" not in done.stderr


async def test_a_bad_setting_that_fails_the_apps_startup_is_one_line(caplog):
    """Under `hypercorn api:app` too: a ConfigError / LoaderError from the engine's start is logged in one line,
    without a traceback, and kept for `voltserve serve`'s status 2; other errors keep Quart's traceback."""
    from api.state import EXTENSION_KEY
    from voltserve.errors import ConfigError

    class Failing(ScriptedEngine):
        async def start(self):
            raise self.error

    for error, message, traceback in [(ConfigError("the KV pool is too small"),
                                       "bad configuration: the KV pool is too small", False),
                                      (RuntimeError("boom"), "Exception", True)]:
        engine = Failing(scripts=["x"])
        engine.config, engine.error = EngineConfig(model="m").validate(), error
        app = create_app(engine)
        caplog.clear()
        with pytest.raises(type(error)):
            await app.startup()
        (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert (record.getMessage(), record.exc_info is not None) == (message, traceback)
        assert app.extensions[EXTENSION_KEY].start_error is (error if not traceback else None)


async def test_bench_serving_report(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "tools" / "bench_serving.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_serving", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    engine = ScriptedEngine(scripts=["abcdefgh"])
    engine.config = EngineConfig(model="test-model").validate()
    app = create_app(engine, new_id=fixed_id)
    args = bench.parse_args(["--base-url", "http://bench", "--concurrency", "1,2", "--max-tokens", "4"])
    report = await bench.bench(args, transport=httpx.ASGITransport(app=app))
    assert report["model"] == "test-model"
    assert [(r["concurrency"], r["num_requests"], r["num_errors"], r["output_tokens"]) for r in report["results"]] \
        == [(1, 4, 0, 16), (2, 4, 0, 16)]
    level = report["results"][0]
    assert set(level["ttft_s"]) == {"p50", "p90", "p99", "mean"} and level["ttft_s"]["p50"] >= 0
    assert level["tpot_s"]["p50"] is not None and level["output_tokens_per_s"] > 0
    assert {(p.temperature, p.top_p) for _, p, _ in engine.requests} == {(0.0, 1.0)} and "temperature" not in report
    args = bench.parse_args(["--base-url", "http://bench", "--concurrency", "1", "--max-tokens", "4",
                             "--temperature", "0.7", "--top-p", "0.9"])
    report = await bench.bench(args, transport=httpx.ASGITransport(app=app))
    assert (report["temperature"], report["top_p"]) == (0.7, 0.9) and report["results"][0]["output_tokens"] == 16
    assert {(round(p.temperature, 6), round(p.top_p, 6)) for _, p, _ in engine.requests[8:]} == {(0.7, 0.9)}
