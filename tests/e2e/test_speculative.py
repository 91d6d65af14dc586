"""Speculative decoding with the n-gram drafter on the default model (case D1: lossless; case L1's ladder): the
greedy output equals the plain engine's, sequential and concurrent, with drafts actually accepted."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.e2e.engine_helpers import chat_ids, complete, running_engine
from tests.helpers import OracleDrafter
from voltserve.spec.gate import DEFAULT_WINDOW

# prompts whose answers copy their input or repeat: the drafts pass often
PROMPTS = ["List the numbers from 1 to 30 separated by commas.",
           "Repeat this sentence exactly three times: The quick brown fox jumps over the lazy dog.",
           "What is the capital of France?"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# the draft gate off: these tests count verify steps, which a gate that measured plain decoding faster stops
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4, "speculative_gate": "off"}


async def answers(engine, concurrent: bool, **params) -> list[list[int]]:
    prompts = [chat_ids(engine, p) for p in PROMPTS]
    if concurrent:
        outs = await asyncio.gather(*[complete(engine, p, **params) for p in prompts])
    else:
        outs = [await complete(engine, p, **params) for p in prompts]
    return [tokens for _, tokens, _ in outs]


@pytest.mark.parametrize("device", DEVICES)
async def test_D1_greedy_output_equals_plain_decoding(smollm2, device):
    params = {"temperature": 0, "max_tokens": 80}
    async with running_engine(smollm2, device=device) as engine:
        plain = await answers(engine, False, **params)
    async with running_engine(smollm2, device=device, **SPEC) as engine:
        alone = await answers(engine, False, **params)
        together = await answers(engine, True, **params)
        sched = engine._scheduler_actor.scheduler
        assert engine.pool.num_free == engine.pool.num_blocks  # no KV block outlives its request
    assert alone == plain and together == plain
    # drafts were verified and some passed: 1 + accepted / verifies tokens a verify step
    assert sched.num_verify_steps > 20 and sched.num_accepted_tokens > sched.num_verify_steps // 4
    # the draft gate on (the default): whichever mode it picks a step, the output is the same; it explored both
    async with running_engine(smollm2, device=device, **{**SPEC, "speculative_gate": "auto"}) as engine:
        gated = await answers(engine, False, **params), await answers(engine, True, **params)
        stats = engine.kv_stats()
    assert gated == (plain, plain)
    assert min(stats["num_gate_draft_steps"], stats["num_gate_plain_steps"]) >= DEFAULT_WINDOW


@pytest.mark.parametrize("device", DEVICES)
async def test_ladder_and_stop_strings(smollm2, device):
    """Width 1 from 2 running sequences on; a stop string inside an accepted run of drafts still ends the text
    where the plain engine ends it."""
    params = {"temperature": 0, "max_tokens": 80, "stop": ["15"]}
    async with running_engine(smollm2, device=device) as engine:
        plain = await complete(engine, chat_ids(engine, PROMPTS[0]), **params)
    async with running_engine(smollm2, device=device, concurrency_drafts='{"2": 1}', **SPEC) as engine:
        spec = await complete(engine, chat_ids(engine, PROMPTS[0]), **params)
        together = await answers(engine, True, temperature=0, max_tokens=40)
    async with running_engine(smollm2, device=device) as engine:
        plain_together = await answers(engine, True, temperature=0, max_tokens=40)
    assert spec[0] == plain[0] and spec[0].endswith("14, ") and spec[2].stop_reason == "15"
    # the tokens after the stop string's are dropped, as the plain engine never makes them
    assert spec[1] == plain[1] and spec[2].num_output_tokens == plain[2].num_output_tokens
    assert together == plain_together


@pytest.mark.parametrize("device", DEVICES)
async def test_sampling(smollm2, device):
    """Seeded sampling is not drafted (a verify's random draws depend on what runs beside it; case R1): the plain
    engine's tokens, alone and beside the others. On the CPU concurrent equals sequential (batch-invariant
    numerics); on a GPU the logits of a step of three sequences may differ in their last bits from those of one
    (the GEMVs and GEMMs pick kernels and tilings by row count: a near-tie flipped once, session 34), so there the
    concurrent run is compared with the plain engine's concurrent run. Unseeded sampling verifies drafts by
    rejection sampling."""
    seeded = {"temperature": 0.8, "top_p": 0.95, "seed": 11, "max_tokens": 60}
    async with running_engine(smollm2, device=device) as engine:
        plain = await answers(engine, False, **seeded)
        plain_together = await answers(engine, True, **seeded)
    async with running_engine(smollm2, device=device, concurrency_drafts='{"2": 2}', **SPEC) as engine:
        alone = await answers(engine, False, **seeded)
        together = await answers(engine, True, **seeded)
        sched = engine._scheduler_actor.scheduler
        assert sched.num_verify_steps == 0
        free = await answers(engine, True, temperature=0.8, max_tokens=60)
        assert sched.num_verify_steps > 0 and engine.pool.num_free == engine.pool.num_blocks
    assert alone == plain and together == plain_together and all(len(t) > 5 for t in free)
    if device == "cpu":
        assert together == plain


@pytest.mark.parametrize("device", DEVICES)
async def test_draft_model_is_lossless(smollm2, device):
    """The "draft_model" method with the model as its own draft: greedy output equals plain decoding, alone and
    concurrent, and on the CPU (whose numerics do not depend on the step's shape) every draft passes, greedy and
    sampled; no block of either KV pool outlives its request."""
    params = {"temperature": 0, "max_tokens": 60}
    async with running_engine(smollm2, device=device) as engine:
        plain = await answers(engine, False, **params)
    spec = {"speculative_method": "draft_model", "speculative_model": "smollm2-135m-instruct",
            "num_speculative_tokens": 3, "speculative_gate": "off"}
    async with running_engine(smollm2, device=device, **spec) as engine:
        alone = await answers(engine, False, **params)
        together = await answers(engine, True, **params)
        sched = engine._scheduler_actor.scheduler
        greedy = sched.num_draft_tokens, sched.num_accepted_tokens
        # sampled requests draft from the draft model's q: here q = p, so drafts pass (all of them on the CPU)
        sampled = await answers(engine, True, temperature=0.8, max_tokens=40)
        drafted, accepted = sched.num_draft_tokens - greedy[0], sched.num_accepted_tokens - greedy[1]
        draft_pool = sched.drafter.pool
        assert engine.pool.num_free == engine.pool.num_blocks and draft_pool.num_free == draft_pool.num_blocks
    assert alone == plain and together == plain and all(len(t) > 5 for t in sampled)
    assert greedy[0] > 60 and drafted > 20
    if device == "cpu":
        assert greedy[1] == greedy[0] and accepted == drafted
    else:
        assert greedy[1] > greedy[0] // 2 and accepted > drafted // 2


@pytest.mark.gpu
def test_verify_graphs_on_cuda():
    """Verify steps replaying verify CUDA graphs (a synthetic Q4_1 model, 3 prompts arriving apart): the greedy
    tokens of decode and mixed graphs without drafts, with an oracle's drafts (all, some or none pass) and with
    n-gram drafts."""
    from tests.e2e.model_helpers import generate
    from tools.make_synthetic_checkpoint import synthetic_model
    from voltserve.backends.cuda.backend import CudaBackend
    from voltserve.graphs import StepGraphs
    from voltserve.models.llama import LlamaModel
    from voltserve.spec.ladder import DraftLadder
    from voltserve.spec.ngram import NgramDrafter

    loaded = synthetic_model("small256", device="cuda", dtype=torch.float16, qtype="Q4_1", seed=21)
    backend = CudaBackend(0)
    model = LlamaModel(loaded.config, loaded.tensors, backend, loaded.quantized, max_positions=512)
    made = []

    def graphs(drafts):
        def factory(kv):
            g = StepGraphs(model, backend, kv, max_num_seqs=4, max_model_len=512, prefill_tokens=(8, 64),
                           verify_width=DraftLadder(drafts).width if drafts else None)
            g.capture()
            made.append(g)
            return g
        return factory

    prompts = [[(5 * j) % 250 + 3 for j in range(n)] for n in (9, 30, 4)]
    plain = [t for t, _ in generate(model, backend, prompts, 40, graphs(0), arrive_every=3, temperature=0)]
    for drafter in (OracleDrafter(prompts, plain, 200), NgramDrafter(3, 1, 2)):
        out = generate(model, backend, prompts, 40, graphs(3), arrive_every=3, drafter=drafter, num_drafts=3,
                       temperature=0)
        assert [t for t, _ in out] == plain, type(drafter).__name__
        verify = sum(n for k, n in made[-1].replays.items() if k.verify)
        assert verify >= 5, made[-1].replays
    sched = generate.last_scheduler
    assert sched.num_verify_steps > 0
