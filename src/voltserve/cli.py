"""`voltserve` command line: `voltserve serve [MODEL] [--flags]` runs the HTTP server (hypercorn on `api:app`).

Every flag is named like an `EngineConfig` field (`--max-model-len` <-> `max_model_len` <->
`VOLTSERVE_MAX_MODEL_LEN`). Flags are passed on as `VOLTSERVE_*` environment variables, so the app reads the
same settings whether it is started here or by `hypercorn api:app`: flag > environment > default.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m voltserve.cli` is `python -m voltserve`: the early signal handlers before
    import sys  # the imports below (`voltserve.console.main`, which imports this module anew and runs it)

    from voltserve.console import main as _entry

    sys.exit(_entry())

import argparse
import dataclasses
import functools
import logging
import os
import signal

from actors.engine_socket import remove_if_same
from loaders.sources import ALIASES
from voltserve import __version__, console, event_loop, preflight
from voltserve.api_processes import (
    LISTEN_FD_ENV, PARENT_FD_ENV, endpoint, release_uds, run_api_processes, unlock_uds, watch_parent,
)
from voltserve.config import EngineConfig, prometheus_multiproc_dir
from voltserve.errors import INPUT_ERRORS, ConfigError
from voltserve.log_setup import configure_logging
from voltserve.start_report import start_reported_elsewhere

logger = logging.getLogger("voltserve.cli")
STARTUP_TIMEOUT_S = 3600.0  # the app's startup: the model's load (and, on a GPU, its CUDA graphs' capture)

HELP = {
    "model": "model: the alias smollm2-135m-instruct, a .gguf file or a Hugging Face directory (MODEL or --model; "
             "both only when they name the same one)",
    "served_model_name": "name clients send as `model` (default: MODEL)",
    "device": "auto, cpu or cuda",
    "dtype": "compute dtype of the CPU backend: float32, bfloat16, float16",
    "max_model_len": "context window in tokens; 0 = the model's own (capped to the KV pool); above the model's own "
                     "it is served with a warning (output past the trained length may degrade); more than the KV "
                     "pool holds is an error",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step",
    "admission_wait_steps": "steps a new request may wait to start together with others rather than alone in "
                            "a step of running decodes (fewer mixed steps, up to that many steps' more TTFT); 0 = "
                            "none",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "KV pool size in blocks; 0 = size it from --kv-cache-memory-gb",
    "kv_cache_memory_gb": "memory for the KV pool (GiB, > 0) when --num-kv-blocks is 0",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "api_key": "require this key (Bearer or x-api-key) on every route but /health",
    "sse_keep_alive_interval": "seconds of idle stream before a ': keep-alive' comment; 0 = off",
    "stream_interval": "tokens a stream gathers before each SSE chunk is written; 1 = every token",
    "host": "address to listen on (checked before the model loads)",
    "port": "TCP port to listen on, 0-65535 (checked before the model loads)",
    "uds": "Unix socket path to listen on instead of --host / --port (e.g. behind nginx on this host); a socket "
           "file left by a server that is gone is replaced (under the lock PATH.lock), the socket is removed at exit",
    "num_threads": "torch intra-op threads on the CPU (>= 0); 0 = one per core less one for the HTTP server (at "
                   "least 1)",
    "weight_format": "CPU: auto (int4 kernels for Q4 weights, bf16 for other quantized ones, where available) "
                     "or float (the fp32 reference)",
    "gguf_convert": "auto: GGUF Q4_K weights load as Q4_1 (near-lossless), Q5_0/Q5_1/Q2_K/Q3_K/Q5_K/Q6_K and "
                    "the i-quants (IQ4_XS, ...) as Q8_0 (requantized), so they run on the quantized kernels; off: "
                    "as their exact values in floats",
    "tensor_parallel_size": "ranks (GPUs) one model is split over; > 1 runs each rank in its own process, steps eagerly",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and the KV pool",
    "enforce_eager": "run every step eagerly instead of replaying CUDA graphs",
    "mixed_graphs": "also replay CUDA graphs for steps mixing prefills (<= 512 tokens) with decodes",
    "pdl": "programmatic dependent launch on SM90+ GPUs (kernels overlap their start with the previous one)",
    "gpu_busy_log_interval": "seconds between log lines with the GPU's busy share of wall time (CUDA); 0 = off",
    "exit_on_engine_death": "shut the server down (exit 1) when the engine dies, so a supervisor restarts it "
                            "(default on here)",
    "engine_process": "run the engine in its own process, apart from HTTP (default on)",
    "api_processes": "API processes (HTTP, tokenization) serving the port, all on one engine process: spreads "
                     "the HTTP work of many concurrent streams over cores (hypercorn api:app: use -w N and "
                     "VOLTSERVE_ENGINE_SOCKET instead)",
    "engine_socket": "Unix socket path of a shared engine: API processes started with the same path (e.g. the "
                     "workers of hypercorn -w N) share one engine process; the first starts it",
    "event_loop": "event loop of the server and the engine process: auto (uvloop when installed), uvloop, asyncio",
    "shutdown_timeout": "seconds open requests may finish after SIGINT/SIGTERM before they are ended (new ones: 503)",
    "chat_template": "a Jinja2 chat template file to use instead of the model's own",
    "tool_call_parser": "how tool calls are read from the output when a request gives tools: auto (hermes when "
                        "the chat template writes <tool_call>), hermes, none",
    "reasoning_parser": "how reasoning (<think> ... </think>) is split from the content: auto (qwen3 when the "
                        "chat template mentions <think>), qwen3, deepseek_r1 (output starts inside), none",
    "trust_request_mm_kwargs": "accept per-request mm_processor_kwargs / media_io_kwargs (no effect: the models "
                               "served are text-only); off: such a request gets a 400",
    "speculative_method": "speculative decoding: none, ngram (prompt-lookup drafts) or draft_model (a smaller "
                          "model's drafts, --speculative-model), verified in one step; greedy output unchanged",
    "speculative_model": "the draft model of --speculative-method draft_model (GGUF, HF directory or alias), "
                         "with the model's tokenizer",
    "num_speculative_tokens": "the most drafts a sequence verifies in one step (k)",
    "ngram_min": "the shortest suffix the n-gram drafter matches",
    "ngram_max": "the longest suffix the n-gram drafter matches",
    "concurrency_drafts": "verify width by running sequences, a JSON object such as '{\"4\": 3, \"5\": 4}' "
                          "(thresholds >= 2, widths 1..k); below the lowest threshold all k",
    "speculative_disable_by_batch_size": "no drafts while at least this many sequences run (>= 2; their steps "
                                         "are planned ahead again on a GPU); 0: draft at every concurrency",
    "draft_max_pause": "after m verifies in a row that accept no draft a sequence decodes 2^m tokens without "
                       "drafts, at most this many; 0: never pauses",
    "speculative_gate": "auto: measure output tokens/s of decode steps with and without drafts per concurrency, "
                        "in epochs, and draft only where that is faster; off: always draft",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _nonempty(value: str, unset_flag: str = "") -> str:
    """argparse type of the string flags (and MODEL): an empty value is a usage error. The app reads an empty
    `VOLTSERVE_*` variable as unset, so `--uds ''` (an unset shell variable) silently served on TCP, `--api-key ''`
    without a key, `--model ''` the default model. A flag unset by default is unset on purpose with its `--no-`
    form (`unset_flag`, named in the error), which overrides its variable.

    Raises:
        argparse.ArgumentTypeError: `value` is empty.
    """
    if not value:
        hint = f"; {unset_flag} unsets it" if unset_flag else ""
        raise argparse.ArgumentTypeError(f"must not be empty (leave it out for the default{hint})")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `voltserve` argument parser; `serve` gets one flag per EngineConfig field (default None = unset)."""
    parser = argparse.ArgumentParser(prog="voltserve", description="LLM inference server (OpenAI-compatible API)")
    parser.add_argument("--version", action="version", version=f"voltserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP",
                                description="Serve a model over HTTP (hypercorn on api:app).")
    serve.add_argument("model_positional", nargs="?", metavar="MODEL", type=_nonempty, help=HELP["model"])
    for f in dataclasses.fields(EngineConfig):
        flag, variable = _flag(f.name), f"VOLTSERVE_{f.name.upper()}"
        unset_flag = "--no-" + flag.removeprefix("--") if f.default == "" else ""
        kind = functools.partial(_nonempty, unset_flag=unset_flag) if type(f.default) is str else type(f.default)
        extra = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind, "metavar": f.name.upper()}
        serve.add_argument(flag, dest=f.name, default=None, help=HELP.get(f.name, f.name), **extra)
        if unset_flag:  # flag > environment: the way to turn off a setting its variable makes (`--no-uds`: TCP)
            serve.add_argument(unset_flag, dest=f.name, action="store_const", const="",
                               help=f"unset {flag}, whatever {variable} says")
    serve.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                       help="log level of both processes (default: VOLTSERVE_LOG_LEVEL, else info)")
    return parser


def _same_model(a: str, b: str) -> bool:
    """Whether two model specs name the same model: equal, one built-in alias however spelled (as the loader reads
    it: case and surrounding spaces aside), or paths of the same file or directory."""
    alias_a, alias_b = a.strip().lower(), b.strip().lower()
    if alias_a in ALIASES or alias_b in ALIASES:  # an alias is one before it is a path (`check_model_spec`)
        return alias_a == alias_b
    return a == b or os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def _export_env(args: argparse.Namespace) -> None:
    """Set `VOLTSERVE_<FIELD>` for every flag given (the app reads its config from the environment).

    Raises:
        ConfigError: MODEL and --model name different models (neither silently wins).
    """
    if args.model_positional:
        if args.model is not None and not _same_model(args.model_positional, args.model):
            raise ConfigError(f"MODEL {args.model_positional!r} and --model {args.model!r} name different models: "
                              "give one of them")
        args.model = args.model_positional
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name)
        if value is not None:
            os.environ[f"VOLTSERVE_{f.name.upper()}"] = ("1" if value else "0") if isinstance(value, bool) else str(value)


def serve(args: argparse.Namespace) -> int:
    """Run hypercorn on `api:app` until SIGINT/SIGTERM, then drain the requests in flight for up to
    `--shutdown-timeout` s (`api.app.SignalDrain`). Returns the exit status."""
    os.environ.setdefault("VOLTSERVE_EXIT_ON_ENGINE_DEATH", "1")  # a dead engine ends the process (exit 1)
    try:  # fail fast, before the model loads: one line and status 2
        _export_env(args)
        config = EngineConfig.from_env()
        loop_name = event_loop.resolve(config.event_loop)  # fails when uvloop is asked for but missing
        prometheus_multiproc_dir()  # a set but missing folder
        if not config.engine_socket:  # else the engine resolves it (one may already run, started elsewhere)
            preflight.check_model(config)  # the draft model too, and the KV pool where its size is known
        listener, uds_inode = None, 0  # one of several API processes serves its supervisor's socket (LISTEN_FD_ENV)
        if not os.environ.get(LISTEN_FD_ENV):
            listener, uds_inode = preflight.listen(config)
    except INPUT_ERRORS as exc:
        logger.error("bad configuration: %s", exc)
        return 2
    if config.api_processes > 1:
        if listener is not None:
            listener.close()  # the supervisor opens its own, inherited by its API processes
            if uds_inode:  # (its lock stays held: the supervisor's socket takes the path under it)
                remove_if_same(config.uds, uds_inode)
        try:
            _check_signals()  # during the checks: stop here (SIGINT 130), not start API processes to stop them
            return run_api_processes(config, args.log_level)
        except ConfigError as exc:
            logger.error("bad configuration: %s", exc)
            return 2
        except OSError as exc:  # taken since the check above
            logger.error("bad configuration: %s", preflight.listen_error(config, exc))
            return 2
        finally:
            unlock_uds(config.uds)
    try:
        return _serve_here(config, listener, loop_name)
    finally:  # whatever ended it, a signal before SignalDrain's handlers too (`import api` takes a second or so)
        if uds_inode:  # our socket file goes with the server (a proxy then gets "no such file", not a refusal)
            release_uds(config.uds, uds_inode)


def _serve_here(config: EngineConfig, listener, loop_name: str) -> int:
    """`serve` in this process after the checks: hypercorn on `api:app`, on `listener` (None: one of several API
    processes, on its supervisor's socket, `LISTEN_FD_ENV`). Returns the exit status."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.utils import LifespanFailureError

    listen_fd = os.environ.pop(LISTEN_FD_ENV, "")  # set when this is one of several API processes
    parent_fd = os.environ.pop(PARENT_FD_ENV, "")
    port = config.port
    if listener is not None and not config.uds:
        port = listener.getsockname()[1]  # --port 0: the one the OS chose
    import api  # builds the app from the environment set above (checked: a bad variable returned 2 already)

    _check_signals()  # during the checks and imports (inside the `finally` that removes a --uds socket)

    hconfig = HypercornConfig()
    address = endpoint(config, port)
    # hypercorn's socket owns the fd it serves (it closes it on shutdown): ours lets go of it, not to close it twice
    served_fd = int(listen_fd) if listen_fd else listener.detach()
    hconfig.bind = [f"fd://{served_fd}"]
    hconfig.accesslog = logging.getLogger("hypercorn.access")
    if listen_fd:  # one of several API processes: say which one served a request
        hconfig.access_log_format += " %(p)s"
    hconfig.errorlog = logging.getLogger("hypercorn.error")
    hconfig.startup_timeout = STARTUP_TIMEOUT_S  # hypercorn's 60 s would cancel a large model's load
    logger.info("voltserve %s (pid %d): serving %s on http://%s (%s event loop)", __version__, os.getpid(),
                config.model, address, loop_name)
    from api.app import EXIT_ON_START_FAILURE, SignalDrain
    from api.state import EXTENSION_KEY

    state = api.app.extensions[EXTENSION_KEY]
    api.app.config[EXIT_ON_START_FAILURE] = False  # a failed start is hypercorn's LifespanFailureError here

    async def run() -> None:
        drain = SignalDrain(state, config.shutdown_timeout)  # before the app (and the model) starts
        _check_signals()  # until SignalDrain's handlers took over
        if parent_fd:  # the supervisor is gone (EOF): shut down as on SIGTERM
            watch_parent(int(parent_fd), lambda: os.kill(os.getpid(), signal.SIGTERM))
        await hypercorn_serve(api.app, hconfig, shutdown_trigger=drain.trigger)

    try:
        event_loop.run(run(), config.event_loop)
    except LifespanFailureError as exc:  # the app's startup failed (the app logged why)
        if listener is not None:  # hypercorn takes the socket after the startup only: it never served it
            os.close(served_fd)
        if state.start_error is not None:  # a bad setting or model file: the app logged it in one line
            return 2
        if not start_reported_elsewhere():  # (one of several API processes: the first to fail said why)
            logger.error("exiting with status 1: the server did not start: %s", exc.args[0] if exc.args else exc)
        return 1
    except KeyboardInterrupt:  # a SIGINT after the drain (SignalDrain leaves it the default action) cut the stop
        logger.warning("interrupted while shutting down: exiting with status 130 (the engine process ends on its "
                       "own once this process is gone)")
        return 130
    engine = state.engine
    if engine is not None and getattr(engine, "_dead", None) is not None:
        logger.error("exiting with status 1: the engine died (%r)", engine._dead)
        return 1
    return 0


class _SignalBeforeStart(BaseException):
    """SIGINT or SIGTERM (`signum`) before the server's own handlers (SignalDrain, the API-process supervisor's)
    replace `console.note_signal`, raised where the start checks for one (`_check_signals`): a BaseException, so
    that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _check_signals() -> None:
    """Raise _SignalBeforeStart if a SIGINT or SIGTERM was noted (`console.note_signal`): the start's checks
    between its steps (the imports and checks before the server's handlers take a second or two, no step much
    longer)."""
    signum = console.take_signal()
    if signum:
        raise _SignalBeforeStart(signum)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `voltserve` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(getattr(args, "log_level", None))
    except ValueError as exc:  # a bad VOLTSERVE_LOG_LEVEL
        parser.error(str(exc))
    if args.command == "serve":
        # a `systemctl stop` or Ctrl-C in the first seconds (imports, the checks) is a clean stop, as one during the
        # load: without this, SIGTERM's default action killed the process (status 143, no log line), and SIGINT's
        # KeyboardInterrupt could be lost in a weakref callback (the start then served)
        previous = console.note_early_signals()  # (already set by the console entry)
        try:
            _check_signals()  # while the console entry imported this module
            return serve(args)
        except (KeyboardInterrupt, _SignalBeforeStart) as exc:  # before SignalDrain's handlers: no traceback
            if isinstance(exc, _SignalBeforeStart) and exc.signum == signal.SIGTERM:
                logger.warning("SIGTERM before the server started: exiting with status 0")
                return 0
            logger.warning("interrupted before the server started: exiting with status 130")
            return 130
        finally:
            for sig, handler in previous.items():
                if signal.getsignal(sig) is console.note_signal:  # (the server's loop leaves SIGINT its default)
                    signal.signal(sig, handler)
    parser.error(f"unknown command {args.command}")
    return 2

