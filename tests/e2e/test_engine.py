"""The AsyncEngine on the real default model: batching, prefix cache, preemption, reproducibility, aborts."""

import asyncio

import pytest

from tests.e2e.engine_helpers import assert_engine_dead, chat_ids, complete, running_engine
from voltserve.errors import EngineDeadError, InvalidRequestError, StepFailedError
from voltserve.request import FinishReason, SamplingParams

QUESTIONS = [f"Give me one fact about the number {i}." for i in range(8)]


async def test_capital_of_france_mentions_paris(smollm2):
    async with running_engine(smollm2) as engine:
        text, _, last = await complete(engine, chat_ids(engine, "What is the capital of France?"),
                                       temperature=0, max_tokens=32)
    assert "Paris" in text and last.finish_reason is FinishReason.STOP


async def test_8_concurrent_streams_match_sequential(smollm2):
    async with running_engine(smollm2, enable_prefix_caching=False) as engine:
        prompts = [chat_ids(engine, q) for q in QUESTIONS]
        sequential = [(await complete(engine, p, temperature=0, max_tokens=24))[1] for p in prompts]
        concurrent = await asyncio.gather(*(complete(engine, p, temperature=0, max_tokens=24) for p in prompts))
        assert [c[1] for c in concurrent] == sequential
        assert engine.kv_stats()["num_free_blocks"] == engine.kv_stats()["num_blocks"]


async def test_K1_prefix_cache_reports_cached_tokens(smollm2):
    """Case K1: a second request with the same long prefix reuses its KV blocks (usage.cached_tokens)."""
    prefix = "You are a helpful assistant. " * 12
    async with running_engine(smollm2) as engine:
        first = chat_ids(engine, prefix + "Name a color.")
        second = chat_ids(engine, prefix + "Name a fruit.")
        _, tokens_a, last_a = await complete(engine, first, temperature=0, max_tokens=8)
        _, tokens_b, last_b = await complete(engine, second, temperature=0, max_tokens=8)
        assert last_a.num_cached_tokens == 0
        shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
        assert last_b.num_cached_tokens == shared // 16 * 16 and last_b.num_cached_tokens >= 96
        # the cache changes no result
        _, again, last_c = await complete(engine, second, temperature=0, max_tokens=8)
    async with running_engine(smollm2, enable_prefix_caching=False) as engine:
        _, uncached, _ = await complete(engine, second, temperature=0, max_tokens=8)
    assert tokens_b == again == uncached and last_c.num_cached_tokens >= last_b.num_cached_tokens


async def _steps_to_first_token(engine, prompt_ids) -> tuple[int, int]:
    """(engine steps until the first output, its cached tokens) of one greedy request, run to the end."""
    start, first = engine._scheduler_actor.num_steps, None
    async for out in engine.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=2)):
        if first is None:
            first = (engine._scheduler_actor.num_steps - start, out.num_cached_tokens)
    return first


async def test_K1_cached_prefix_cuts_time_to_first_token(smollm2):
    """Case K1's second half: the request that finds its long prefix cached reaches its first token much sooner.
    Counted in steps of at most 16 prompt tokens (wall time is noise on a shared CPU): the cold prefill runs
    ~9 chunks, the cached one only its uncached tail."""
    prefix = "You are a helpful assistant who answers in one word. " * 12  # ~130 tokens
    async with running_engine(smollm2, max_num_batched_tokens=16) as engine:
        cold = await _steps_to_first_token(engine, chat_ids(engine, prefix + "Name a color."))
        warm = await _steps_to_first_token(engine, chat_ids(engine, prefix + "Name a fruit."))
    assert cold[1] < 32 and warm[1] >= 112, (cold, warm)  # cold: the template's system prompt, one block
    assert cold[0] >= 9 and warm[0] <= 2, (cold, warm)


async def test_K2_small_pool_preempts_and_matches(smollm2):
    """Case K2: requests that do not fit the KV pool at once finish through preemption, same greedy text."""
    async with running_engine(smollm2, enable_prefix_caching=False) as engine:
        prompts = [chat_ids(engine, q) for q in QUESTIONS[:6]]
        expected = [(await complete(engine, p, temperature=0, max_tokens=40, ignore_eos=True))[1] for p in prompts]
    # each sequence needs ~5 blocks of 16 at its longest; 6 of them need ~30; give 14
    async with running_engine(smollm2, num_kv_blocks=14, max_model_len=160, enable_prefix_caching=False) as engine:
        got = await asyncio.gather(*(complete(engine, p, temperature=0, max_tokens=40, ignore_eos=True)
                                     for p in prompts))
        assert engine._scheduler_actor.scheduler.num_preemptions > 0
        stats = engine.kv_stats()
    assert [g[1] for g in got] == expected
    assert stats["num_free_blocks"] == stats["num_blocks"] == 14


async def _cached_figures(engine, prompt_ids) -> set[int]:
    return {out.num_cached_tokens async for out in engine.generate(
        prompt_ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))}


async def test_cached_tokens_one_figure_a_request_through_preemption(smollm2):
    """Usage's cached tokens are read from different deltas (a streamed Anthropic message's first, a streamed
    Responses one's last, the max when not streamed): with the prefix cache on and requests preempted and
    prefilled again, every delta of a request carries one figure, so the readers agree."""
    prefix = "You are a helpful assistant. " * 4
    async with running_engine(smollm2, num_kv_blocks=14, max_model_len=160) as engine:
        await complete(engine, chat_ids(engine, prefix + "Hi."), temperature=0, max_tokens=1)  # cache the prefix
        prompts = [chat_ids(engine, prefix + q) for q in QUESTIONS[:6]]
        figures = await asyncio.gather(*(_cached_figures(engine, p) for p in prompts))
        assert engine._scheduler_actor.scheduler.num_preemptions > 0
    assert all(len(f) == 1 for f in figures) and any(f != {0} for f in figures), figures


async def test_R1_reproducible_greedy_and_seeded(smollm2):
    async with running_engine(smollm2) as engine:
        ids = chat_ids(engine, "Write a haiku about rain.")
        g1 = await complete(engine, ids, temperature=0, max_tokens=20)
        g2 = await complete(engine, ids, temperature=0, max_tokens=20)
        s1 = await complete(engine, ids, temperature=1.0, top_p=0.95, seed=1234, max_tokens=20)
        s2 = await complete(engine, ids, temperature=1.0, top_p=0.95, seed=1234, max_tokens=20)
        s3 = await complete(engine, ids, temperature=1.0, top_p=0.95, seed=4321, max_tokens=20)
    assert g1[1] == g2[1] and s1[1] == s2[1] and s1[1] != s3[1]


async def test_n2_sequences_are_indexed_and_independent(smollm2):
    async with running_engine(smollm2) as engine:
        ids = chat_ids(engine, "Tell me a story.")
        by_index = {0: [], 1: []}
        finished = {}
        async for out in engine.generate(ids, SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=12)):
            by_index[out.index] += out.token_ids
            if out.finish_reason:
                finished[out.index] = out.finish_reason
        assert set(finished) == {0, 1}
        assert len(by_index[0]) == 12 and len(by_index[1]) == 12 and by_index[0] != by_index[1]


async def test_abort_returns_blocks_within_a_step(smollm2):
    async with running_engine(smollm2) as engine:
        stream = engine.add_request(chat_ids(engine, "Count to one thousand."),
                                    SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        first = await stream.__anext__()
        assert first.token_ids and engine.kv_stats()["num_free_blocks"] < engine.kv_stats()["num_blocks"]
        stream.abort()
        outs = [o async for o in stream]
        assert outs[-1].finish_reason is FinishReason.ABORT
        stats = engine.kv_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == 0
        engine._scheduler_actor.scheduler.pool.check_invariants()


async def _tokens(stream) -> list[int]:
    return [t async for out in stream for t in out.token_ids]


async def test_request_id_in_flight_is_refused(smollm2):
    """A caller-chosen request id still in flight is refused in add_request: the scheduler keys streams and aborts
    by id, so a second request under it took the first one's outputs and left the first stream waiting forever.
    Once the first finished or was aborted, the id is free again."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    async with running_engine(smollm2) as engine:
        prompt = chat_ids(engine, "Tell me a story.")
        first = engine.add_request(prompt, params, request_id="dup")
        with pytest.raises(InvalidRequestError, match="request id 'dup' is already in flight") as refused:
            engine.add_request(prompt, params, request_id="dup")
        assert refused.value.param == "request_id"
        tokens = await asyncio.wait_for(_tokens(first), 60)
        again = await asyncio.wait_for(_tokens(engine.add_request(prompt, params, request_id="dup")), 60)
        engine.add_request(prompt, params, request_id="dup").abort()
        after_abort = await asyncio.wait_for(_tokens(engine.add_request(prompt, params, request_id="dup")), 60)
        stats = engine.kv_stats()
    assert len(tokens) == 6 and again == after_abort == tokens
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == 0


async def test_stop_string_ends_sequence(smollm2):
    async with running_engine(smollm2) as engine:
        ids = chat_ids(engine, "What is the capital of France?")
        text, tokens, last = await complete(engine, ids, temperature=0, max_tokens=32, stop=["of Fr"])
    assert text == "The capital "
    assert last.finish_reason is FinishReason.STOP and last.stop_reason == "of Fr"


async def test_failing_step_fails_its_request_and_engine_goes_on(smollm2):
    async with running_engine(smollm2) as engine:
        runner = engine._worker.runner
        real_execute = runner.execute
        calls = []

        def fail_once(plan):
            calls.append(plan)
            if len(calls) == 1:
                raise RuntimeError("simulated kernel failure")
            return real_execute(plan)

        runner.execute = fail_once
        with pytest.raises(StepFailedError):
            await complete(engine, chat_ids(engine, "Hi"), max_tokens=4)
        assert engine.is_healthy
        stats = engine.kv_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == 0
        _, tokens, _ = await complete(engine, chat_ids(engine, "Hi"), temperature=0, max_tokens=4, ignore_eos=True)
        assert len(tokens) == 4


async def test_persistent_step_failures_kill_the_engine(smollm2):
    async with running_engine(smollm2) as engine:
        def boom(plan):
            raise RuntimeError("simulated broken device")

        engine._worker.runner.execute = boom
        errors = []
        for _ in range(3):
            try:
                await complete(engine, chat_ids(engine, "Hi"), max_tokens=4)
            except (StepFailedError, EngineDeadError) as exc:
                errors.append(type(exc))
        assert errors == [StepFailedError, StepFailedError, EngineDeadError]
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))


async def test_dead_worker_fails_requests_and_health(smollm2):
    """The worker actor dies mid-step: the pending request gets EngineDeadError, health turns false, no hang."""
    async with running_engine(smollm2) as engine:
        started = asyncio.Event()
        real_execute = engine._worker.runner.execute

        def slow(plan):
            engine._loop.call_soon_threadsafe(started.set)
            import time

            time.sleep(0.5)
            return real_execute(plan)

        engine._loop = asyncio.get_running_loop()
        engine._worker.runner.execute = slow
        stream = engine.add_request(chat_ids(engine, "Hi"), SamplingParams(max_tokens=4))
        await started.wait()
        engine._worker._task.cancel()
        await assert_engine_dead(engine, stream)


async def test_extreme_sampling_values_do_not_break_the_engine(smollm2):
    """Valid but extreme parameters (tiny temperature or repetition penalty) sample, never crash the engine."""
    async with running_engine(smollm2) as engine:
        ids = chat_ids(engine, "Hi")
        for params in (dict(temperature=1e-40), dict(temperature=1.0, repetition_penalty=0.01),
                       dict(temperature=100.0, min_tokens=2), dict(temperature=0.5, top_p=1e-9)):
            _, tokens, _ = await complete(engine, ids, max_tokens=3, ignore_eos=True, **params)
            assert len(tokens) == 3
        with pytest.raises(InvalidRequestError):
            engine.add_request(ids, SamplingParams(max_tokens=3, stop_token_ids=[10**9], min_tokens=2))
        assert engine.is_healthy


async def test_stop_string_on_the_last_allowed_token_reports_stop(smollm2):
    async with running_engine(smollm2) as engine:
        ids = chat_ids(engine, "What is the capital of France?")
        text, tokens, last = await complete(engine, ids, temperature=0, max_tokens=6, stop=["Paris"])
    assert len(tokens) == 6 and text == "The capital of France is "
    assert last.finish_reason is FinishReason.STOP and last.stop_reason == "Paris"


async def test_stream_interval_delivers_the_same_tokens_in_groups(smollm2):
    """stream_interval 4: the first delta comes at once, every later one but the last holds >= 4 tokens (the
    consumer is woken once 4 wait), and the tokens and text are those of the default stream (every token)."""
    prompt = "What is the capital of France?"
    async with running_engine(smollm2) as engine:
        text, tokens, _ = await complete(engine, chat_ids(engine, prompt), temperature=0, max_tokens=18,
                                         ignore_eos=True)
    async with running_engine(smollm2, stream_interval=4) as engine:
        deltas = [out async for out in engine.generate(chat_ids(engine, prompt),
                                                       SamplingParams(temperature=0, max_tokens=18, ignore_eos=True))]
    assert len(tokens) == 18 and 3 <= len(deltas) <= 6
    assert all(len(d.token_ids) >= 4 for d in deltas[1:-1]) and deltas[-1].finish_reason is FinishReason.LENGTH
    assert [t for d in deltas for t in d.token_ids] == tokens and "".join(d.text for d in deltas) == text


@pytest.mark.parametrize("spec", [{}, {"speculative_method": "draft_model",
                                       "speculative_model": "smollm2-135m-instruct"}])
async def test_a_stopped_engine_lets_go_of_its_model_and_kv_cache(smollm2, spec):
    """After stop the KV cache is released while the engine object is still held, and once the engine is dropped
    (without the cyclic garbage collector) a draft model's cache too: on a GPU the next engine in the process
    sizes its pool from the free memory (an actor's on_crash, a bound method of the engine, had kept both alive)."""
    import gc
    import weakref

    gc.disable()
    try:
        async with running_engine(smollm2, **spec) as engine:
            await complete(engine, chat_ids(engine, "Name a color."), temperature=0, max_tokens=4)
            kv = weakref.ref(engine._worker.runner.kv_cache)
            drafter = engine._scheduler_actor.scheduler.drafter
            draft_kv = weakref.ref(drafter.runner.kv_cache) if spec else None
            del drafter
        assert kv() is None
        del engine
        assert draft_kv is None or draft_kv() is None
    finally:
        gc.enable()
