"""The default model on the GPU (CudaBackend, our kernels) against the CPU reference backend."""

import pytest
import torch

from tests.e2e.engine_helpers import chat_ids, complete, running_engine
from tests.e2e.model_helpers import all_logits, generate, greedy
from voltserve.backends.cpu import CpuBackend
from voltserve.models.llama import LlamaModel
from voltserve.request import FinishReason

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "The capital of France is"]
# fp16 activations and KV vs the fp32 reference, same (dequantized) weights: logits agree to ~1% of their range
LOGIT_REL_TOL = 3e-2


@pytest.fixture(scope="module")
def gpu(smollm2):
    from voltserve.backends.cuda.backend import CudaBackend

    backend = CudaBackend(0)
    return LlamaModel(smollm2.config, smollm2.tensors, backend, smollm2.quantized, max_positions=512), backend


@pytest.fixture(scope="module")
def cpu(smollm2):
    backend = CpuBackend(torch.float32, use_int4=False)
    return LlamaModel(smollm2.config, smollm2.tensors, backend, smollm2.quantized, max_positions=512), backend


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_cpu_backend(gpu, cpu, smollm2_tokenizer, prompt):
    ids = smollm2_tokenizer.encode(prompt)
    ours, ref = all_logits(*gpu, ids), all_logits(*cpu, ids)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < LOGIT_REL_TOL, f"relative logit error {rel}"
    assert ours[-1].argmax() == ref[-1].argmax()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"top-1 agreement over positions {agree}"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_16_greedy_tokens_match_cpu_backend(gpu, cpu, smollm2_tokenizer, prompt):
    ids = smollm2_tokenizer.encode(prompt)
    assert greedy(*gpu, ids, 16) == greedy(*cpu, ids, 16)


def test_graph_replay_equals_eager(gpu, smollm2_tokenizer):
    from voltserve.graphs import StepGraphs

    model, backend = gpu
    ids = smollm2_tokenizer.encode(PROMPTS[0])
    eager = greedy(model, backend, ids, 24)
    graphs = []

    def factory(kv):
        g = StepGraphs(model, backend, kv, max_num_seqs=4, max_model_len=512)
        g.capture()
        graphs.append(g)
        return g

    assert greedy(model, backend, ids, 24, graphs_factory=factory) == eager
    assert graphs[0].buckets == [1, 2, 4]
    # asynchronous scheduling: each step's input id comes from the previous step's argmax on the device
    assert greedy(model, backend, ids, 24, graphs_factory=factory, pipelined=True) == eager


def test_mixed_graphs_and_admission_ahead_equal_eager(gpu, smollm2_tokenizer):
    """Requests arriving while others decode: their prefills replay mixed graphs next to the decodes, and the
    pipelined loop starts them in steps planned ahead (fed decodes + prefill in one graph): the greedy tokens
    equal the eager loop's."""
    from voltserve.graphs import GraphKey, StepGraphs

    model, backend = gpu
    prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    graphs = []

    def factory(kv):
        g = StepGraphs(model, backend, kv, max_num_seqs=4, max_model_len=512, prefill_tokens=(8, 64))
        g.capture()
        graphs.append(g)
        return g

    eager = generate(model, backend, prompts, 20, arrive_every=3, temperature=0)
    assert generate(model, backend, prompts, 20, factory, arrive_every=3, temperature=0) == eager
    assert generate(model, backend, prompts, 20, factory, pipelined=True, arrive_every=3, temperature=0) == eager
    for g in graphs:  # one mixed replay per prompt (the first one alone), decode graphs for the rest
        assert sum(n for k, n in g.replays.items() if k.prefill) == 3, g.replays
        assert sum(n for k, n in g.replays.items() if not k.prefill) >= 20 + 2, g.replays
        assert g.replays[GraphKey(1, 8)] + g.replays[GraphKey(1, 64)] == 1, g.replays


def test_async_scheduling_samples_like_the_synchronous_loop(gpu, smollm2_tokenizer):
    """Seeded temperature sampling with logprobs, 3 sequences in a graph bucket of 4: the pipelined loop (device
    sampler ids fed to the next step on the device) gives the synchronous loop's tokens and logprobs."""
    from voltserve.graphs import StepGraphs

    model, backend = gpu
    prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]

    def factory(kv):
        g = StepGraphs(model, backend, kv, max_num_seqs=4, max_model_len=512)
        g.capture()
        return g

    params = dict(temperature=0.8, top_p=0.95, seed=1234, logprobs=3)
    sync = generate(model, backend, prompts, 20, factory, pipelined=False, **params)
    ahead = generate(model, backend, prompts, 20, factory, pipelined=True, **params)
    assert [t for t, _ in ahead] == [t for t, _ in sync]
    for (_, lps_a), (_, lps_s) in zip(ahead, sync):
        assert len(lps_a) == len(lps_s) == 20
        assert lps_a == lps_s  # same kernel on the same logits: bitwise equal values
    greedy_sync = generate(model, backend, prompts, 20, factory, pipelined=False, temperature=0)
    assert [t for t, _ in sync] != [t for t, _ in greedy_sync]  # the sampler did sample


def test_pdl_changes_no_value(gpu, smollm2, smollm2_tokenizer):
    """PDL only moves when kernels start (SM90+): prefill logits are bitwise equal with it off, and so are the
    greedy tokens of graph-replayed decode steps."""
    from voltserve.backends.cuda.backend import CudaBackend
    from voltserve.graphs import StepGraphs

    model, backend = gpu
    if not backend.pdl:
        pytest.skip("programmatic dependent launch needs SM90+")
    off_backend = CudaBackend(0, pdl=False)
    off = LlamaModel(smollm2.config, smollm2.tensors, off_backend, smollm2.quantized, max_positions=512)
    ids = smollm2_tokenizer.encode(PROMPTS[1])
    assert torch.equal(all_logits(model, backend, ids), all_logits(off, off_backend, ids))

    def factory(m, b):
        def make(kv):
            g = StepGraphs(m, b, kv, max_num_seqs=2, max_model_len=512)
            g.capture()
            return g
        return make

    assert greedy(model, backend, ids, 24, factory(model, backend)) == greedy(off, off_backend, ids, 24,
                                                                              factory(off, off_backend))


async def test_engine_on_gpu_answers_and_batches(smollm2):
    async with running_engine(smollm2, device="cuda", max_num_seqs=8) as engine:
        text, _, last = await complete(engine, chat_ids(engine, "What is the capital of France?"),
                                       temperature=0, max_tokens=32)
        assert "Paris" in text and last.finish_reason is FinishReason.STOP
        import asyncio

        outs = await asyncio.gather(*(complete(engine, chat_ids(engine, f"Count to {i}."), temperature=0.7,
                                               seed=i, max_tokens=20, ignore_eos=True) for i in range(6)))
        assert all(len(o[1]) == 20 for o in outs)
        stats = engine.kv_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]


async def test_R1_seeded_sampling_on_gpu_is_reproducible(smollm2):
    """Case R1 on the GPU: the same seeded request gives the same tokens run to run, alone and in the same batch.

    Prefix caching is off here: on the GPU a step's numerics depend on its shape (kernels pick their tiling by
    batch size and prefill chunk length), so a prefix-cache hit, or other requests in the batch, can flip a
    near-tied sampled token. The CPU backend is invariant to both (tests/e2e/test_engine.py). Rows are routed to
    the device or host sampler by their own parameters only."""
    import asyncio

    async with running_engine(smollm2, device="cuda", max_num_seqs=8, enable_prefix_caching=False) as engine:
        ids = chat_ids(engine, "Write a short poem about the sea.")
        seeded = dict(temperature=0.9, top_p=0.9, top_k=40, seed=77, max_tokens=24, ignore_eos=True)
        penalised = dict(temperature=0.8, seed=1, repetition_penalty=1.3, max_tokens=24, ignore_eos=True)
        alone = [await complete(engine, ids, **seeded) for _ in range(2)]
        batched = [await asyncio.gather(complete(engine, ids, **seeded),
                                        complete(engine, chat_ids(engine, "Hello"), **penalised))
                   for _ in range(2)]
        other_seed = await complete(engine, ids, **{**seeded, "seed": 78})
    assert alone[0][1] == alone[1][1] != other_seed[1]
    assert batched[0][0][1] == batched[1][0][1] and batched[0][1][1] == batched[1][1][1]


@pytest.mark.parametrize("s8,bound", [("off", 1e-2), ("auto", 3e-2)])
def test_repacked_quant_rows_serve_like_gguf_rows(s8, bound):
    """A Q4_1 model whose linears are all repacked (every in_features % 256 == 0) against the same model on GGUF
    rows: the logits of 1- and 8-token steps (gemv_mma, or gemv_s8 with its int8 x, vs the GGUF rows' kernels)
    and of an 80-token prefill (gemm_tc) agree up to summation order (gemv_s8: and x's 8-bit rounding, bound
    3e-2 of max |logit|), and with repacked rows graph replay equals eager."""
    from tools.make_synthetic_checkpoint import synthetic_model
    from voltserve.backends.cuda.backend import CudaBackend

    loaded = synthetic_model("small256", device="cuda", dtype=torch.float16, qtype="Q4_1", seed=3)
    models = {}
    for layout in ("on", "off"):
        backend = CudaBackend(0)
        backend.quant_repack, backend.gemv_s8 = layout, s8
        model = LlamaModel(loaded.config, loaded.tensors, backend, loaded.quantized, max_positions=512)
        assert {lin.layout for layer in model.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                  layer.down)} == {"repacked" if layout == "on"
                                                                                   else "gguf"}
        models[layout] = (model, backend)
    _variants_agree(models["on"], models["off"], lambda n: bound if n <= 8 else 1e-2)


@pytest.mark.parametrize("repack", ["on", "off"])
def test_dequant_gemm_prefill_agrees_with_gemm_tc(repack):
    """A 300-token prefill of a Q4_1 model (repacked and GGUF rows) with its GEMMs through dequant_f16 + cuBLAS
    (quant_gemm "dequant") against gemm_tc ("tc"): the same fp16 weights in another summation order, so the logits
    agree within 1e-2 of max |logit|; dequant_f16 ran only under "dequant"."""
    from tests.kernels.kutils import launched_kernels
    from tools.make_synthetic_checkpoint import synthetic_model
    from voltserve.backends.cuda.backend import CudaBackend

    loaded = synthetic_model("small256", device="cuda", dtype=torch.float16, qtype="Q4_1", seed=13)
    ids = [(7 * j) % 250 + 3 for j in range(300)]
    logits = {}
    for mode in ("dequant", "tc"):
        backend = CudaBackend(0)
        backend.quant_repack, backend.quant_gemm = repack, mode
        model = LlamaModel(loaded.config, loaded.tensors, backend, loaded.quantized, max_positions=512)
        with launched_kernels(backend) as names:
            logits[mode] = all_logits(model, backend, ids)
        assert ("dequant_f16" in names, "gemm_tc" in names) == (mode == "dequant", mode == "tc")
    got, ref = logits["dequant"], logits["tc"]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_quant_gemv_rows_past_16_agree_with_the_gemm():
    """A Q4_1 model on repacked rows: forward passes of 24 and 32 tokens run their linears as gemv_s8 launches
    (S8_NCOL = 4, one launch each; linear.gemv_max_rows on SM90+) against the GEMM (quant_gemv_rows
    "16"): the logits agree within 3e-2 of max |logit| (x's 8-bit rounding), and only the first ran gemv_s8."""
    from tests.kernels.kutils import launched_kernels
    from tools.make_synthetic_checkpoint import synthetic_model
    from voltserve.backends.cuda.backend import CudaBackend

    loaded = synthetic_model("small256", device="cuda", dtype=torch.float16, qtype="Q4_1", seed=17)
    if CudaBackend(0).loader.compile_arch < 90:
        pytest.skip("gemv_s8 launches past 16 rows are an SM90+ rule (kernels.quant_gemv_max_rows)")
    ids = [(11 * j) % 250 + 3 for j in range(32)]
    logits = {}
    for rows in ("auto", "16"):
        backend = CudaBackend(0)
        backend.quant_repack, backend.quant_gemv_rows = "on", rows
        model = LlamaModel(loaded.config, loaded.tensors, backend, loaded.quantized, max_positions=512)
        for n in (24, 32):
            with launched_kernels(backend) as names:
                logits[rows, n] = all_logits(model, backend, ids[:n])
            assert ("gemv_s8" in names) == (rows == "auto"), (rows, n)
    for n in (24, 32):
        got, ref = logits["auto", n], logits["16", n]
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 3e-2, n


def test_folded_norms_serve_like_unfolded():
    """An fp16 model (random, non-unit norm weights) with every RMSNorm folded into the linear after it
    (VOLTSERVE_NORM_FOLD "on": gemv's NORM_POST at 1 row, unit-norm rms_norm + gemv_mma / cuBLAS above) against the
    same model unfolded: the logits of 1- and 8-token steps and an 80-token prefill agree within 1e-2 of max
    |logit| (fp16(W g) vs fp16(x / rms * g) roundings), and graph replay equals eager."""
    from tools.make_synthetic_checkpoint import synthetic_model
    from voltserve.backends.cuda.backend import CudaBackend

    loaded = synthetic_model("small256", device="cuda", dtype=torch.float16, seed=5)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for name, t in loaded.tensors.items():
        if name.endswith("norm.weight"):
            t.copy_(torch.rand(t.shape, generator=gen, device="cuda") + 0.5)
    models = {}
    for fold in ("on", "off"):
        backend = CudaBackend(0)
        backend.norm_fold = fold
        model = LlamaModel(loaded.config, loaded.tensors, backend, loaded.quantized, max_positions=512)
        folded = {lin.norm_folded for layer in model.layers for lin in (layer.qkv, layer.gate_up)}
        assert folded == {fold == "on"} and model.lm_head.norm_folded == (fold == "on")
        assert not any(layer.o_proj.norm_folded or layer.down.norm_folded for layer in model.layers)
        models[fold] = (model, backend)
    _variants_agree(models["on"], models["off"], lambda n: 1e-2)


def test_fused_rotary_serves_like_two_launches():
    """Decode steps with the rotary and KV write inside attn_decode, and mixed steps inside attn_decode and
    attn_prefill (VOLTSERVE_ROPE_ATTN auto), the decode steps' only (decode) and rotary_write_kv + attention
    (off): the same greedy tokens and logprobs bit for bit, for 3 prompts of which the later ones arrive while the
    first decodes (mixed steps; the first prompt's prefill-only step, 70 tokens, past kernels.ROPE_PREFILL_MAX_TOKENS,
    takes the two launches in every mode), eager and through CUDA graphs."""
    from tools.make_synthetic_checkpoint import synthetic_model
    from voltserve.backends.cuda.backend import CudaBackend

    loaded = synthetic_model("small256", device="cuda", dtype=torch.float16, seed=7)
    # the later two start in mixed steps of <= kernels.ROPE_PREFILL_MAX_TOKENS prompt tokens (one q tile, four)
    prompts = [list(range(3, 73)), list(range(50, 53)), list(range(7, 60))]
    results, rope_launches = {}, {}
    for rope in ("auto", "decode", "off"):
        backend = CudaBackend(0)
        backend.rope_attn = rope
        model = LlamaModel(loaded.config, loaded.tensors, backend, loaded.quantized, max_positions=512)
        eager, graphs, names = _eager_and_graphs(model, backend, prompts)
        rope_launches[rope] = names.count("rope_kv_write")
        results[rope] = (eager, graphs)
    assert results["auto"] == results["decode"] == results["off"]
    # auto: the prefill-only step only; decode: also the two mixed steps
    assert 0 < rope_launches["auto"] < rope_launches["decode"] < rope_launches["off"]


def test_attention_xq_serves_like_quantize_launches():
    """A Q4_1 model on repacked rows (gemv_s8 from 2 rows) whose decode steps of 2-3 sequences run o_proj on the
    int8 x attn_decode wrote (VOLTSERVE_ATTN_XQ auto, linear.attention_xq) against quantize_s8 launches (off):
    the same greedy tokens and logprobs bit for bit, eager and through CUDA graphs, with fewer quantize_s8
    launches."""
    results, quantize_launches = _xq_runs(11, "attn_xq", "o_proj")
    assert results["auto"] == results["off"]
    assert 0 < quantize_launches["auto"] < quantize_launches["off"]


def test_swiglu_xq_serves_like_quantize_launches():
    """A Q4_1 model on repacked rows whose one-row decode steps run down on the int8 x the gate_up gemv_s8w wrote
    (VOLTSERVE_MLP_XQ auto, linear.swiglu_xq_target; x quantized per launch, as Llama-3-8B's k = 14,336 down is)
    against quantize_s8 launches (off): the same greedy tokens and logprobs bit for bit, eager and through CUDA
    graphs, with fewer quantize_s8 launches."""
    results, quantize_launches = _xq_runs(12, "mlp_xq", "down", gemv_s8_x="launch")
    assert results["auto"] == results["off"]
    assert 0 < quantize_launches["auto"] < quantize_launches["off"]


@pytest.mark.parametrize("repack", ["on", "off"])
def test_a_k_quant_gguf_serves_like_the_cpu_reference(tmp_path, repack):
    """A GGUF of Q4_K / Q5_K / Q6_K weights loads converted (loaders.gguf_convert: Q4_1 and Q8_0 blocks) and runs
    on the GPU's quant kernels with fp16 x (repacked rows or GGUF rows: gemv_mma, and gemm_tc for the prefill), its
    logits of 1- and 8-token steps and a 40-token prefill within 3e-2 of max |logit| of the fp32 CPU reference on
    the same converted weights (H100, session 49: 0.0010-0.0154). gemv_s8 / gemv_s8w (x rounded to int8 per 32)
    are left out: on this random model (N(0, 1) norm weights, Q6_K sub-block scales over the whole int8 range)
    their x rounding reaches 1.2% / 6.4% / 22% of max |logit| at 1 / 8 / 40 tokens, 0.3-22% with any one linear
    on them; the kernels equal their int8 emulation on these formats (tests/kernels/test_gemv_s8.py)."""
    from loaders.gguf import load_gguf
    from tests.loaders.test_gguf_convert import k_quant_gguf
    from voltserve.backends.cuda.backend import CudaBackend

    k_quant_gguf(tmp_path / "k.gguf")
    loaded = load_gguf(tmp_path / "k.gguf")
    assert {q.qtype for q in loaded.quantized.values()} == {"Q4_1", "Q8_0"}
    backend = CudaBackend(0)
    backend.quant_repack, backend.gemv_s8 = repack, "off"
    gpu_model = LlamaModel(loaded.config, loaded.tensors, backend, loaded.quantized, max_positions=128)
    assert {layer.down.fmt for layer in gpu_model.layers} == {"Q8_0"}  # and q / k / v fused as Q8_0
    assert [(layer.qkv.fmt, layer.gate_up.fmt) for layer in gpu_model.layers] == [("Q8_0", "Q4_1")] * 2
    cpu_backend = CpuBackend(torch.float32, use_int4=False)
    cpu_model = LlamaModel(loaded.config, loaded.tensors, cpu_backend, loaded.quantized, max_positions=128)
    ids = [(7 * i + 3) % 261 for i in range(40)]
    for n in (1, 8, 40):
        got, ref = all_logits(gpu_model, backend, ids[:n]), all_logits(cpu_model, cpu_backend, ids[:n])
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 3e-2, n


def _xq_runs(seed, knob, linear, **settings):
    """`_eager_and_graphs` of a small random Q4_1 model on repacked rows (`seed`), once with the backend's `knob`
    (an x-handoff switch) "auto" and once "off", `settings` set on the backend too, asserting each layer's
    `linear` stored repacked: ({value: (eager, graphs)}, {value: quantize_s8 launches of the eager run})."""
    from tools.make_synthetic_checkpoint import synthetic_model
    from voltserve.backends.cuda.backend import CudaBackend

    loaded = synthetic_model("small1024", device="cuda", dtype=torch.float16, qtype="Q4_1", seed=seed)
    prompts = [list(range(3, 40)), list(range(50, 53)), list(range(7, 100))]
    results, quantize_launches = {}, {}
    for value in ("auto", "off"):
        backend = CudaBackend(0)
        if backend.loader.arch < 80:
            pytest.skip("repacked rows and the int8 decode kernels are SM80+")
        backend.quant_repack = "on"
        for name, setting in {**settings, knob: value}.items():
            setattr(backend, name, setting)
        model = LlamaModel(loaded.config, loaded.tensors, backend, loaded.quantized, max_positions=512)
        assert all(getattr(layer, linear).layout == "repacked" for layer in model.layers)
        eager, graphs, names = _eager_and_graphs(model, backend, prompts)
        quantize_launches[value] = names.count("quantize_s8")
        results[value] = (eager, graphs)
    return results, quantize_launches


def test_gemv_chain_serves_like_separate_launches():
    """An fp16 model whose one-row decode steps run each layer's tail as one gemv_chain launch (VOLTSERVE_GEMV_CHAIN
    on; the last layer's with the lm_head) against the same GEMVs launched one by one (gemv_tma on every weight,
    norms folded in both): the same greedy tokens and logprobs bit for bit, eager and through CUDA graphs, for 3
    prompts of which the later ones arrive while the first decodes (their multi-row steps take the separate
    launches either way)."""
    from tools.make_synthetic_checkpoint import synthetic_model
    from voltserve.backends.cuda.backend import CudaBackend

    loaded = synthetic_model("small1024", device="cuda", dtype=torch.float16, seed=9)
    prompts = [list(range(3, 40)), list(range(50, 53)), list(range(7, 100))]
    results, chains = {}, {}
    for chain in ("on", "off"):
        backend = CudaBackend(0)
        if backend.loader.arch < 90:
            pytest.skip("gemv_chain needs SM90+")
        backend.gemv_chain, backend.gemv_tma, backend.norm_fold = chain, "on", "on"
        model = LlamaModel(loaded.config, loaded.tensors, backend, loaded.quantized, max_positions=512)
        eager, graphs, names = _eager_and_graphs(model, backend, prompts)
        chains[chain] = names.count("gemv_chain")
        results[chain] = (eager, graphs)
    assert results["on"] == results["off"]
    assert chains["off"] == 0 and chains["on"] > 0 and chains["on"] % 2 == 0  # two layers a one-row step


def _eager_and_graphs(model, backend, prompts):
    """Greedy generation of 20 tokens for `prompts` arriving every 3 steps, eager and through CUDA graphs:
    (eager results, graph results, the kernels the eager run launched)."""
    from tests.kernels.kutils import launched_kernels
    from voltserve.graphs import StepGraphs

    def factory(kv):
        g = StepGraphs(model, backend, kv, max_num_seqs=4, max_model_len=512)
        g.capture()
        return g

    with launched_kernels(backend) as names:
        eager = generate(model, backend, prompts, 20, arrive_every=3, temperature=0)
    return eager, generate(model, backend, prompts, 20, factory, arrive_every=3, temperature=0), names


def _variants_agree(variant, reference, bound):
    """Logits of 1- and 8-token steps and an 80-token prefill (a GEMM: more rows than any decode GEMV takes,
    linear.gemv_max_rows) of two (model, backend) builds of one checkpoint agree within bound(n) of max |logit|,
    and the variant's graph replay equals its eager steps."""
    from voltserve.graphs import StepGraphs

    ids = list(range(3, 83))
    for n in (1, 8, len(ids)):
        got, ref = all_logits(*variant, ids[:n]), all_logits(*reference, ids[:n])
        assert ((got - ref).abs().max() / ref.abs().max()).item() < bound(n), n
    model, backend = variant

    def factory(kv):
        g = StepGraphs(model, backend, kv, max_num_seqs=4, max_model_len=512)
        g.capture()
        return g

    eager = greedy(model, backend, ids, 12)
    assert greedy(model, backend, ids, 12, graphs_factory=factory) == eager
