"""Messages between the API process (`actors.engine_process.ProcessEngine`) and the engine process
(`actors.engine_core`), pickled over one multiprocessing Connection (a Unix socket pair).

Parent -> child: its sys.path and `EngineStartMsg` once, then a list of commands per event-loop turn (`AddMsg`,
`AbortMsg`, `StatsQueryMsg`, `StopMsg`). An API process that attaches to a shared engine
(`EngineConfig.engine_socket`) connects to its socket and sends `[AttachMsg]` instead of the start messages; it
never sends `StopMsg`.
Child -> parent (each API process): `ReadyMsg` or `StartFailedMsg` once, then one `StepOutputsMsg` per engine step
(several steps coalesce into one message when the parent lags), a `StatsMsg` per `StatsQueryMsg`, and
`EngineDiedMsg` if the engine dies.
RequestOutputs travel as plain tuples in `RequestOutput`'s field order: per token this is the only IPC cost, and
a tuple pickles several times faster than a dataclass.
"""

from __future__ import annotations

import asyncio
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from voltserve.config import EngineConfig, ModelConfig
from voltserve.request import RequestOutput, SamplingParams

# (request_id, index, token_ids, text, logprobs, finish_reason, stop_reason, num_prompt_tokens,
#  num_cached_tokens, num_output_tokens): RequestOutput(*t) rebuilds it
OutputTuple = tuple


def watch_readable(loop: asyncio.AbstractEventLoop, conn: Connection, callback: Callable[[], None]) -> None:
    """`loop.add_reader(conn, callback)`, keeping the socket blocking: both processes read and write whole
    messages with blocking `recv`/`send` (the sender thread too). uvloop's add_reader switches the descriptor to
    non-blocking (libuv's `uv_poll_init`; asyncio's loop leaves it alone), and a message larger than the socket
    buffer, such as `ReadyMsg` with a real tokenizer, then fails half-way with BlockingIOError."""
    fd = conn.fileno()
    blocking = os.get_blocking(fd)
    loop.add_reader(fd, callback)
    os.set_blocking(fd, blocking)


def output_to_tuple(out: RequestOutput) -> OutputTuple:
    """The RequestOutput as a tuple of its fields, in declaration order."""
    return (out.request_id, out.index, out.token_ids, out.text, out.logprobs, out.finish_reason, out.stop_reason,
            out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens)


def portable_error(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip with its type, else a RuntimeError carrying its repr."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc):
            return exc
    except Exception:
        pass
    return RuntimeError(f"{type(exc).__qualname__}: {exc}")


# ---- parent -> child ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineStartMsg:
    """The second message (the first is the parent's sys.path, so that this one unpickles in the child)."""

    config: EngineConfig
    # the API process's root log level (the child starts with no logging set up)
    log_level: int
    # (config, on_death=callback) -> engine with AsyncEngine's interface; None = AsyncEngine
    engine_factory: Any = None
    # where further API processes attach (`AttachMsg`); ListenSocket() = the engine serves its parent only
    listen: "ListenSocket" = field(default_factory=lambda: ListenSocket())


@dataclass(frozen=True)
class ListenSocket:
    """A shared engine's listening socket (`actors.engine_socket`), bound by the API process that starts the
    engine and inherited by it."""

    path: str = ""  # "" = none
    fd: int = -1  # the listening socket's descriptor in the engine process
    inode: int = 0  # of the socket file: the engine removes the file at its exit only if it is still that one
    lock_fd: int = -1  # the engine lock, held open for the engine process's life


@dataclass(frozen=True)
class AttachMsg:
    """The first command of an API process that attaches to a running shared engine (instead of the two start
    messages); the engine answers ReadyMsg, or StartFailedMsg when `config.engine_settings()` differ."""

    config: EngineConfig


@dataclass(frozen=True)
class AddMsg:
    """A request the parent has validated (`check_request`)."""

    request_id: str
    # [num_prompt_tokens] token ids
    prompt_token_ids: list[int]
    params: SamplingParams
    # output budget returned by check_request
    max_tokens: int


@dataclass(frozen=True)
class AbortMsg:
    request_id: str


@dataclass(frozen=True)
class StatsQueryMsg:
    """Ask for the engine's kv_stats() as they are now (a /metrics scrape): answered with a StatsMsg, after the
    outputs collected so far. Step outputs carry them too, but none come during a long prefill, nor to an API
    process whose requests have ended while another's run."""


@dataclass(frozen=True)
class StopMsg:
    """Abort everything, stop the engine, exit the process."""


# ---- child -> parent ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadyMsg:
    """The engine runs; what the API needs to tokenize, render templates and validate requests."""

    model_config: ModelConfig
    tokenizer: Any  # voltserve.tokenizer.Tokenizer (or a test double), pickled
    chat_template: Any  # voltserve.chat_template.ChatTemplate, pickled as its source
    max_model_len: int
    kv_stats: dict


@dataclass(frozen=True)
class StartFailedMsg:
    """AsyncEngine.start() raised; the parent's start() re-raises `error`."""

    error: BaseException


@dataclass(frozen=True)
class StepOutputsMsg:
    """Everything one engine step (or several, coalesced) produced."""

    # OutputTuples in emission order
    outputs: list[OutputTuple]
    # (request_id, error): requests that ended with an error (StepFailedError) instead of a final output
    failures: list[tuple[str, BaseException]] = field(default_factory=list)
    # AsyncEngine.kv_stats() when the message was built
    kv_stats: dict | None = None


@dataclass(frozen=True)
class StatsMsg:
    """The answer to a StatsQueryMsg: AsyncEngine.kv_stats() when the engine read the question."""

    kv_stats: dict


@dataclass(frozen=True)
class EngineDiedMsg:
    """An actor of the engine died; the process exits after this message."""

    error: BaseException
