"""The draft-model drafter (`voltserve.spec.draft_model`): its shadows' K/V bookkeeping against a scripted runner,
and, on tiny synthetic models on the CPU, lossless greedy output through the scheduler (case D1) with every draft
of a draft model that is the target accepted, partial acceptance, preemption, and no KV block of either pool
leaked."""

from __future__ import annotations

import pytest
import torch

from tools.make_synthetic_checkpoint import synthetic_model
from voltserve.backends.cpu import CpuBackend
from voltserve.kv_cache import BlockPool
from voltserve.models.llama import LlamaModel
from voltserve.offline import run_steps
from voltserve.request import SamplingParams
from voltserve.runner import ModelRunner, StepHandle
from voltserve.scheduler import Scheduler
from voltserve.sequence import Sequence, SequenceStatus
from voltserve.spec.draft_model import DraftModelDrafter
from voltserve.spec.ladder import DraftLadder

BS = 4  # tokens a KV block


class ScriptedRunner:
    """A draft runner double (synchronous steps, as ModelRunner's without graphs): records each step's (start,
    num_new, sample) per entry and samples the token `next_token(position after the entry)`."""

    def __init__(self, next_token=lambda pos: 100 + pos):
        self.steps: list[list[tuple[int, int, bool]]] = []
        self.next_token = next_token

    def async_sampler(self, plan):
        return None

    def launch(self, plan, feed=None):
        assert feed is None
        self.steps.append([(e.start, e.num_new, e.sample) for e in plan.entries])
        sampled = {e.seq.seq_id: self.next_token(e.start + e.num_new) for e in plan.entries if e.sample}
        return StepHandle(plan, result=(sampled, {}))

    def collect(self, handle):
        return handle.result


def running_seq(seq_id: int, tokens: list[int], output: list[int] = ()) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(temperature=0), 100)
    seq.output_ids = list(output)
    seq.status = SequenceStatus.RUNNING
    return seq


def test_shadow_keeps_accepted_drafts_and_recomputes_the_rejected_tail():
    runner = ScriptedRunner()
    pool = BlockPool(16, BS, enable_prefix_caching=False)
    drafter = DraftModelDrafter(runner, pool, 3, vocab_size=1000)
    seq = running_seq(0, list(range(1, 11)))  # 10 tokens
    drafter.prepare([(seq, 3)])
    # catch-up over the 10 tokens (its last row samples d1), then d1 and d2 fed one a step
    assert runner.steps == [[(0, 10, True)], [(10, 1, True)], [(11, 1, True)]]
    assert drafter.propose(seq, 3) == [110, 111, 112]
    assert drafter.propose(seq, 3) == []  # handed out once
    assert pool.num_free == 16 - 3  # 12 positions written (10 tokens, d1, d2)
    # the target accepted d1 and sampled 7 where d2 was: d1's K/V stays, the tail from 7 on is computed
    seq.output_ids = [110, 7]
    runner.steps.clear()
    drafter.prepare([(seq, 2)])
    assert runner.steps == [[(11, 1, True)], [(12, 1, True)]]
    assert drafter.propose(seq, 2) == [112, 113]
    # every draft accepted plus a bonus token: the catch-up is the last draft and the bonus
    seq.output_ids += [112, 113, 50]
    runner.steps.clear()
    drafter.prepare([(seq, 1)])
    assert runner.steps == [[(13, 2, True)]]
    drafter.forget(seq)
    assert pool.num_free == 16 and drafter.propose(seq, 1) == []


def test_catch_up_in_chunks_and_k_per_sequence():
    runner = ScriptedRunner()
    drafter = DraftModelDrafter(runner, BlockPool(32, BS, enable_prefix_caching=False), 4, vocab_size=1000,
                                max_chunk_tokens=6)
    a, b = running_seq(0, list(range(9))), running_seq(1, [5, 6])
    drafter.prepare([(a, 1), (b, 3)])
    # 9 + 2 tokens in chunks of 6: a's first 6, then a's last 3 and b's 2 (both sample); b alone decodes on
    assert runner.steps == [[(0, 6, False)], [(6, 3, True), (0, 2, True)], [(2, 1, True)], [(3, 1, True)]]
    assert drafter.propose(a, 4) == [109] and drafter.propose(b, 2) == [102, 103]  # k caps what is handed out


def test_drafts_end_at_an_id_past_the_targets_vocabulary():
    drafter = DraftModelDrafter(ScriptedRunner(lambda pos: 7 if pos < 4 else 900), BlockPool(8, BS), 3,
                                vocab_size=800)
    seq = running_seq(0, [1, 2, 3])
    drafter.prepare([(seq, 3)])
    assert drafter.propose(seq, 3) == [7]


def test_a_short_pool_takes_blocks_from_shadows_not_wanted_then_gives_no_drafts():
    pool = BlockPool(3, BS, enable_prefix_caching=False)
    drafter = DraftModelDrafter(ScriptedRunner(), pool, 2, vocab_size=1000)
    a, b = running_seq(0, list(range(6))), running_seq(1, list(range(6)))
    drafter.prepare([(a, 2)])  # 7 positions: 2 blocks
    assert drafter.propose(a, 2) and pool.num_free == 1
    drafter.prepare([(b, 2)])  # a is not wanted this step: its shadow goes
    assert drafter.propose(b, 2) and pool.num_free == 1
    drafter.prepare([(a, 2), (b, 2)])  # both wanted: a cannot get 2 blocks
    assert drafter.propose(a, 2) == [] and drafter.propose(b, 2) == [106, 107]
    b.status = SequenceStatus.FINISHED  # a finished sequence's shadow goes (the scheduler's _release forgets it)
    drafter.forget(b)
    drafter.prepare([(a, 2)])
    assert drafter.propose(a, 2) and pool.num_free == 1
    drafter.release_all()
    assert pool.num_free == 3


def test_bad_settings():
    with pytest.raises(ValueError):
        DraftModelDrafter(ScriptedRunner(), BlockPool(4, BS), 0, vocab_size=10)
    with pytest.raises(ValueError):
        DraftModelDrafter(ScriptedRunner(), BlockPool(4, BS), 2, vocab_size=10, max_chunk_tokens=0)


# -- real models on the CPU --------------------------------------------------------------------------------------

BACKEND = CpuBackend()


def tiny(seed: int):
    loaded = synthetic_model("tiny", device="cpu", dtype=torch.float32, seed=seed)
    model = LlamaModel(loaded.config, loaded.tensors, BACKEND, loaded.quantized, max_positions=256)
    cfg = loaded.config
    return model, BACKEND.allocate_kv_cache(cfg.num_layers, 64, BS, cfg.num_kv_heads, cfg.head_dim)


TARGET, TARGET_KV = tiny(1)
PROMPTS = [[(5 * j + i) % 300 + 1 for j in range(6 + 7 * i)] for i in range(3)]


def generate(drafter=None, k: int = 4, num_blocks: int = 64, max_tokens: int = 40, temperature: float = 0.0,
             prompts=PROMPTS, max_seqs: int = 8):
    runner = ModelRunner(TARGET, BACKEND, TARGET_KV, (-1,), seed=0)
    spec = {"drafter": drafter, "ladder": DraftLadder(k)} if drafter is not None else {}
    sched = Scheduler(BlockPool(num_blocks, BS), max_seqs, 64, 256, (-1,), **spec)
    seqs = [Sequence(i, f"r{i}", 0, list(p), SamplingParams(temperature=temperature, ignore_eos=True), max_tokens)
            for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    run_steps(sched, runner)
    assert sched.pool.num_free == num_blocks
    return [s.output_ids for s in seqs], sched


def model_drafter(seed: int, k: int = 4) -> DraftModelDrafter:
    model, kv = (TARGET, tiny(1)[1]) if seed == 1 else tiny(seed)
    return DraftModelDrafter(ModelRunner(model, BACKEND, kv, (), seed=0), BlockPool(64, BS, False), k, 320)


PLAIN, _ = generate()


def test_the_target_as_its_own_draft_passes_every_draft():
    drafter = model_drafter(1)
    out, sched = generate(drafter)
    assert out == PLAIN
    assert sched.num_draft_tokens > 60 and sched.num_accepted_tokens == sched.num_draft_tokens
    assert drafter.pool.num_free == drafter.pool.num_blocks  # every shadow freed with its sequence


@pytest.mark.parametrize("seed", [2, 3])
def test_D1_another_model_drafts_losslessly(seed):
    drafter = model_drafter(seed, k=3)
    out, sched = generate(drafter)
    assert out == PLAIN and sched.num_verify_steps > 0
    assert drafter.pool.num_free == drafter.pool.num_blocks


def test_preemption_and_sampling_leak_no_block():
    """A target pool too small for all three sequences preempts (their shadows go with their blocks); unseeded
    sampling verifies the draft model's drafts by rejection sampling."""
    drafter = model_drafter(1)
    out, sched = generate(drafter, num_blocks=24)
    assert out == PLAIN and sched.num_preemptions > 0
    assert drafter.pool.num_free == drafter.pool.num_blocks
    sampled, sched = generate(drafter, temperature=0.1)
    assert [len(o) for o in sampled] == [40] * 3 and sched.num_accepted_tokens > 0
    assert drafter.pool.num_free == drafter.pool.num_blocks


def test_a_draft_model_must_share_the_tokenizer():
    from types import SimpleNamespace

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from actors.draft_build import check_same_tokenizer
    from voltserve.errors import ConfigError

    def tok(vocab):
        return SimpleNamespace(backend=Tokenizer(WordLevel(vocab, unk_token="<unk>")))

    check_same_tokenizer(tok({"<unk>": 0, "a": 1, "b": 2}), tok({"<unk>": 0, "a": 1, "b": 2}), "same")
    with pytest.raises(ConfigError, match=r"speculative_model 'other' has another tokenizer than the model "
                                          r"\(3 vs 3 tokens, 2 differ\)"):
        check_same_tokenizer(tok({"<unk>": 0, "a": 1, "b": 2}), tok({"<unk>": 0, "a": 2, "b": 1}), "other")


def test_a_token_the_draft_model_lacks_stops_drafting_for_that_sequence_only():
    """A tokenizer id past the draft model's (padded, smaller) embedding: that sequence is never drafted (no
    forward sees it), the others are; forgetting the sequence clears the mark."""
    runner = ScriptedRunner()
    drafter = DraftModelDrafter(runner, BlockPool(16, BS, False), 2, vocab_size=1000, draft_vocab_size=50)
    odd, plain = running_seq(0, [1, 2, 60]), running_seq(1, [1, 2, 3])
    drafter.prepare([(odd, 2), (plain, 2)])
    assert drafter.propose(odd, 2) == [] and drafter.propose(plain, 2) == [103, 104]
    assert all(len(step) == 1 for step in runner.steps)  # plain's steps alone
    plain.output_ids = [103, 70]  # generated later: found among the new tokens
    drafter.prepare([(plain, 2)])
    assert drafter.propose(plain, 2) == [] and drafter.pool.num_free == 16
    drafter.forget(plain)
    assert not drafter._undraftable - {0}


class RecordingDrafter:
    """needs_prepare: records what `draft_work` asked for and what `schedule()` then asked `propose` for."""

    needs_prepare = True

    def __init__(self):
        self.prepared, self.proposed = [], []

    def prepare(self, wanted):
        self.prepared = [(s.seq_id, k) for s, k in wanted]

    def propose(self, seq, k):
        self.proposed.append((seq.seq_id, k))
        return [7] * k


@pytest.mark.parametrize("budget, head_len, expected", [
    (64, 0, [(0, 4), (1, 4), (2, 4)]),  # room for all
    (10, 0, [(0, 4), (1, 3)]),  # 10 tokens: 1 + 4, 1 + 3, then 1 for the last
    (64, 100, []),  # the queue's head (a 100-token prompt that could start) keeps the budget
    (64, 40, [(0, 4), (1, 4), (2, 4)]),  # 64 - 3 - 40 = 21 spare
    (48, 40, [(0, 4), (1, 1)]),  # 48 - 3 - 40 = 5 spare: 4; then 43 - 2 - 40 = 1
])
def test_draft_work_asks_for_what_schedule_verifies(budget, head_len, expected):
    drafter = RecordingDrafter()
    sched = Scheduler(BlockPool(64, BS), 8, budget, 256, (-1,), drafter=drafter, ladder=DraftLadder(4))
    for i in range(3):
        seq = running_seq(i, [1, 2, 3, 4, 5], output=[6])
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.block_ids = [sched.pool.allocate(), sched.pool.allocate()]
        sched.running.append(seq)
    if head_len:
        sched.add(Sequence(9, "r9", 0, list(range(1, head_len + 1)), SamplingParams(temperature=0), 10))
    drafter.prepare(sched.draft_work())
    sched.schedule()
    assert drafter.prepared == expected and drafter.proposed == expected


def test_sampled_drafts_from_the_targets_own_distribution_all_pass():
    """A sampled request drafts from q, the draft model's distribution under its parameters: with the target
    as its own draft q = p (the CPU's numerics do not depend on the step's shape), so every draft passes
    (min(1, p / q) = 1), where point-mass drafts pass with probability p(draft) only."""
    drafter = model_drafter(1)
    out, sched = generate(drafter, temperature=0.9)
    assert [len(o) for o in out] == [40] * 3
    assert sched.num_draft_tokens > 60 and sched.num_accepted_tokens == sched.num_draft_tokens
    assert drafter.pool.num_free == drafter.pool.num_blocks and not drafter._probs


def test_sampled_drafts_of_a_wider_draft_vocabulary_keep_the_targets_distribution():
    """A draft model with padded ids the target lacks (here 2 of 6, with 42% of q): q is taken over the target's
    ids, so a sampled draft is never cut and the first token still follows p (20,000 trials: each drafted by its
    own sequence, then all verified at once as spans of one `verify_sampled_many` call, independent draws)."""
    from voltserve.spec.verify import verify_sampled_many

    class WideRunner:
        def logits(self, plan):
            return torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0]).expand(sum(e.sample for e in plan.entries), 6)

    params = SamplingParams(temperature=1.0)
    drafter = DraftModelDrafter(WideRunner(), BlockPool(4, BS, False), 1, vocab_size=4, draft_vocab_size=6)
    drafter.generator.manual_seed(0)
    target = torch.tensor([[2.0, 0.0, 0.0, 0.0]] * 2)
    gen, n, drafts, probs = torch.Generator().manual_seed(1), 20000, [], []
    for i in range(n):
        seq = Sequence(i, "r", 0, [1, 2, 3], params, 10)
        seq.status = SequenceStatus.RUNNING
        drafter.prepare([(seq, 1)])
        drafts += drafter.propose(seq, 1)
        assert len(drafts) == i + 1
        probs.append(drafter.proposal_probs(seq, 1))
        drafter.forget(seq)
    tokens, _ = verify_sampled_many(target.repeat(n, 1), torch.tensor(drafts), [1] * n, [params] * n, gen, probs)
    counts = torch.bincount(tokens[:, 0], minlength=4).float()
    assert (counts / n - torch.softmax(target[0], -1)).abs().max() < 0.012, counts / n


def test_shadows_share_the_draft_k_v_of_a_common_prompt():
    """With prefix caching, the full blocks of target tokens a shadow computed are published; a new sequence with
    the same leading tokens starts past them (never past its last token), drafts are never shared."""
    runner = ScriptedRunner()
    pool = BlockPool(16, BS)
    drafter = DraftModelDrafter(runner, pool, 2, vocab_size=1000)
    a, b = running_seq(0, list(range(1, 11))), running_seq(1, list(range(1, 11)) + [42])
    drafter.prepare([(a, 2)])
    assert runner.steps == [[(0, 10, True)], [(10, 1, True)]]
    runner.steps.clear()
    drafter.prepare([(a, 2), (b, 2)])  # a: nothing new (its drafts recomputed: not accepted); b: 2 blocks reused
    assert runner.steps == [[(9, 1, True), (8, 3, True)], [(10, 1, True), (11, 1, True)]]
    assert drafter.propose(b, 2) == [111, 112] and pool.num_cached == 2
    c = running_seq(2, list(range(1, 9)))  # exactly two blocks: the last one is computed again for its row
    runner.steps.clear()
    drafter.prepare([(c, 1)])
    assert runner.steps == [[(4, 4, True)]]
    for seq in (a, b, c):
        drafter.forget(seq)
    assert pool.num_free == 16 and pool.num_cached == 2  # freed, still findable


def test_shared_prompts_with_prefix_caching_stay_lossless():
    """Three requests of one prompt, one at a time: the second and third shadows start from the first's
    published blocks (the draft model computes fewer tokens than without prefix caching), output unchanged."""
    shared = [PROMPTS[2]] * 3
    plain, _ = generate(prompts=shared, max_seqs=1)
    computed = {}
    for caching in (False, True):
        model, kv = tiny(2)
        runner = ModelRunner(model, BACKEND, kv, (), seed=0)
        drafter = DraftModelDrafter(runner, BlockPool(64, BS, caching), 3, 320)
        launch, tokens = runner.launch, [0]
        runner.launch = lambda plan, feed=None: (tokens.__setitem__(0, tokens[0] + plan.num_tokens),
                                                 launch(plan, feed))[1]
        out, sched = generate(drafter, k=3, prompts=shared, max_seqs=1)
        assert out == plain and sched.num_verify_steps > 0
        assert drafter.pool.num_free == drafter.pool.num_blocks
        computed[caching] = tokens[0]
    # a shadow starts at its sequence's first draft step, 21 tokens (the prompt's 20 and the prefill's token):
    # the 5 full blocks before the last token, the whole prompt, are computed once, not three times
    assert computed[False] - computed[True] == 2 * 20, computed


def test_a_published_block_is_never_written_again():
    """A prepare before the target grew recomputes its last token; when that token ends a block, the block must
    not have been published (another shadow may share it): no catch-up writes into a block with a hash."""
    pool = BlockPool(16, BS)
    written = []

    class CheckingRunner(ScriptedRunner):
        def launch(self, plan, feed=None):
            for e in plan.entries:
                blocks = e.seq.block_ids[e.start // BS:(e.start + e.num_new - 1) // BS + 1]
                written.extend(b for b in blocks if pool._block_hash[b] is not None)
            return super().launch(plan, feed)

    drafter = DraftModelDrafter(CheckingRunner(), pool, 2, vocab_size=1000)
    a = running_seq(0, list(range(1, 9)))  # two full blocks, the last ending at its last token
    drafter.prepare([(a, 2)])
    b = running_seq(1, list(range(1, 9)) + [50])
    drafter.prepare([(a, 2), (b, 2)])  # a has not grown: position 7 again
    a_block1 = drafter._shadows[0][1].block_ids[1]
    drafter.prepare([(a, 2), (b, 2)])
    # a's block 1 waits until a moves past it; b shared a's block 0 and published its own block 1 (9 tokens)
    assert written == [] and pool._block_hash[a_block1] is None and pool.num_cached == 2
    a.output_ids = [60]
    drafter.prepare([(a, 2)])
    assert written == [] and pool._block_hash[a_block1] is None  # b's block holds that hash already
