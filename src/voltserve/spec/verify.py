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
    """The distribution a request samples from: softmax of one row of logits ([vocab] fp32, any device) under
    its temperature, top-k, top-p and min-p; where those leave nothing finite (extreme parameters), the argmax
    for certain, the limit they tend to. No host sync: a draft model's q on the GPU comes from here too."""
    q = torch.softmax(filter_logits(logits, params), -1)
    bad = ~torch.isfinite(q).all() | (q.sum() <= 0)
    return torch.where(bad, torch.nn.functional.one_hot(logits.argmax(), q.shape[0]).to(q.dtype), q)


def accept_sampled(logits: torch.Tensor, drafts: list[int], params, generator: torch.Generator | None,
                   draft_probs: list[torch.Tensor] | None = None) -> list[int]:
    """Tokens a sampled verify emits.

    Args:
        logits: [len(drafts) + 1, vocab] fp32 CPU, the target's rows.
        drafts: the proposed ids.
        params: the sequence's SamplingParams (temperature > 0; no penalties, see `draftable`).
        generator: the sequence's seeded generator, or the engine's.
        draft_probs: q, the distribution each draft was sampled from ([vocab] fp32 each, on any device, summing to 1; a
            draft model's, `voltserve.spec.draft_model`); None: every draft proposed for certain (q a point mass).
            d_i then passes with probability min(1, p(d_i) / q(d_i)) and a rejection samples from
            max(p - q, 0), renormalized.
    """
    out = []
    for i in range(len(drafts) + 1):
        probs = sampling_distribution(logits[i].float(), params)
        if i == len(drafts):
            out.append(int(torch.multinomial(probs, 1, generator=generator)))
            return out
        d = drafts[i]
        q = None if draft_probs is None else _fit(draft_probs[i], probs.shape[0])
        q_d = 1.0 if q is None else float(q[d])
        if q_d > 0 and float(torch.rand((), generator=generator)) * q_d < float(probs[d]):
            out.append(d)  # u < p(d) / q(d)
            continue
        if q is None:
            probs[d] = 0.0
        else:
            probs = torch.clamp(probs - q, min=0.0)
        if float(probs.sum()) <= 0:  # nothing left besides d up to rounding (p <= q everywhere): d
            out.append(d)
            continue
        out.append(int(torch.multinomial(probs, 1, generator=generator)))
        return out
    return out


def _fit(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """q over the target's `vocab` ids (a draft's padded vocabulary may be wider or narrower), fp32 on the CPU (a
    draft model on a GPU keeps q there)."""
    q = q.float().cpu()
    if q.shape[0] >= vocab:
        return q[:vocab]
    return torch.cat([q, q.new_zeros(vocab - q.shape[0])])
