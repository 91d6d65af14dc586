"""Engine and model configuration: validated dataclasses.

Precedence for every engine setting: CLI flag > environment variable `VOLTSERVE_<NAME>` > default.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field

from voltserve.errors import ConfigError
from voltserve.event_loop import check_kind as check_event_loop
from voltserve.spec.backoff import DEFAULT_MAX_PAUSE
from voltserve.spec.gate import DraftGate
from voltserve.spec.ladder import DraftLadder
from voltserve.spec.ngram import MAX_NGRAM

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GATE = "auto"  # speculative_gate: the draft gate on (tests/unit/test_draft_gate.py's simulation)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    Attributes:
        architecture: family name from the checkpoint ("llama").
        vocab_size: rows of the token embedding.
        hidden_size: model width.
        intermediate_size: MLP inner width.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA when < num_heads).
        head_dim: per-head width.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: rotary base.
        max_position_embeddings: the model's trained context length (tokens).
        tie_word_embeddings: lm_head shares the token embedding.
        rope_style: "neox" (rotate halves, HF layout) or "interleaved" (rotate pairs, GGUF layout).
        bos_token_id / eos_token_ids: special ids; eos_token_ids stop generation.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_style: str = "neox"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rope_style not in ("neox", "interleaved"):
            raise ConfigError(f"unknown rope_style {self.rope_style!r}")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env(name: str, default, cast=str):
    raw = os.environ.get(f"VOLTSERVE_{name.upper()}")
    if raw is None or raw == "":
        return default
    try:
        if cast is bool:  # a typo must not silently mean "off"
            value = raw.strip().lower()
            if value not in _TRUE + _FALSE:
                raise ValueError(value)
            return value in _TRUE
        return cast(raw)
    except ValueError as exc:
        raise ConfigError(f"VOLTSERVE_{name.upper()}={raw!r} is not a valid {cast.__name__}") from exc


def _check_text_file(name: str, path: str) -> None:
    """Raise ConfigError unless `path` is a file this user can read as UTF-8 (read at startup, before the load:
    the engine's read of a binary or unreadable file was a traceback and exit status 1 after it)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{name} {path!r} is not a file")
    try:
        with open(path, encoding="utf-8") as f:
            f.read()
    except OSError as exc:
        raise ConfigError(f"{name} {path!r} cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{name} {path!r} is not UTF-8 text (byte {exc.start}: {exc.reason})") from exc


# sun_path holds 108 bytes on Linux (104 on macOS and the BSDs), its terminating NUL included; a path is bound
# as given, relative or not
MAX_SOCKET_PATH_BYTES = 107 if sys.platform.startswith("linux") else 103


def socket_path_fits(path: str) -> bool:
    """Whether `path` (as given: relative paths are bound relative to the working directory) fits a Unix socket's
    address, MAX_SOCKET_PATH_BYTES bytes."""
    return len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES


def _check_socket_path(name: str, path: str, folder_rights: str) -> None:
    """Raise ConfigError unless `path` ("" = unset) fits a Unix socket's address and its folder exists."""
    if not socket_path_fits(path):
        raise ConfigError(f"{name} {path!r} is {len(os.fsencode(path))} bytes long: a Unix socket's path holds at "
                          f"most {MAX_SOCKET_PATH_BYTES} bytes (choose a shorter one)")
    folder = os.path.dirname(os.path.abspath(path)) if path else ""
    if folder and not os.path.isdir(folder):
        raise ConfigError(f"{name} {path!r}: the folder {folder!r} does not exist (create it, {folder_rights}, "
                          "e.g. systemd's RuntimeDirectory=)")


TOOL_CALL_PARSERS = ("auto", "hermes", "none")
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "none")
SPECULATIVE_METHODS = ("none", "ngram", "draft_model")
# EngineConfig fields that only the API process reads; API processes sharing one engine may differ in them
API_ONLY_FIELDS = frozenset({"served_model_name", "api_key", "sse_keep_alive_interval", "stream_interval", "host",
                             "port", "uds", "exit_on_engine_death", "engine_process", "engine_socket", "api_processes",
                             "shutdown_timeout", "tool_call_parser", "reasoning_parser",
                             "trust_request_mm_kwargs"})


@dataclass
class EngineConfig:
    """Everything the engine needs to start, beside the model weights.

    Attributes:
        model: model spec: the alias `smollm2-135m-instruct`, a `.gguf` path or a Hugging Face directory.
        served_model_name: the name clients send as `model` (defaults to `model`).
        device: "cpu" or "cuda" ("auto" picks cuda when a GPU is present).
        dtype: compute dtype on the CPU backend: "float32" (reference), "bfloat16" or "float16".
        max_model_len: context window in tokens (prompt + output); 0 = the model's own.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        admission_wait_steps: steps a new request may wait before it starts when starting it would make a step of
            running decodes a mixed one, so that requests arriving a few steps apart share one mixed step
            (`Scheduler(admission_wait_steps=)`); 0 = each starts in the first step with room.
        block_size: tokens per KV block.
        num_kv_blocks: KV pool size in blocks; 0 = size from `kv_cache_memory_gb`.
        kv_cache_memory_gb: memory for the KV pool when `num_kv_blocks` is 0 (GiB).
        enable_prefix_caching: reuse full KV blocks across requests by content hash.
        api_key: when set, every route but /health needs it.
        sse_keep_alive_interval: seconds of idle stream before a `: keep-alive` comment; 0 = off.
        stream_interval: tokens a request's outputs gather (all its sequences together) before its consumer
            takes them, after the first output, which goes at once; 1 = every token as it comes. A streamed
            request then writes about one SSE chunk per N tokens (a finish, the keep-alive or an error flushes
            what waits), which cuts the HTTP server's per-write work under many streams (as SGLang's
            --stream-interval). Applied where the request's `actors.stream.RequestStream` lives: the API process
            with the engine in its own process, else AsyncEngine's loop.
        host / port: where `voltserve serve` listens.
        uds: a Unix socket path `voltserve serve` listens on instead of host / port (e.g. behind nginx on the same
            host); "" = host / port. A socket file a server that is gone left there is replaced; the socket is
            removed at exit.
        num_threads: torch intra-op threads on the CPU backend; 0 = auto: where an engine serves HTTP (the
            engine process, an in-process server) torch's default (one per core) less one for the API process,
            at least 1 (`actors.build.cpu_threads`); elsewhere (offline tools, an `AsyncEngine` embedded in
            Python) torch's setting as it is.
        weight_format: "auto" (CPU: int4 kernels for Q4 GGUF weights, bf16 on oneDNN for the other quantized
            types, `voltserve.backends.cpu_bf16`, where available), "float" (the fp32 reference).
        gguf_convert: "auto": GGUF weights of types without kernels of their own (Q4_K -> Q4_1 near-lossless;
            Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K and the i-quants -> Q8_0 requantized) load as packed blocks of the
            type named, so they run on the quantized kernels (`loaders.gguf_convert`); "off": they load as their
            exact values in floats (fp16 on a GPU: 2-3x the bytes a decode step reads).
        tensor_parallel_size: ranks (GPUs on CUDA) one model is split over, Megatron-style
            (`voltserve.distributed`, `actors.tp`); 1 = no tensor parallelism. N > 1: ranks 1..N-1 run in
            spawned processes (rank r on GPU r), every step eagerly (no CUDA graphs, no asynchronous scheduling);
            the model's heads and KV heads must divide by N and CUDA needs N GPUs (both checked at build).
        gpu_memory_utilization: fraction of the GPU's memory the engine may use (weights, activations, KV pool).
        enforce_eager: run every step eagerly instead of replaying CUDA graphs.
        mixed_graphs: also capture CUDA graphs of mixed steps (new requests' prefills of up to 512 tokens next to
            the running sequences' decodes, `voltserve.graphs`); off = such steps run eagerly.
        pdl: programmatic dependent launch on SM90+ GPUs: each kernel launches while the previous one finishes
            and prefetches its weights meanwhile (ptx/common.cuh `pdl_enter`); no effect below SM90.
        gpu_busy_log_interval: seconds between log lines giving the share of wall time the GPU spent on steps
            (CUDA events around each step; CUDA only); 0 = off.
        exit_on_engine_death: the HTTP server shuts itself down (SIGTERM to its own process) once the engine is
            dead, so a supervisor such as systemd restarts it; `voltserve serve` turns it on.
        engine_process: the HTTP server runs the engine (scheduler, worker, detokenization) in a child process
            (`actors.engine_process.ProcessEngine`), so HTTP work does not slow the engine's steps; off = in the
            server's own process and event loop (`actors.engine.AsyncEngine`). Read by the API only.
        engine_socket: a Unix socket path that makes the engine process shared: the first API process to start
            with this setting starts the engine, which listens there, and every later one (the workers of
            `hypercorn -w N api:app`, or further `voltserve serve` processes) attaches to it instead of loading
            the model again. Each API process then does its own HTTP work on its own core. The engine exits
            once the last API process has gone. "" = each API process has its own engine.
        api_processes: `voltserve serve` runs this many API processes on its port, all on one shared engine
            (`voltserve.api_processes`; `engine_socket`, a private one unless set). `hypercorn api:app` ignores
            it: there, `-w N` with `engine_socket` does the same.
        event_loop: the event loop of `voltserve serve` and of the engine process (`voltserve.event_loop`):
            "auto" (uvloop when installed, else asyncio's), "uvloop" or "asyncio". `hypercorn api:app` runs the
            API process on the loop its `-k` option names.
        shutdown_timeout: seconds `voltserve serve` lets open requests finish after SIGINT / SIGTERM (new ones
            get 503, /health turns 503) before it ends the rest: streams with an in-band error event and
            `[DONE]`, others with a 503 (`api.state.ServerState.drain`). A bare `hypercorn api:app` instead
            waits its `--graceful-timeout` and then closes the connections.
        chat_template: path of a Jinja2 chat template file used instead of the model's own ("" = the model's).
        tool_call_parser: how tool calls are read from the output of a request that gives `tools`: "hermes"
            (`<tool_call>{...}</tool_call>`, `voltserve.parsers.hermes`), "none" (output is content), or "auto"
            (hermes when the chat template writes `<tool_call>`, else none).
        reasoning_parser: how reasoning (`<think>` ... `</think>`) is split from the content
            (`voltserve.parsers.reasoning`; the APIs' `reasoning_content`, reasoning items, thinking blocks):
            "qwen3" (the output may open `<think>`; it starts inside the reasoning when the prompt opened it),
            "deepseek_r1" (the output always starts inside the reasoning), "none", or "auto" (qwen3 when the
            chat template mentions `<think>`, else none). A request with `chat_template_kwargs.enable_thinking`
            false has none.
        trust_request_mm_kwargs: accept non-empty per-request `mm_processor_kwargs` / `media_io_kwargs` (a 400
            otherwise, case S7); the served models are text-only, so accepted kwargs have no effect.
        speculative_method: "none", "ngram" or "draft_model": speculative decoding with prompt-lookup drafts
            (`voltserve.spec.ngram`) or a draft model's greedy drafts (`speculative_model`,
            `voltserve.spec.draft_model`), verified by the model in one step (greedy output unchanged; sampled
            output by rejection sampling, the same distribution). Requests with a grammar, logprobs or penalties decode
            without drafts. No step is planned ahead while a running sequence may draft in it (draftable, drafting not
            paused).
        speculative_model: the draft model of "draft_model" (a spec as `model` takes: GGUF, Hugging Face
            directory or alias), smaller than the model and with its tokenizer; run on the model's device, with a
            KV pool of as many blocks as the model's (the two share the memory the pool is sized from); not with
            tensor parallelism.
        num_speculative_tokens: k, the most drafts a sequence verifies in one step.
        ngram_min / ngram_max: the shortest and longest suffix the n-gram drafter matches.
        concurrency_drafts: the ladder, a JSON object of running-sequence thresholds (>= 2) to verify widths
            (1..k), e.g. '{"4": 3, "5": 4}': with R running sequences the largest threshold <= R sets the width;
            below the lowest one all k drafts are verified (`voltserve.spec.ladder`). "" = always k.
        speculative_disable_by_batch_size: no drafts while at least this many sequences run (>= 2): their steps
            decode plainly and, on a GPU, are planned ahead again; 0 = draft at every concurrency.
        draft_max_pause: draft backoff (`voltserve.spec.backoff`): after m verifies in a row that accepted no
            draft a sequence decodes its next 2^m tokens without drafts, at most this many; 0 = never pauses.
        speculative_gate: "auto": the draft gate (`voltserve.spec.gate`) measures output tokens per second of
            decode steps with and without drafts, per concurrency bucket, in epochs (both modes measured back to
            back, then the winner), and turns drafting off where plain decoding is faster; "off": always draft.
    """

    model: str = DEFAULT_MODEL
    served_model_name: str = ""
    device: str = "auto"
    dtype: str = "float32"
    max_model_len: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    admission_wait_steps: int = 0
    block_size: int = 16
    num_kv_blocks: int = 0
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    api_key: str = field(default="", repr=False)  # never in logs
    sse_keep_alive_interval: float = 0.0
    stream_interval: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    uds: str = ""
    num_threads: int = 0
    weight_format: str = "auto"
    gguf_convert: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    mixed_graphs: bool = True
    pdl: bool = True
    gpu_busy_log_interval: float = 0.0
    exit_on_engine_death: bool = False
    engine_process: bool = True
    engine_socket: str = ""
    api_processes: int = 1
    event_loop: str = "auto"
    shutdown_timeout: float = 30.0
    chat_template: str = ""
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    trust_request_mm_kwargs: bool = False
    speculative_method: str = "none"
    speculative_model: str = ""
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    concurrency_drafts: str = ""
    speculative_disable_by_batch_size: int = 0
    draft_max_pause: int = DEFAULT_MAX_PAUSE
    speculative_gate: str = DEFAULT_GATE

    def validate(self) -> "EngineConfig":
        """Check ranges; raises ConfigError naming the setting. Returns self."""
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "stream_interval", "api_processes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, not {self.tensor_parallel_size}")
        if self.admission_wait_steps < 0:
            raise ConfigError("admission_wait_steps must be >= 0")
        if self.max_model_len < 0 or self.num_kv_blocks < 0:
            raise ConfigError("max_model_len and num_kv_blocks must be >= 0")
        gb = self.kv_cache_memory_gb  # 0 GiB holds no KV block; unused (0 too) where num_kv_blocks sizes the pool
        if not math.isfinite(gb) or gb < 0 or (gb == 0 and not self.num_kv_blocks):
            raise ConfigError(f"kv_cache_memory_gb must be > 0, not {gb:g}")
        if self.num_threads < 0:  # was taken as 0 (auto) silently
            raise ConfigError(f"num_threads must be >= 0 (0 = auto), not {self.num_threads}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, not {self.port}")
        for name in ("sse_keep_alive_interval", "gpu_busy_log_interval", "shutdown_timeout"):
            seconds = getattr(self, name)  # NaN passes a "< 0" test, and inf never ends a wait
            if not math.isfinite(seconds) or seconds < 0:
                raise ConfigError(f"{name} must be a number of seconds >= 0, not {seconds:g}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        check_event_loop(self.event_loop)
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"not {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                              f"not {self.reasoning_parser!r}")
        if self.chat_template:
            _check_text_file("chat_template", self.chat_template)
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"not {self.speculative_method!r}")
        if (self.speculative_method == "draft_model") != bool(self.speculative_model):
            raise ConfigError("speculative_model is needed with speculative_method draft_model, and only with it")
        if self.speculative_method == "draft_model" and self.tensor_parallel_size > 1:
            raise ConfigError("speculative_method draft_model runs without tensor parallelism "
                              "(tensor_parallel_size 1)")
        # checked with speculation off too: a bad setting fails at startup, not when speculation is turned on
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise ConfigError(f"ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}, "
                              f"not {self.ngram_min} and {self.ngram_max}")
        self.draft_ladder()  # raises on a bad num_speculative_tokens, concurrency_drafts or disable size
        if self.draft_max_pause < 0:
            raise ConfigError(f"draft_max_pause must be >= 0, not {self.draft_max_pause}")
        self.draft_gate()  # raises on an unknown speculative_gate
        if self.weight_format not in ("auto", "float"):
            raise ConfigError(f"weight_format must be auto or float, not {self.weight_format!r}")
        if self.gguf_convert not in ("auto", "off"):
            raise ConfigError(f"gguf_convert must be auto or off, not {self.gguf_convert!r}")
        if (self.engine_socket or self.api_processes > 1) and not self.engine_process:
            raise ConfigError("engine_socket and api_processes > 1 need engine_process (the shared engine is a "
                              "process of its own)")
        _check_socket_path("engine_socket", self.engine_socket, "writable by the serving user only")
        _check_socket_path("uds", self.uds, "writable by the serving user")
        if self.uds and (self.host, self.port) != (EngineConfig.host, EngineConfig.port):
            raise ConfigError(f"uds {self.uds!r} and host / port {self.host}:{self.port} both say where to listen: "
                              "give one of them")
        if self.uds and self.engine_socket and os.path.realpath(self.uds) == os.path.realpath(self.engine_socket):
            # else the API process would attach to its own HTTP socket, bound before the load, and wait for an hour
            raise ConfigError(f"uds and engine_socket are both {self.uds!r}: the HTTP server's socket and the "
                              "engine's need two paths")
        if not self.served_model_name:
            self.served_model_name = self.model
        return self

    def draft_ladder(self) -> DraftLadder:
        """The verify width per concurrency from `num_speculative_tokens`, `concurrency_drafts` and
        `speculative_disable_by_batch_size`.

        Raises:
            ConfigError: one is out of range (`DraftLadder.parse`).
        """
        return DraftLadder.parse(self.concurrency_drafts, self.num_speculative_tokens,
                                 self.speculative_disable_by_batch_size)

    def draft_gate(self) -> DraftGate:
        """A new draft gate of `speculative_gate`'s mode (one per scheduler: it holds the measurements).

        Raises:
            ConfigError: an unknown mode.
        """
        return DraftGate(self.speculative_gate)

    def engine_settings(self) -> dict:
        """The fields the engine process acts on (not the API's own: names, keys, ports, streaming): API
        processes that share one engine (`engine_socket`) must agree on these."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in API_ONLY_FIELDS}

    @classmethod
    def from_env(cls, **overrides) -> "EngineConfig":
        """Build from `VOLTSERVE_<NAME>` environment variables; `overrides` (CLI flags) win.

        Raises:
            ConfigError: a variable does not parse as its field's type.
        """
        values = {}
        for f in dataclasses.fields(cls):
            cast = {int: int, float: float, bool: bool}.get(type(f.default), str)
            values[f.name] = _env(f.name, f.default, cast)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values).validate()


# prometheus-client's multiprocess folder variables, in its order of precedence
PROMETHEUS_DIR_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def prometheus_multiproc_dir(environ=os.environ) -> str:
    """The folder of prometheus-client's multiprocess mode (`GET /metrics` over several API processes), read as
    prometheus-client reads it: PROMETHEUS_MULTIPROC_DIR if present, else prometheus_multiproc_dir; "" when
    neither is set (each process counts its own requests).

    Raises:
        ConfigError: the variable is set but empty or not a folder (prometheus-client would write its files into
            the working directory, or fail on the first request).
    """
    for name in PROMETHEUS_DIR_VARIABLES:
        if name in environ:
            path = environ[name]
            if not path or not os.path.isdir(path):
                raise ConfigError(f"{name}={path!r} is not a folder (create it, empty, before the server starts)")
            return path
    return ""
