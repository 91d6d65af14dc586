"""Token sampling on logits: penalties, temperature, top-k, top-p, min-p, seeded generators, logprobs.

Penalties follow OpenAI (presence/frequency on output tokens) and CTRL (Keskar et al. 2019: repetition penalty on
prompt and output tokens). top-p is nucleus sampling (Holtzman et al. 2019); min-p keeps tokens whose
probability is at least min_p times the top token's (Nguyen et al. 2024).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from voltserve.request import SamplingParams, TokenLogprob
from voltserve.transfer import to_device


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


def generator_on(device: torch.device, host: torch.Generator, cache: dict) -> torch.Generator:
    """A generator on `device` that follows `host` (a torch.Generator on the CPU): `host` itself on the CPU;
    on a GPU one made on first use and seeded from `host`'s stream, kept in `cache` (device -> generator), so
    seeding `host` fixes both."""
    if device.type == "cpu":
        return host
    gen = cache.get(device)
    if gen is None:
        gen = cache[device] = torch.Generator(device=device)
        gen.manual_seed(int(torch.randint(0, 2 ** 62, (), generator=host)))
    return gen


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


def filter_logits(logits: torch.Tensor, p: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, min-p, top-p (in that order) on rows [..., vocab_size] fp32, each row alone; returns
    the filtered logits (dropped tokens -inf).

    Args:
        logits: one row [vocab_size], or rows [n, vocab_size] (a verify's rows, or several requests' at once).
        p: the parameters of every row, or one SamplingParams per row (rows [n, vocab_size] only): the rows are
            filtered together, with one sort of all of them where a row needs top-p (no host sync).
    """
    shape = logits.shape
    rows = logits.reshape(-1, shape[-1])
    params = [p] * rows.shape[0] if isinstance(p, SamplingParams) else list(p)
    if len(params) != rows.shape[0]:
        raise ValueError(f"{len(params)} sampling parameters for {rows.shape[0]} rows")
    return _filter_rows(rows, params).reshape(shape)


def _filter_rows(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """filter_logits of x [n, vocab] with row i under params[i]. The parameters go to the device as columns
    (`_column`); which filters run at all is decided on the host, from the parameters."""
    vocab = x.shape[-1]
    column = functools.partial(_column, device=x.device)
    x = x / column([q.temperature for q in params], torch.float32)
    top_k = [q.top_k if 0 < q.top_k < vocab else 0 for q in params]
    top_p = [q.top_p for q in params]
    min_p = [q.min_p for q in params]
    nucleus = any(t < 1.0 for t in top_p)
    order = None
    if nucleus:  # one sort serves top-k, and top-p after the masks (masked tokens stay at the sorted tail)
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
    if any(top_k):
        k = column(top_k, torch.int64)
        ranked = sorted_x if nucleus else torch.topk(x, max(top_k), dim=-1).values
        kth = ranked.gather(-1, (k - 1).clamp_min(0))
        x = x.masked_fill((x < kth) & (k > 0), float("-inf"))
    if any(m > 0 for m in min_p):
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < column(min_p, torch.float32) * probs.amax(-1, keepdim=True), float("-inf"))
    if nucleus:
        sorted_x = x.gather(-1, order)
        sorted_probs = torch.softmax(sorted_x, -1)
        # drop a token when the mass before it already reaches top_p (the top token always stays); rows with top_p
        # 1 drop nothing (rounding could make the mass before a tail token reach 1)
        p = column(top_p, torch.float32)
        drop = ((sorted_probs.cumsum(-1) - sorted_probs) >= p) & (p < 1.0)
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values as a [len, 1] tensor on `device`, without a host sync. Where all are equal (one request's rows, a
    batch of the same settings) it is filled on the device, a launch instead of a host-to-device copy (~4x less
    host time on a GPU host); a tensor either way, so the arithmetic is the same (a Python number would make
    torch's CUDA division multiply by its reciprocal)."""
    if values and all(v == values[0] for v in values):
        return torch.full((len(values), 1), values[0], dtype=dtype, device=device)
    return to_device(torch.tensor(values, dtype=dtype).view(-1, 1), device)


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
