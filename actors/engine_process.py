"""ProcessEngine: the AsyncEngine interface, with the engine in its own process (what the HTTP server uses).

Why: in one process, the HTTP stack (hypercorn, h11, Quart: a fixed cost per SSE write) and the engine loop
(scheduling, detokenization, step preparation) share one event loop and one GIL, so the engine steps at the speed
of the HTTP loop. Here the API process keeps HTTP, tokenization of prompts and request validation; the engine
process (`actors.engine_core`, a new interpreter) runs the scheduler actor, the worker and detokenization, and sends one
message per step with every RequestOutput of that step. Streams merge consecutive deltas while a consumer lags
(`RequestStream.put`), so under load the HTTP writes per token fall while tokens/s follows the engine.

Example:
    engine = ProcessEngine(EngineConfig(model="smollm2-135m-instruct").validate())
    await engine.start()
    async for out in engine.generate(engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=8)):
        print(out.text, end="")
    await engine.stop()
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection

from actors import engine_socket
from actors.engine_core import ENTRY
from actors.engine_ipc import (AbortMsg, AddMsg, AttachMsg, EngineDiedMsg, EngineStartMsg, ListenSocket, ReadyMsg,
                               StartFailedMsg, StatsMsg, StatsQueryMsg, StepOutputsMsg, StopMsg, watch_readable)
from actors.request_ids import duplicate_request_id
from actors.stream import RequestStream, generate_outputs
from voltserve import errors
from voltserve.config import EngineConfig
from voltserve.errors import INPUT_ERRORS, EngineDeadError
from voltserve.request import RequestOutput, SamplingParams, check_request

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # a clean stop finishes the step in hand; then the process is terminated
# a shared engine answers an attach within a loop turn, or once its model has loaded (attached during the load,
# its starter gone): as long as `voltserve serve` lets a start take (voltserve.cli.STARTUP_TIMEOUT_S)
ATTACH_TIMEOUT_S = 3600.0
ATTACH_TRIES = 3  # an attach that meets the engine's exit (its last API process just left) starts over
ENGINE_EXIT_WAIT_S = 60.0  # a new shared engine waits this long for the previous one's exit (its stop)
# messages read per readable event: the loop gets back to HTTP even if the engine outpaces the reader
MAX_MESSAGES_PER_READ = 8
# refresh_kv_stats waits this long for the engine's answer (its loop answers within a turn, a step in flight or
# not), then goes on with the last figures it has: a scrape is never held up by an engine that hangs
STATS_TIMEOUT_S = 1.0
_EMPTY_KV_STATS = {"num_blocks": 0, "num_free_blocks": 0, "num_cached_blocks": 0, "num_running": 0,
                   "num_waiting": 0, "num_verify_steps": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                   "num_gate_draft_steps": 0, "num_gate_plain_steps": 0}


class AttachTimeoutError(EngineDeadError):
    """A shared engine did not answer an attach in ATTACH_TIMEOUT_S (hung: not retried)."""


# a failure note's error type (its name) -> the class a waiting API process raises it as
_INPUT_ERROR_TYPES = {cls.__name__: cls for cls in vars(errors).values()
                      if isinstance(cls, type) and issubclass(cls, INPUT_ERRORS)}


def _raise_if_failed_meanwhile(path: str, before: str | None) -> None:
    """Raise the start error of the shared engine at `path` if its failure note is not `before` (the one there
    when this API process began to wait): it failed while this one waited (`actors.engine_socket`).

    Raises:
        ConfigError / LoaderError (the error's own type): a bad setting or model file (`INPUT_ERRORS`), which
            `voltserve serve` then reports in one line and exit status 2 in this API process too.
        EngineDeadError: any other error; both name it.
    """
    note = engine_socket.read_failure(path)
    if note is not None and note != before:
        error = engine_socket.failure_error(note)
        kind = _INPUT_ERROR_TYPES.get(error.partition(":")[0], EngineDeadError)
        raise kind(f"the shared engine at {path} failed to start while this API process waited for it: {error}")


class ProcessEngine:
    """Engine client in the API process; the engine runs in a child process, a new interpreter (CUDA cannot be
    forked) talking pickled messages over a Unix socket pair.

    Args:
        config: validated engine settings (the child builds its AsyncEngine from them).
        engine_factory: builds the engine in the child instead of AsyncEngine (benchmarks with a fake engine):
            `(config, on_death=callback) -> engine`; it is pickled, so a module-level function or a
            functools.partial of one.

    Attributes (set by start()): model_config, tokenizer, chat_template, max_model_len, as AsyncEngine's;
    process: the engine process (subprocess.Popen) when this API process started it; None when it attached to
    a shared engine (`EngineConfig.engine_socket`) that another one started.
    """

    def __init__(self, config: EngineConfig, engine_factory: Callable | None = None):
        self.config = config.validate()
        self._engine_factory = engine_factory
        self.model_config = None
        self.tokenizer = None
        self.chat_template = None
        self.max_model_len = 0
        self.process: subprocess.Popen | None = None
        self._conn = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._streams: dict[str, RequestStream] = {}
        self._commands: list = []  # parent -> child: aborts wait for the end of the loop turn, adds go at once
        self._kv_stats = dict(_EMPTY_KV_STATS)
        self._stats_answer: asyncio.Future | None = None  # the pending StatsQueryMsg's answer (refresh_kv_stats)
        self._started = False  # the child answered ReadyMsg
        self._dead: BaseException | None = None
        self._stopped = False
        self._reaper: asyncio.Future | None = None  # waits for a child that is slow to exit after its EOF

    # -- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine process and wait until its model is loaded; with `config.engine_socket`, attach to
        the shared engine listening there instead, or start it (listening there) when none does.

        Raises:
            The child's start error with its type and message (LoaderError, ConfigError, ...), or
            EngineDeadError when the process exits before it is ready, or (a shared engine) when its start by
            another API process failed while this one waited for it (`actors.engine_socket`, PATH.failed; with
            the error's own type where it is a bad setting or model file, `voltserve.errors.INPUT_ERRORS`).
        """
        self._loop = asyncio.get_running_loop()
        path = self.config.engine_socket
        if not path:
            await self._spawn()
        else:
            # one API process at a time: the first starts the engine (the others wait here while the model
            # loads), the later ones find it listening, or fail with the error its start failed with meanwhile
            before = engine_socket.read_failure(path)  # an older failure is not this start's
            lock = await engine_socket.acquire_lock(path + engine_socket.START_LOCK_SUFFIX)
            try:
                _raise_if_failed_meanwhile(path, before)
                for attempt in range(1, ATTACH_TRIES + 1):
                    sock = engine_socket.connect(path)
                    if sock is None:
                        await self._spawn(listen_path=path)
                        break
                    try:
                        await self._attach(sock)
                        break
                    except AttachTimeoutError:
                        raise
                    except EngineDeadError:  # it exited as we attached: its last API process had just left,
                        _raise_if_failed_meanwhile(path, before)  # or its start (its starter gone) failed
                        if attempt == ATTACH_TRIES:
                            raise
                        logger.warning("the shared engine at %s exited as this process attached; again", path)
            finally:
                lock.close()  # releases the lock
        self._started = True

    async def _spawn(self, listen_path: str = "") -> None:
        """Start the engine process and wait for ReadyMsg. With `listen_path` (the caller holds the start lock
        and found nobody listening there): first wait for a previous engine there to have exited, then bind the
        socket for the others and hand it to the engine process with the engine lock (`actors.engine_socket`).

        Raises:
            EngineDeadError: a previous engine has not exited in ENGINE_EXIT_WAIT_S.
        """
        handed: list = []  # our copies of what the engine process inherits
        listen = ListenSocket()
        try:
            if listen_path:
                try:
                    engine_lock = await engine_socket.acquire_lock(listen_path + engine_socket.ENGINE_LOCK_SUFFIX,
                                                                   ENGINE_EXIT_WAIT_S)
                except TimeoutError as exc:
                    raise EngineDeadError(f"the previous engine at {listen_path} has not exited") from exc
                handed.append(engine_lock)
                listener, inode = engine_socket.bind_listener(listen_path)
                handed.append(listener)
                listen = ListenSocket(listen_path, listener.fileno(), inode, engine_lock.fileno())
            ours, theirs = socket.socketpair()
            with theirs:
                # a new session: a terminal's Ctrl-C goes to the API process only, which then stops the engine
                self.process = await asyncio.to_thread(
                    subprocess.Popen, [sys.executable, "-c", ENTRY, str(theirs.fileno())],
                    pass_fds=[theirs.fileno(), *(f.fileno() for f in handed)], start_new_session=True)
        finally:
            for f in handed:  # the engine process holds them now (or nobody does)
                f.close()
        # the child holds the only other end now: its exit is EOF here
        self._conn = Connection(ours.detach())
        self._conn.send(sys.path)
        self._conn.send(EngineStartMsg(self.config, logging.getLogger().getEffectiveLevel(), self._engine_factory,
                                       listen))
        try:
            await self._wait_ready()
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # e.g. the server stopped during the load: not waited for
                logger.info("stopping engine process %d before its start finished", self.process.pid)
                self.process.terminate()  # it exits at once, its rank processes too (`EngineCore._on_sigterm`)
            await self._reap(5.0)  # a child that reported its error exits at once
            raise
        logger.info("engine process %d ready: max_model_len %d, KV pool %d blocks", self.process.pid,
                    self.max_model_len, self._kv_stats["num_blocks"])

    async def _attach(self, sock: socket.socket) -> None:
        """Use the shared engine at the other end of `sock` (its process is not ours: `process` stays None).

        Raises:
            ConfigError: the engine runs other engine settings (its StartFailedMsg).
            EngineDeadError: the engine closed the connection, or did not answer in ATTACH_TIMEOUT_S.
        """
        sock.setblocking(True)
        self._conn = Connection(sock.detach())
        try:
            try:
                self._conn.send([AttachMsg(self.config)])
            except OSError as exc:  # it is exiting
                raise EngineDeadError(f"the shared engine at {self.config.engine_socket} exited") from exc
            try:
                await asyncio.wait_for(self._wait_ready(), ATTACH_TIMEOUT_S)
            except TimeoutError as exc:
                raise AttachTimeoutError(f"the shared engine at {self.config.engine_socket} did not answer in "
                                         f"{ATTACH_TIMEOUT_S:g} s") from exc
        except BaseException:
            self._close_conn()
            raise
        logger.info("attached to the shared engine at %s: max_model_len %d, KV pool %d blocks",
                    self.config.engine_socket, self.max_model_len, self._kv_stats["num_blocks"])

    async def _wait_ready(self) -> None:
        self._ready = self._loop.create_future()
        self._dead = None  # (an earlier attempt's)
        watch_readable(self._loop, self._conn, self._on_readable)
        ready: ReadyMsg = await self._ready
        if self._conn is None or self._dead is not None:  # its exit or death was read right after its ReadyMsg
            raise EngineDeadError("the engine process exited right after it was ready")
        self.model_config, self.tokenizer = ready.model_config, ready.tokenizer
        self.chat_template, self.max_model_len = ready.chat_template, ready.max_model_len
        self._kv_stats = ready.kv_stats

    async def stop(self) -> None:
        """Abort open requests; stop the engine process and reap it (terminated after STOP_TIMEOUT_S). A shared
        engine (`config.engine_socket`) is not stopped: this API process closes its socket, which aborts its
        requests there, and the engine exits with the last API process (a thread reaps it if it is ours)."""
        self._stopped = True
        if self._conn is None and self.process is None:
            return
        if self.config.engine_socket:
            self._close_conn()
            if self.process is not None:  # ours: wait for its exit on a thread that does not hold up ours
                threading.Thread(target=self.process.wait, name="engine-reaper", daemon=True).start()
        else:
            if self._conn is not None and self._dead is None:
                self._commands.append(StopMsg())
                self._flush_commands()
            await self._reap(STOP_TIMEOUT_S)  # the loop keeps reading meanwhile: the final abort deltas arrive
        self._fail_all(EngineDeadError("engine stopped"))

    @property
    def is_healthy(self) -> bool:
        return self._started and self._dead is None and not self._stopped

    async def _reap(self, timeout_s: float) -> None:
        """Wait for the child to exit (terminate, then kill, if it does not in time) and close the socket."""
        proc = self.process
        for end in (None, proc.terminate, proc.kill):
            if end is not None:
                logger.warning("engine process %d did not exit; %s", proc.pid, end.__name__)
                end()
            try:
                await asyncio.to_thread(proc.wait, timeout_s if end is None else 5.0)
                break
            except subprocess.TimeoutExpired:
                continue
        self._close_conn()

    def _close_conn(self) -> None:
        if self._stats_answer is not None and not self._stats_answer.done():  # no answer will come
            self._stats_answer.set_result(None)
        if self._conn is not None:
            self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None

    # -- child -> parent ----------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            for _ in range(MAX_MESSAGES_PER_READ):
                if self._conn is None or not self._conn.poll():
                    break
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            self._on_child_exit()

    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepOutputsMsg):
            self._deliver(msg)
        elif isinstance(msg, StatsMsg):
            self._kv_stats = msg.kv_stats
            if self._stats_answer is not None and not self._stats_answer.done():
                self._stats_answer.set_result(None)
        elif isinstance(msg, (ReadyMsg, StartFailedMsg)):
            if not self._ready.done():  # done: start() was cancelled meanwhile
                if isinstance(msg, ReadyMsg):
                    self._ready.set_result(msg)
                else:
                    self._ready.set_exception(msg.error)
        elif isinstance(msg, EngineDiedMsg):
            if not self._started and self._ready is not None and not self._ready.done():
                self._ready.set_exception(EngineDeadError(f"the engine died: {msg.error!r}"))  # the start's error
            else:  # (read with its ReadyMsg, the start fails on `_dead` in `_wait_ready`)
                self._die(msg.error)
        else:
            raise TypeError(f"engine process sent an unknown message {msg!r}")

    def _deliver(self, msg: StepOutputsMsg) -> None:
        """Put a step's outputs into their streams, then wake each consumer once."""
        streams = self._streams
        touched = []
        for fields in msg.outputs:
            stream = streams.get(fields[0])
            if stream is None:  # failed or stopped here already
                continue
            stream.put(RequestOutput(*fields), wake=False)
            touched.append(stream)
            if fields[5] is not None and stream.all_seqs_finished:
                del streams[fields[0]]
        for request_id, error in msg.failures:
            stream = streams.pop(request_id, None)
            if stream is not None:
                stream.fail(error)
        if msg.kv_stats is not None:
            self._kv_stats = msg.kv_stats
        for stream in touched:
            stream.wake()

    def _on_child_exit(self) -> None:
        """EOF on the socket: the engine process exited (stopped, died, killed)."""
        self._close_conn()
        if self.process is None:  # an attached API process: the engine is another's child
            error = EngineDeadError(f"the shared engine at {self.config.engine_socket} exited")
        else:
            try:
                self.process.wait(0.5)  # it has closed its end, so it is exiting: reap it (no zombie)
            except subprocess.TimeoutExpired:
                self._reaper = self._loop.run_in_executor(None, self.process.wait)
            error = EngineDeadError(f"the engine process exited (exit code {self.process.returncode})")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        if self._started and not self._stopped:  # during start(), its error is the report (it may retry)
            self._die(error)

    def _die(self, error: BaseException) -> None:
        if self._dead is None:
            self._dead = error
            logger.error("engine is dead: %r", error)
            self._fail_all(EngineDeadError(f"engine died: {error!r}"))

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(exc)

    # -- parent -> child ----------------------------------------------------------------------------------

    def _send(self, cmd) -> None:
        """Queue a command for the end of this loop turn (aborts: a client storm leaving sends one message)."""
        self._commands.append(cmd)
        if len(self._commands) == 1:
            self._loop.call_soon(self._flush_commands)

    def _flush_commands(self) -> None:
        commands, self._commands = self._commands, []
        if not commands or self._conn is None:
            return
        try:
            self._conn.send(commands)
        except OSError:  # the child is gone; EOF handling reports it
            self._on_child_exit()

    # -- requests (AsyncEngine's interface) ---------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> RequestStream:
        """AsyncEngine.add_request: validate (errors raise here, before anything is sent to the engine process),
        register the RequestStream, send the request now (after any commands still queued, so their order
        holds). Raises InvalidRequestError, ContextLengthError, EngineDeadError as AsyncEngine's does.
        """
        if not self.is_healthy:
            raise EngineDeadError(f"engine is not running{': ' + repr(self._dead) if self._dead else ''}")
        max_tokens = check_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:  # until its last delta comes back: that delta would end a new stream
            raise duplicate_request_id(request_id)
        stream = RequestStream(request_id, params.n, self.abort, self.config.stream_interval)
        self._streams[request_id] = stream
        # Not at the end of the loop turn as aborts are: under streaming load that callback waits behind a turn
        # of SSE writes (7.6 ms at the median on the 2-core bench), all of it added to the request's TTFT.
        self._commands.append(AddMsg(request_id, list(prompt_token_ids), params, max_tokens))
        self._flush_commands()
        return stream

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """add_request() and iterate its outputs; closing or cancelling the iterator aborts the request."""
        return generate_outputs(self, prompt_token_ids, params, request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its KV blocks return to the pool within one step. Unknown ids are ignored."""
        if self.is_healthy:
            self._send(AbortMsg(request_id))

    def kv_stats(self) -> dict:
        """AsyncEngine.kv_stats() as of the engine's last message to this process: sent with each step's outputs
        for this process's requests (none come during a long prefill, nor while only other API processes' requests
        run) and answering `refresh_kv_stats`, which brings it up to date."""
        return dict(self._kv_stats)

    async def refresh_kv_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> dict:
        """Ask the engine process for its kv_stats() now and wait for the answer (a round trip: its event loop
        answers, which a running step does not hold), e.g. before a /metrics scrape. Callers meanwhile share the
        question. Returns kv_stats(): as of the answer, or the last known after `timeout_s` without one, or when
        the engine does not run."""
        if self.is_healthy and self._conn is not None:
            if self._stats_answer is None or self._stats_answer.done():
                self._stats_answer = self._loop.create_future()
                self._send(StatsQueryMsg())
            try:  # shielded: a caller that gives up leaves the answer to the others
                await asyncio.wait_for(asyncio.shield(self._stats_answer), timeout_s)
            except TimeoutError:
                logger.warning("the engine process did not report its stats in %g s; using older ones", timeout_s)
        return self.kv_stats()
