"""AsyncEngine: the engine facade for asyncio code (the HTTP API, or your own program).

Composition root: loads the model (loaders), builds the backend, model, KV pool and scheduler (voltserve), and
starts the scheduler and worker actors.

Example:
    engine = AsyncEngine(EngineConfig(model="smollm2-135m-instruct").validate())
    await engine.start()
    async for out in engine.generate(engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=8)):
        print(out.text, end="")
    await engine.stop()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Callable

import torch

from actors.scheduler import AbortRequestMsg, AddRequestMsg, SchedulerActor
from actors.request_ids import RequestIds
from actors.stream import RequestStream, generate_outputs
from actors.worker import WorkerActor
from voltserve.config import EngineConfig
from voltserve.errors import EngineDeadError, InvalidRequestError, RequestAbortedError
from voltserve.grammar import GrammarState
from voltserve.kv_cache import BlockPool
from voltserve.request import RequestOutput, SamplingParams, check_request
from voltserve.scheduler import Scheduler
from voltserve.sequence import Sequence

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Continuous-batching engine driven by asyncio actors.

    Args:
        config: validated engine settings.
        loaded: an already loaded model (loaders.LoadedModel); None loads `config.model` in start().
        on_death: called once with the error when an actor dies (after every open stream has failed).
        spare_cores: on the CPU backend with `config.num_threads` 0, cores torch's threads leave free
            (`actors.build.cpu_threads`): 1 where the engine serves HTTP (the engine process, an in-process
            server), else 0 (torch's default).
    """

    def __init__(self, config: EngineConfig, loaded=None,
                 on_death: Callable[[BaseException], None] | None = None, spare_cores: int = 0):
        self.config = config.validate()
        self._spare_cores = spare_cores
        self._loaded = loaded
        self._on_death = on_death
        self._seq_ids = itertools.count()
        self._compiling: dict[str, asyncio.Task] = {}  # request id -> its grammar's compile (off the loop)
        # the ids in flight: one request per id (the scheduler actor keys streams and aborts by id)
        self._request_ids = RequestIds()
        self._scheduler_actor: SchedulerActor | None = None
        self._worker: WorkerActor | None = None
        self._tp_ranks = None  # actors.tp.TPRanks: the rank processes 1..N-1 with tensor_parallel_size N > 1
        self._dead: BaseException | None = None
        self._stopped = False
        self.model_config = None
        self.tokenizer = None
        self.chat_template = None
        self.max_model_len = 0
        self.pool: BlockPool | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (in a thread), build the runner and start the actors. Cancelled during the load, it
        returns at once and the load's thread is let go of (`actors.build_thread`)."""
        from actors.build import speculation  # composition: loaders + backends
        from actors.build_thread import build_off_loop

        built = await build_off_loop(self.config, self._loaded, self._spare_cores)
        self._tp_ranks = built.tp_ranks
        self._loaded = None  # the runner holds what it needs; free the fp32 copies
        self.model_config = built.model_config
        self.tokenizer = built.tokenizer
        self.chat_template = built.chat_template
        self.max_model_len = built.max_model_len
        if hasattr(self.tokenizer, "byte_table"):  # the detokenizer's table: built here, not on the first request
            await asyncio.to_thread(self.tokenizer.byte_table, True)
        self.pool = BlockPool(built.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        scheduler = Scheduler(self.pool, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                              self.max_model_len, built.eos_token_ids, *built.runner.ahead_admission(),
                              admission_wait_steps=self.config.admission_wait_steps,
                              **speculation(self.config, built.drafter))
        self._worker = WorkerActor(built.runner, thread_init=built.thread_init, on_crash=self._on_crash)
        self._scheduler_actor = SchedulerActor(scheduler, self._worker, self.tokenizer, on_crash=self._on_crash,
                                               request_ids=self._request_ids)
        self._worker.start()
        self._scheduler_actor.start()
        if self._tp_ranks is not None:  # case E1: a rank process that exits kills the engine, even between steps
            loop = asyncio.get_running_loop()
            self._tp_ranks.watch(lambda rank, code: loop.call_soon_threadsafe(
                self._on_crash, RuntimeError(f"tensor-parallel rank {rank} exited with code {code}")))
        logger.info("engine ready: model %s, device %s, max_model_len %d, KV pool %d blocks x %d tokens",
                    self.config.model, built.device, self.max_model_len, built.num_blocks, self.config.block_size)

    async def stop(self) -> None:
        """Abort open requests and stop the actors; the model and its KV cache are let go (on a GPU their memory
        goes back to the driver, where the next engine's pool is sized from)."""
        self._stopped = True
        if self._scheduler_actor is not None:
            await self._scheduler_actor.stop()
            self._scheduler_actor.fail_all(EngineDeadError("engine stopped"))
        if self._worker is not None:
            await self._worker.stop()
        if self._tp_ranks is not None:  # after the worker: no step may be in flight when the ranks go
            await asyncio.to_thread(self._tp_ranks.stop)
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    @property
    def is_healthy(self) -> bool:
        return (self._dead is None and not self._stopped and self._scheduler_actor is not None
                and self._scheduler_actor.alive and self._worker.alive)

    def _on_crash(self, exc: BaseException) -> None:
        if self._dead is not None:
            return
        self._dead = exc
        logger.error("engine is dead: %r", exc)
        if self._scheduler_actor is not None:
            self._scheduler_actor.fail_all(EngineDeadError(f"engine died: {exc!r}"))
        if self._on_death is not None:
            self._on_death(exc)

    # -- requests -----------------------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> RequestStream:
        """Queue a request; validation errors are raised here, before anything is queued.

        Args:
            prompt_token_ids: the prompt, already tokenized.
            params: sampling parameters (validated here); max_tokens None = the rest of the context.
            request_id: caller-chosen id; a random one by default.
        Returns:
            A RequestStream of RequestOutput deltas.
        Raises:
            InvalidRequestError: empty prompt, out-of-vocabulary ids, bad parameters, or a request_id of a request
                still in flight.
            ContextLengthError: prompt plus max_tokens longer than max_model_len.
            EngineDeadError: the engine is not running.
        """
        self._check_running()
        max_tokens = check_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
        stream = RequestStream(request_id or uuid.uuid4().hex, params.n, self.abort, self.config.stream_interval)
        self.submit(prompt_token_ids, params, max_tokens, stream)
        return stream

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int, stream) -> None:
        """Queue a request that `check_request` has accepted; its outputs go to `stream`. Every request enters the
        engine here (add_request's, and an API process's in the engine process), so this is where an id still in
        flight is refused (`actors.request_ids`): the scheduler actor keys requests by id.

        Args:
            prompt_token_ids: the prompt.
            params: validated sampling parameters.
            max_tokens: the output budget `check_request` returned.
            stream: a RequestStream, or anything with its producer side (`request_id`, `put(out, wake)`,
                `wake()`, `fail(exc)`), e.g. the engine process's forwarder to the API process.
        Raises:
            InvalidRequestError: (param request_id) a request under `stream.request_id` is still in flight; nothing
                was queued and `stream` gets nothing.
            EngineDeadError: the engine is not running.
        """
        self._check_running()
        self._request_ids.claim(stream.request_id, stream)
        if params.grammar is None:
            self._queue(prompt_token_ids, params, max_tokens, stream, [None] * params.n)
            return
        # a grammar compiles in 1 ms to ~1 s (hundreds of tools): in a thread, so the running streams go on
        request_id = stream.request_id

        async def compile_then_queue() -> None:
            try:
                states = await asyncio.to_thread(GrammarState.for_sequences, self.tokenizer, params.grammar,
                                                 params.n)
            except InvalidRequestError as exc:  # the API checked it (`grammar.check`); an embedder's may fail
                self._end_unqueued(stream, exc)
                return
            except asyncio.CancelledError:  # aborted before it was queued: end the stream, so that a forwarding
                self._end_unqueued(stream, RequestAbortedError(f"request {request_id!r} aborted"))  # one frees
                raise  # its id there
            finally:
                if self._compiling.get(request_id) is task:  # not a later request's that reused the id
                    del self._compiling[request_id]
            if self.is_healthy:
                self._queue(prompt_token_ids, params, max_tokens, stream, states)
            else:  # the engine died or stopped meanwhile: nobody else ends this stream
                self._end_unqueued(stream, EngineDeadError("engine is not running"))

        task = self._compiling[request_id] = asyncio.get_running_loop().create_task(compile_then_queue())

    def _end_unqueued(self, stream, error: BaseException) -> None:
        """End a request that never reached the scheduler actor: free its id, fail its stream."""
        self._request_ids.release(stream.request_id, stream)
        stream.fail(error)

    def _queue(self, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int, stream,
               grammars: list) -> None:
        request_id = stream.request_id
        seqs = []
        prompt_hashes = [] if params.n > 1 else None  # the n choices hash their prompt's blocks once
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                philox_seed = (params.seed + i) & 0xFFFF_FFFF_FFFF_FFFF
                gen = torch.Generator().manual_seed(philox_seed)
            else:
                philox_seed = secrets.randbits(64)  # the device sampler's key for an unseeded request
            seqs.append(Sequence(seq_id=next(self._seq_ids), request_id=request_id, index=i,
                                 prompt_ids=list(prompt_token_ids), params=params, max_tokens=max_tokens,
                                 generator=gen, philox_seed=philox_seed, prompt_hashes=prompt_hashes,
                                 grammar=grammars[i]))
        self._scheduler_actor.tell(AddRequestMsg(tuple(seqs), stream))

    def _check_running(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError(f"engine is not running{': ' + repr(self._dead) if self._dead else ''}")

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """add_request() and iterate its outputs; closing or cancelling the iterator aborts the request."""
        return generate_outputs(self, prompt_token_ids, params, request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its KV blocks return to the pool within one step. Unknown ids are ignored. The id is
        free again at once (the abort reaches the scheduler actor before any later request's add)."""
        self._request_ids.drop(request_id)
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:  # not queued yet: it never will be
            compiling.cancel()
            return
        actor = self._scheduler_actor
        if actor is not None and actor.alive:
            actor.tell(AbortRequestMsg(request_id))

    def kv_stats(self) -> dict:
        """Pool and queue sizes: num_blocks, num_free_blocks, num_cached_blocks, num_running, num_waiting; and the
        speculative decoding counters since start: num_verify_steps (sequence-steps that verified drafts),
        num_draft_tokens, num_accepted_tokens, num_gate_draft_steps and num_gate_plain_steps (steps the draft
        gate let draft / held drafts back in)."""
        sched = self._scheduler_actor.scheduler if self._scheduler_actor else None
        return {
            "num_blocks": self.pool.num_blocks if self.pool else 0,
            "num_free_blocks": self.pool.num_free if self.pool else 0,
            "num_cached_blocks": self.pool.num_cached if self.pool else 0,
            "num_running": len(sched.running) if sched else 0,
            "num_waiting": len(sched.waiting) if sched else 0,
            "num_verify_steps": sched.num_verify_steps if sched else 0,
            "num_draft_tokens": sched.num_draft_tokens if sched else 0,
            "num_accepted_tokens": sched.num_accepted_tokens if sched else 0,
            "num_gate_draft_steps": sched.num_gate_draft_steps if sched else 0,
            "num_gate_plain_steps": sched.num_gate_plain_steps if sched else 0,
        }
