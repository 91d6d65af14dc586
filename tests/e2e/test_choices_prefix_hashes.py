"""A request with n > 1 through a real AsyncEngine (the tiny random model, CPU): its choices hash the prompt's KV
blocks for the prefix cache once between them (`Sequence.prompt_hashes`; they hashed them once each), and their
outputs are those of an engine that hashes nothing (prefix caching off)."""

from __future__ import annotations

import contextlib

import pytest

from actors.engine import AsyncEngine
from voltserve import kv_cache
from voltserve.config import EngineConfig
from voltserve.request import SamplingParams

PROMPT_BLOCKS = 6  # 100-token prompts in blocks of 16; 8 outputs leave the 7th block unfilled


@contextlib.asynccontextmanager
async def _engine(tiny_dir, prefix_caching: bool = True):
    engine = AsyncEngine(EngineConfig(model=str(tiny_dir), device="cpu", max_model_len=512, num_kv_blocks=128,
                                      enable_prefix_caching=prefix_caching))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def _choices(engine, prompt: list[int], **params) -> dict[int, list[int]]:
    """Each choice's output token ids."""
    out: dict[int, list[int]] = {}
    async for delta in engine.generate(prompt, SamplingParams(max_tokens=8, **params)):
        out.setdefault(delta.index, []).extend(delta.token_ids)
    return out


@pytest.fixture
def hash_calls(monkeypatch) -> list[int]:
    """[the number of kv_cache.hash_block calls so far]."""
    count, real = [0], kv_cache.hash_block

    def counted(parent, token_ids):
        count[0] += 1
        return real(parent, token_ids)

    monkeypatch.setattr(kv_cache, "hash_block", counted)
    return count


async def test_n4_hashes_the_prompt_as_often_as_n1(tiny_dir, hash_calls):
    async with _engine(tiny_dir) as engine:
        one = await _choices(engine, [10 + i % 50 for i in range(100)], temperature=0)
        n1_calls, hash_calls[0] = hash_calls[0], 0
        four = await _choices(engine, [100 + i % 50 for i in range(100)], temperature=0, n=4)
    assert (n1_calls, hash_calls[0]) == (PROMPT_BLOCKS, PROMPT_BLOCKS)  # n = 4 was 4 * 6
    assert sorted(one) == [0] and sorted(four) == [0, 1, 2, 3]
    assert len({tuple(tokens) for tokens in four.values()}) == 1  # greedy: the four choices agree


async def test_n4_outputs_are_those_of_an_engine_without_prefix_caching(tiny_dir, hash_calls):
    prompt = [200 + i % 40 for i in range(100)]
    outputs = []
    for caching in (True, False):
        async with _engine(tiny_dir, prefix_caching=caching) as engine:
            outputs.append(await _choices(engine, prompt, temperature=1.0, seed=7, n=4))
    assert outputs[0] == outputs[1] and len({tuple(tokens) for tokens in outputs[0].values()}) == 4
    assert all(len(tokens) == 8 for tokens in outputs[0].values())
