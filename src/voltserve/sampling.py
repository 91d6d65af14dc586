"""Token sampling on logits: penalties, temperature, top-k, top-p, min-p, seeded generators, logprobs.

Penalties follow OpenAI (presence/frequency on output tokens) and CTRL (Keskar et al. 2019: repetition penalty on
prompt and output tokens). top-p is nucleus sampling (Holtzman et al. 2019); min-p keeps tokens whose
probability is at least min_p times the top token's (Nguyen et al. 2024).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from voltserve.request import SamplingParams, TokenLogprob


@dataclass
class SampleRow:
    """What the sampler needs for one row of logits.

    Attributes:
        params: the sequence's sampling parameters.
        generator: its seeded generator, or None for the engine's default generator.
        prompt_ids / output_ids: token history (penalties, min_tokens).
        eos_token_ids: ids masked while fewer than `min_tokens` tokens are out.
        allowed: [vocab_size] bool, the tokens a grammar allows next (`voltserve.grammar.GrammarState`); None =
            all.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_ids: tuple[int, ...]
    allowed: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Penalise one row of logits [vocab_size] fp32 in place; returns it."""
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
        ids, counts = torch.tensor(row.output_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on rows [..., vocab_size] fp32 (each row alone: one row [vocab_size],
    or a verify's rows [n, vocab_size] under one request's parameters); returns filtered logits."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.min_p > 0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < p.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, rows: list[SampleRow],
           default_generator: torch.Generator | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row.

    Args:
        logits: [num_rows, vocab_size] fp32, CPU.
        rows: per-row parameters and history, len num_rows.
        default_generator: used by rows without their own seeded generator.
    Returns:
        (token ids, logprobs) where logprobs[i] is a TokenLogprob when rows[i] asked for logprobs, else None.
        Logprobs are of the model's distribution after penalties, before temperature, filtering and a grammar's
        mask (what vLLM reports by default).
    """
    logits = logits.float()
    tokens: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    need_lp = any(r.params.logprobs is not None for r in rows)
    plain_greedy = all(r.params.is_greedy and not r.params.has_penalties and r.params.min_tokens == 0
                       and r.allowed is None for r in rows)
    if plain_greedy and not need_lp:
        return logits.argmax(-1).tolist(), [None] * len(rows)
    for i, row in enumerate(rows):
        p = row.params
        x = logits[i].clone()
        if p.has_penalties:
            apply_penalties(x, row)
        scores = x  # what logprobs report: the model's distribution after penalties
        if len(row.output_ids) < p.min_tokens:
            banned = list(row.eos_token_ids) + list(p.stop_token_ids)
            if banned:
                x = x.clone() if row.allowed is not None else x
                x[torch.tensor(banned, dtype=torch.long)] = float("-inf")
        if row.allowed is not None:
            masked = x.masked_fill(~row.allowed, float("-inf"))
            # the grammar wins over min_tokens' bans when they leave it no token (e.g. it must end now)
            x = masked if bool(torch.isfinite(masked).any()) else scores.masked_fill(~row.allowed, float("-inf"))
        token = int(x.argmax())
        if not p.is_greedy:
            probs = torch.softmax(filter_logits(x, p), -1)
            # extreme (valid) parameters can overflow to inf/nan: then the argmax above is the limit they tend to
            if bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0:
                gen = row.generator if row.generator is not None else default_generator
                token = int(torch.multinomial(probs, 1, generator=gen))
        tokens.append(token)
        if p.logprobs is None:
            logprobs.append(None)
            continue
        lp = torch.log_softmax(scores, -1)
        top = ()
        if p.logprobs > 0:
            vals, ids = torch.topk(lp, p.logprobs)
            top = tuple(zip(ids.tolist(), vals.tolist()))
        logprobs.append(TokenLogprob(token, float(lp[token]), top))
    return tokens, logprobs
