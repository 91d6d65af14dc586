"""The engine at tensor_parallel_size 2 on the CPU (gloo; rank 1 a spawned process): the same greedy tokens as
TP = 1 for concurrent requests with chunked prefill, a killed rank kills the engine (case E1), and stop leaves no
rank process behind."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import pathlib
import signal

import pytest

from actors.engine import AsyncEngine
from actors.engine_process import ProcessEngine
from tests.e2e.engine_helpers import assert_engine_dead, complete
from tools.make_synthetic_checkpoint import save_hf_dir, synthetic_model
from voltserve.config import EngineConfig
from voltserve.errors import ConfigError, EngineDeadError
from voltserve.request import SamplingParams

# prompts of 40, 23 and 7 tokens under a budget of 16 tokens a step: chunked prefills beside decodes
PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(40)], [(11 * i + 5) % 250 + 1 for i in range(23)],
           [65, 66, 67, 68, 69, 70, 71]]
MAX_TOKENS = 12
# TP 1's greedy tokens for PROMPTS on tiny_tp (seed 3); checked against a TP 1 engine in the first test
TP1_TOKENS = [[8, 7, 34, 97, 95, 95, 95, 95, 95, 95, 95, 95], [295, 67, 57, 67, 57, 67, 57, 67, 57, 67, 57, 67],
              [92, 304, 112, 291, 291, 291, 291, 291, 291, 291, 153, 29]]


@pytest.fixture(scope="module")
def tiny_tp_dir(tmp_path_factory):
    """An HF directory of the "tiny_tp" random-weight Llama: 8 heads, 4 KV heads (2 per rank at TP 2)."""
    out = tmp_path_factory.mktemp("tiny_tp")
    save_hf_dir(synthetic_model("tiny_tp", seed=3), out)
    return out


def engine_config(model_dir, tp: int) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp,
                        num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=False)


async def greedy_tokens(engine) -> list[list[int]]:
    """The three prompts at once, greedy, MAX_TOKENS each (EOS ignored)."""
    done = await asyncio.gather(*(complete(engine, p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
                                  for p in PROMPTS))
    return [tokens for _, tokens, _ in done]


async def test_tp2_matches_tp1_and_stops_its_rank(tiny_tp_dir):
    reference = AsyncEngine(engine_config(tiny_tp_dir, 1))
    await reference.start()
    try:
        want = await greedy_tokens(reference)
        assert reference.kv_stats()["num_free_blocks"] == 64
    finally:
        await reference.stop()
    engine = AsyncEngine(engine_config(tiny_tp_dir, 2))
    await engine.start()
    ranks = engine._tp_ranks
    try:
        # rank 0's pool holds its 2 of the 4 KV heads: [layers, 2, blocks, block_size, kv_heads, head_dim]
        assert tuple(engine._worker.runner.kv_cache.shape) == (2, 2, 64, 16, 2, 16)
        assert engine._scheduler_actor.scheduler.ahead_prefill_tokens == 0  # nothing planned ahead under TP
        got = await greedy_tokens(engine)
        assert engine.kv_stats()["num_free_blocks"] == 64 and engine.is_healthy
    finally:
        await asyncio.wait_for(engine.stop(), 30)
    assert want == TP1_TOKENS
    assert got == want
    assert [p.exitcode for p in ranks.procs] == [0]  # stopped, not killed


async def test_killed_rank_kills_the_engine(tiny_tp_dir):
    """Case E1: rank 1's process is killed mid-stream: the open request ends in EngineDeadError naming the exit
    code, the engine is unhealthy and refuses new requests, and stop returns; nothing hangs."""
    engine = AsyncEngine(engine_config(tiny_tp_dir, 2))
    await engine.start()
    proc = engine._tp_ranks.procs[0]
    try:
        stream = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        first = await asyncio.wait_for(stream.__anext__(), 30)
        assert len(first.token_ids) == 1
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.wait_for(assert_engine_dead(engine, stream), 15)
        with pytest.raises(EngineDeadError, match="tensor-parallel rank 1 exited with code -9"):
            engine._check_running()
    finally:
        await asyncio.wait_for(engine.stop(), 30)
    assert proc.exitcode == -signal.SIGKILL and not proc.is_alive()


async def test_heads_that_do_not_divide_fail_start_and_stop_the_ranks(tiny_tp_dir):
    """TP 3 on 8 heads: start raises the ConfigError (rank 0 meets it building its shard) and the two rank
    processes spawned before the model was read are gone."""
    engine = AsyncEngine(engine_config(tiny_tp_dir, 3))
    with pytest.raises(ConfigError, match=r"num_attention_heads \(8\) must divide by tensor_parallel_size \(3\)"):
        await asyncio.wait_for(engine.start(), 60)
    assert [p.name for p in multiprocessing.active_children() if p.name.startswith("voltserve-tp-rank")] == []


async def test_rank_killed_between_steps_kills_the_engine(tiny_tp_dir):
    """No step runs to notice it: the rank watcher marks the engine dead (/health 503) within moments."""
    engine = AsyncEngine(engine_config(tiny_tp_dir, 2))
    await engine.start()
    try:
        await complete(engine, PROMPTS[2], temperature=0, max_tokens=2)
        os.kill(engine._tp_ranks.procs[0].pid, signal.SIGKILL)
        for _ in range(100):
            if not engine.is_healthy:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(EngineDeadError, match="tensor-parallel rank 1 exited with code -9"):
            engine.add_request(PROMPTS[2], SamplingParams(max_tokens=2))
    finally:
        await asyncio.wait_for(engine.stop(), 30)


def rank_pids(parent_pid: int) -> list[int]:
    """The TP rank processes among parent_pid's children (multiprocessing "spawn" children; not its resource
    tracker), read from /proc."""
    kids = []
    for task in pathlib.Path(f"/proc/{parent_pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [k for k in kids if b"spawn_main" in pathlib.Path(f"/proc/{k}/cmdline").read_bytes()]


async def test_engine_process_runs_tp2_and_dies_with_its_rank(tiny_tp_dir):
    """The server's default path: the engine in its own process spawns its rank; the same tokens as in process,
    and a killed rank ends the open stream and the engine process (exit status 1)."""
    engine = ProcessEngine(dataclasses.replace(engine_config(tiny_tp_dir, 2), engine_process=True))
    await engine.start()
    try:
        _, tokens, _ = await complete(engine, PROMPTS[2], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert tokens == TP1_TOKENS[2]
        [rank] = rank_pids(engine.process.pid)
        stream = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        os.kill(rank, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="tensor-parallel rank 1 exited with code -9"):
            async for _ in stream:
                pass
        for _ in range(100):
            if not engine.is_healthy:
                break
            await asyncio.sleep(0.05)
        assert not engine.is_healthy
    finally:
        await asyncio.wait_for(engine.stop(), 30)
    assert engine.process.poll() == 1


async def test_sigint_to_a_rank_leaves_the_engine_serving(tiny_tp_dir):
    """Ctrl-C signals the whole foreground process group, the spawned ranks too (an embedded AsyncEngine, or
    `--no-engine-process`): the rank ignores it, so the engine keeps its open request and its owner's drain;
    it used to die of KeyboardInterrupt (the stream ended in 'rank 1 exited with code 1')."""
    engine = AsyncEngine(engine_config(tiny_tp_dir, 2))
    await engine.start()
    proc = engine._tp_ranks.procs[0]
    try:
        stream = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        tokens = list((await asyncio.wait_for(stream.__anext__(), 30)).token_ids)
        os.kill(proc.pid, signal.SIGINT)
        await asyncio.sleep(0.5)  # a rank that dies of it is seen by the watcher within moments
        async for out in stream:
            tokens += out.token_ids
        assert tokens == TP1_TOKENS[2]
        assert engine.is_healthy and proc.is_alive()
    finally:
        await asyncio.wait_for(engine.stop(), 30)
    assert proc.exitcode == 0  # stopped over its pipe, not interrupted
