"""Verification of drafts against the target model's logits.

For a sequence whose step fed [its last token, d_1 .. d_k] the target gives k + 1 rows of logits: row i is the
distribution of the token after d_i (row 0: after the last token). Drafts are accepted from the first on while
they pass; the first row that rejects (or the row after the last draft) samples one more token, so a verify step
emits 1..k + 1 tokens.

- Greedy: d_i passes when it is row i-1's argmax; the output equals non-speculative greedy decoding exactly.
- Sampled: speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding"; Chen et al. 2023): with a drafter that proposes one token for certain (q a point mass, as n-gram
  lookup does), d_i passes with probability p(d_i) and a rejection samples from p with d_i removed, renormalized;
  every emitted token then follows the target's distribution p (after temperature, top-k, top-p, min-p).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from voltserve.sampling import filter_logits
from voltserve.transfer import indices_to_device


def draftable(seq, output_len: int | None = None) -> bool:
    """Whether `seq`'s next tokens may be drafted: no grammar (its mask follows each token), no logprobs, no
    penalties (each row's distribution would depend on the tokens accepted before it), min_tokens met (no EOS
    masking due), and not seeded sampling: a verify draws a number of random values that depends on how many
    drafts it checks, which depends on the other requests (the ladder, the budget), while a seeded request's
    random draws must not depend on what runs beside it (case R1: the same tokens run to run). output_len: the
    output length the step starts from (default: the current one)."""
    p = seq.params
    n = len(seq.output_ids) if output_len is None else output_len
    return (p.grammar is None and p.logprobs is None and not p.has_penalties
            and n >= p.min_tokens and (p.seed is None or p.is_greedy))


def accept_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """Tokens a greedy verify emits. target_ids: [len(drafts) + 1] the argmax of each row."""
    out = []
    for i, d in enumerate(drafts):
        out.append(target_ids[i])
        if target_ids[i] != d:
            return out
    out.append(target_ids[len(drafts)])
    return out


def accept_checked(drafts: Sequence[int], passed: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """Tokens a verify emits from its rows' separate checks (`CudaBackend.sample_verify`): drafts [k]; passed
    [k] (truthy where row i's draft passed its own check); tokens [k + 1], row i's token drawn from its residual
    (the last row's from its distribution). The drafts up to the first failing row, then that row's token."""
    accepted = next((i for i, ok in enumerate(passed) if not ok), len(drafts))
    return [*drafts[:accepted], tokens[accepted]]


def sampling_distribution(logits: torch.Tensor, params) -> torch.Tensor:
    """The distribution a request samples from: softmax of logits rows ([vocab] or [n, vocab] fp32, any device)
    under its temperature, top-k, top-p and min-p (params: one SamplingParams, or one per row of [n, vocab]); a
    row those leave nothing finite (extreme parameters) gets its argmax for certain, the limit they tend to. No
    host sync: a draft model's q on the GPU comes from here too."""
    q = torch.softmax(filter_logits(logits, params), -1)
    bad = ~torch.isfinite(q).all(-1, keepdim=True) | (q.sum(-1, keepdim=True) <= 0)
    point = torch.nn.functional.one_hot(logits.argmax(-1), q.shape[-1]).to(q.dtype)
    return torch.where(bad, point, q)


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_greedy` without leaving the device. logits: [k + 1, vocab] (or their argmax [k + 1] int64);
    drafts: [k] int64 on the same device. Returns (tokens [k + 1] int64, accepted [] int64): the step emits
    tokens[:accepted + 1]."""
    targets = logits if logits.dim() == 1 else logits.argmax(-1)
    return targets, _leading_true(targets[:-1] == drafts)


def verify_sampled(logits: torch.Tensor, drafts: torch.Tensor, params, generator: torch.Generator,
                   draft_probs: Sequence[torch.Tensor] | None = None, at_once: bool | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of one sequence's verify rows (`verify_sampled_many` of one span).

    Args:
        logits: [k + 1, vocab], the target's rows; drafts: [k] int64 on logits' device (k >= 0); params,
            generator, draft_probs, at_once: as `verify_sampled_many` takes for one span.
    Returns:
        (tokens [k + 1] int64, accepted [] int64): the step emits tokens[:accepted + 1].
    """
    tokens, accepted = verify_sampled_many(logits, drafts, [drafts.shape[0]], [params], generator, [draft_probs],
                                           at_once)
    return tokens[0], accepted[0]


def verify_sampled_many(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: Sequence[int],
                        params: Sequence, generator: torch.Generator,
                        draft_probs: Sequence[Sequence[torch.Tensor] | None], at_once: bool | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of the verify rows of several sequences (spans) in one call. Off the CPU with no host
    sync: the rows of every span are filtered together and every draft is checked at once, so a step's sampled
    verify is a fixed number of launches whatever its batch, and its tokens reach the host in one copy. On the
    CPU position by position (see `at_once`).

    Args:
        logits: [sum(k_s + 1), vocab] fp32 (or fp16 / bf16): span s's k_s + 1 rows of the target, the spans in
            order, on any device.
        drafts: [sum(k_s)] int64, the spans' proposed ids in order, on logits' device.
        num_drafts: k_s of each span (>= 0).
        params: each span's SamplingParams (temperature > 0; no penalties, see `draftable`).
        generator: a torch.Generator on logits' device.
        draft_probs: per span, q of each draft ([vocab'] each, on any device, summing to 1; a draft model's,
            `voltserve.spec.draft_model`, whose vocabulary may be wider or narrower), or None: every draft of
            the span proposed for certain (q a point mass, as n-gram lookup proposes).
        at_once: check every draft at once (no host sync; the default off the CPU), or position by position
            with only the spans still passing (fewer rows filtered; the default on the CPU). Both draw from the
            same distributions.
    Returns:
        (tokens [spans, max k_s + 1] int64, accepted [spans] int64) on logits' device: span s emits
        tokens[s, :accepted[s] + 1], its first accepted[s] drafts and a token sampled from the first rejecting
        row's residual (or from its last row when every draft passes).

    This is speculative sampling (Leviathan et al. 2023; Chen et al. 2023): d_i passes with probability
    min(1, p(d_i) / q(d_i)) (u q(d_i) < p(d_i), one uniform u per draft, drawn for every draft whether or not
    an earlier one failed); a rejection samples from max(p - q, 0) renormalized (a point mass: p without d_i).
    A rejection whose residual is empty up to rounding (p <= q everywhere) keeps d_i. The sample is drawn by an
    exponential race (argmax of r / E, E ~ Exp(1) per id), which picks id i with probability r_i / sum(r) and,
    unlike torch.multinomial, never checks the distribution on the host.
    """
    device, vocab = logits.device, logits.shape[-1]
    spans, widest = len(num_drafts), max(num_drafts, default=0)
    starts = [0, *itertools.accumulate(k + 1 for k in num_drafts)][:spans]  # each span's first row
    q = _draft_q(drafts, num_drafts, draft_probs, vocab, device)  # [sum(k_s), vocab], or None: point masses
    tokens = torch.zeros(spans, widest + 1, dtype=torch.int64, device=device)
    draft_slots = [s * (widest + 1) + i for s in range(spans) for i in range(num_drafts[s])]  # in `tokens`
    if at_once if at_once is not None else device.type != "cpu":
        accepted, token, draft_slots = _verify_at_once(logits, drafts, num_drafts, params, generator, q, starts,
                                                       draft_slots)
    else:
        accepted, token = _verify_rounds(logits, drafts, num_drafts, params, generator, q, starts)
        draft_slots, = indices_to_device(device, draft_slots)
    tokens.view(-1).index_put_((draft_slots,), drafts)
    tokens.scatter_(1, accepted.view(-1, 1), token.view(-1, 1))
    return tokens, accepted


def _verify_at_once(logits, drafts, num_drafts, params, generator, q, starts, draft_slots: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_sampled_many` on a GPU: every row's distribution and every draft's check at once, so the launches
    do not depend on what passes (no host sync). Returns (accepted [spans], sampled token [spans], draft_slots on
    the device: uploaded with this function's own indices, in one copy)."""
    device = logits.device
    spans, widest = len(num_drafts), max(num_drafts, default=0)
    probs = sampling_distribution(logits.float(), [p for p, k in zip(params, num_drafts) for _ in range(k + 1)])
    draft_rows = [starts[s] + i for s in range(spans) for i in range(num_drafts[s])]
    index, slots, first_draft, ks, draft_slots = indices_to_device(
        device, [*draft_rows, *(starts[s] + num_drafts[s] for s in range(spans))],
        [s * widest + i for s in range(spans) for i in range(num_drafts[s])], [starts[s] - s for s in range(spans)],
        list(num_drafts), draft_slots)
    checked, last = probs.index_select(0, index[:len(draft_rows)]), probs.index_select(0, index[len(draft_rows):])
    passed, residual = _check(checked, drafts, q, generator)
    # per span: [spans, widest] passes (False past k_s), the count before the first failure
    grid = torch.zeros(spans * widest, dtype=torch.bool, device=device).index_put_((slots,), passed)
    accepted = torch.cumprod(grid.view(spans, widest).to(torch.int64), 1).sum(1)
    # the row each span samples from: its residual at the first failure, else its last row
    complete = accepted == ks
    fallback = torch.cat([residual, last]).index_select(
        0, torch.where(complete, len(draft_rows) + torch.arange(spans, device=device),
                       first_draft + accepted.clamp_max(max(widest - 1, 0))))
    return accepted, exponential_race(fallback, generator), draft_slots


def _verify_rounds(logits, drafts, num_drafts, params, generator, q, starts) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_sampled_many` on the CPU: draft position by position, only the spans still passing, so a row
    after a span's first rejection is never filtered (a top-p row's sort is the cost there; the host reads each
    round's passes). Returns (accepted [spans], sampled token [spans])."""
    spans = len(num_drafts)
    accepted, token = [0] * spans, [0] * spans
    first_draft = [starts[s] - s for s in range(spans)]
    active = list(range(spans))
    for i in range(max(num_drafts, default=0) + 1):
        if not active:
            break
        probs = sampling_distribution(logits[[starts[s] + i for s in active]].float(), [params[s] for s in active])
        checking = [j for j, s in enumerate(active) if i < num_drafts[s]]
        fallback = probs  # a span done at this row samples from its residual, or its last row
        passed = []
        if checking:
            at = [first_draft[active[j]] + i for j in checking]
            ok, residual = _check(probs[checking], drafts[at], None if q is None else q[at], generator)
            fallback[checking] = residual
            passed = ok.tolist()
        going = {active[j] for j, ok in zip(checking, passed) if ok}
        done = [j for j, s in enumerate(active) if s not in going]
        for j, t in zip(done, exponential_race(fallback[done], generator).tolist()):
            accepted[active[j]], token[active[j]] = i, t
        active = [s for s in active if s in going]
    accepted, token = indices_to_device(logits.device, accepted, token)
    return accepted, token


def _draft_q(drafts, num_drafts, draft_probs, vocab: int, device) -> torch.Tensor | None:
    """q of every draft row, [sum(k_s), vocab] fp32 (a span without draft_probs: point masses), or None when
    every span's drafts are point masses (n-gram drafts: q is never materialized)."""
    if all(x is None for x in draft_probs):
        return None
    q = torch.zeros(int(sum(num_drafts)), vocab, dtype=torch.float32, device=device)
    at = 0
    for k, probs_s in zip(num_drafts, draft_probs):
        if k:
            q[at:at + k] = torch.stack([_fit(x, vocab, device) for x in probs_s[:k]]) if probs_s is not None \
                else torch.nn.functional.one_hot(drafts[at:at + k], vocab).to(q.dtype)
        at += k
    return q


def _check(p: torch.Tensor, d: torch.Tensor, q: torch.Tensor | None, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft checks of rows p [n, vocab] (the target's distributions) for drafts d [n] drawn from q [n, vocab]
    (None: point masses): (passed [n] bool, residual [n, vocab], max(p - q, 0), unnormalized). One uniform a
    row; a row whose residual is empty (p <= q everywhere, up to rounding) passes. With point masses p is
    overwritten (it becomes the residual)."""
    rows = torch.arange(p.shape[0], device=p.device)
    p_d = p[rows, d]
    if q is None:
        q_d = torch.ones_like(p_d)
        residual = p.index_put_((rows, d), torch.zeros_like(p_d))  # p without d_i
    else:
        q_d = q[rows, d]
        residual = torch.clamp(p - q, min=0.0)
    u = torch.rand(p.shape[0], generator=generator, device=p.device)
    return ((q_d > 0) & (u * q_d < p_d)) | (residual.sum(-1) <= 0), residual


def exponential_race(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One id drawn from each row of rows [n, vocab] (unnormalized, non-negative, not all zero), [n] int64: the
    exponential race argmax(r / E), E ~ Exp(1) per id, picks id i with probability r_i / sum(r), with no host
    check of the distribution (torch.multinomial's), so it never syncs with the device."""
    return (rows / torch.empty_like(rows).exponential_(generator=generator)).argmax(-1)


def accept_sampled(logits: torch.Tensor, drafts: list[int], params, generator: torch.Generator | None,
                   draft_probs: Sequence[torch.Tensor] | None = None) -> list[int]:
    """Tokens a sampled verify emits (`verify_sampled`, then the one host copy). generator: on logits' device,
    or None for torch's default generator of that device (`torch.manual_seed` seeds it)."""
    if generator is None:
        device = logits.device
        generator = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" \
            else torch.default_generator
    d = torch.tensor(drafts, dtype=torch.int64, device=logits.device)
    tokens, accepted = verify_sampled(logits, d, params, generator, draft_probs)
    return tokens[:int(accepted) + 1].tolist()


def _leading_true(flags: torch.Tensor) -> torch.Tensor:
    """How many of flags [k] bool are True before the first False ([] int64, on flags' device)."""
    return torch.cumprod(flags.to(torch.int64), 0).sum()


def _fit(q: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """q over the target's `vocab` ids (a draft's padded vocabulary may be wider or narrower), fp32 on `device`
    (a draft model on the same GPU keeps q there: no copy)."""
    q = q.to(device=device, dtype=torch.float32)
    if q.shape[0] >= vocab:
        return q[:vocab]
    return torch.cat([q, q.new_zeros(vocab - q.shape[0])])
