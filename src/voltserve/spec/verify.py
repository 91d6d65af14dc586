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

from collections.abc import Sequence

import torch

from voltserve.sampling import filter_logits


def draftable(seq, output_len: int | None = None) -> bool:
    """Whether `seq`'s next tokens may be drafted: no grammar (its mask follows each token), no logprobs, no
    penalties (each row's distribution would depend on the tokens accepted before it), min_tokens met (no EOS
    masking due), and not seeded sampling: a verify draws a number of random values that depends on how many
    drafts it checks, which depends on the other requests (the ladder, the budget), while a seeded request must
    sample the same tokens whatever runs beside it (case R1). output_len: the output length the step starts from
    (default: the current one)."""
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


def sampling_distribution(logits: torch.Tensor, params) -> torch.Tensor:
    """The distribution a request samples from: softmax of logits rows ([vocab] or [n, vocab] fp32, any device)
    under its temperature, top-k, top-p and min-p; a row those leave nothing finite (extreme parameters) gets its
    argmax for certain, the limit they tend to. No host sync: a draft model's q on the GPU comes from here too."""
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
                   draft_probs: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of one sequence's verify rows, all drafts at once and with no host sync (the verify
    of a step stays on the device until its tokens are copied back together).

    Args:
        logits: [k + 1, vocab] fp32 (or fp16 / bf16), the target's rows, on any device.
        drafts: [k] int64, the proposed ids (k >= 0), on logits' device.
        params: the sequence's SamplingParams (temperature > 0; no penalties, see `draftable`).
        generator: a torch.Generator on logits' device (the sequence's seeded one, or the engine's).
        draft_probs: q, the distribution each draft was sampled from ([vocab'] each, on any device, summing to 1; a
            draft model's, `voltserve.spec.draft_model`, whose vocabulary may be wider or narrower); None: every
            draft proposed for certain (q a point mass).
    Returns:
        (tokens [k + 1] int64, accepted [] int64) on logits' device: the step emits tokens[:accepted + 1], the
        first `accepted` drafts and a token sampled from the first rejecting row's residual (or from the last
        row when every draft passes).

    d_i passes with probability min(1, p(d_i) / q(d_i)) (u q(d_i) < p(d_i), one uniform u per draft, drawn for
    every draft whether or not an earlier one failed); a rejection samples from max(p - q, 0) renormalized (for
    a point mass: p without d_i). A rejection whose residual is empty up to rounding (p <= q everywhere) keeps
    d_i. The sample is drawn by an exponential race (argmax of r / E, E ~ Exp(1) per id), which picks id i with
    probability r_i / sum(r) and, unlike torch.multinomial, never checks the distribution on the host.
    """
    d, k, device = drafts, drafts.shape[0], logits.device
    probs = sampling_distribution(logits.float(), params)  # [k + 1, vocab]
    rows = torch.arange(k, device=device)
    p_d = probs[rows, d]
    residual = probs[:k].clone()
    if draft_probs is None or k == 0:
        q_d = torch.ones_like(p_d)
        residual[rows, d] = 0.0
    else:
        q = torch.stack([_fit(x, probs.shape[-1], device) for x in draft_probs])
        q_d = q[rows, d]
        residual = torch.clamp(residual - q, min=0.0)
    u = torch.rand(k, generator=generator, device=device)
    passed = ((q_d > 0) & (u * q_d < p_d)) | (residual.sum(-1) <= 0)
    accepted = _leading_true(passed)
    fallback = torch.cat([residual, probs[k:]]).index_select(0, accepted.view(1))[0]
    race = torch.empty_like(fallback).exponential_(generator=generator)
    token = (fallback / race).argmax().view(1)
    tokens = torch.cat([d, d.new_zeros(1)]).scatter_(0, accepted.view(1), token)
    return tokens, accepted


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
