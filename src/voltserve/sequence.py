"""Per-sequence state the scheduler tracks: tokens, KV blocks, progress, finish."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from voltserve.kv_cache import chain_hashes
from voltserve.request import FinishReason, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generated sequence (a request with n > 1 owns n of them).

    Attributes:
        seq_id: engine-unique id.
        request_id / index: the owning request and this sequence's choice index.
        prompt_ids: prompt token ids.
        output_ids: generated token ids so far.
        params: the request's sampling parameters.
        generator: torch.Generator seeded from params.seed (+ index), or None to use the engine's.
        philox_seed / philox_offset: the device sampler's Philox4x32-10 key and counter: the seed is
            params.seed (+ index) or a random draw when the request has no seed; the offset advances by one per
            sampled token (ModelRunner.execute) and by k + 1 per verify of k drafts (its rows' counters), so a
            seeded request (never drafted) samples the same tokens run to run.
        block_ids: KV blocks holding this sequence's tokens, in order.
        block_hashes: the prefix-cache hash chain of the sequence's leading full blocks, as far as it was asked
            for (`voltserve.kv_cache.chain_hashes`): each block hashed once; kept when its blocks are freed (a
            preemption: its tokens stay), cut where its tokens change (`truncate_output`).
        prompt_hashes: the hash chain of the prompt's leading full blocks, one list shared by the sequences of a
            request with n > 1 (`block_hash_chain` copies from it), so that each prompt block is hashed once for
            all n; None: not shared (n = 1, a draft model's shadow).
        num_computed_tokens: tokens whose K/V are in the cache.
        num_cached_tokens: prompt tokens that came from the prefix cache at the admission that computed its
            first token; an admission after a preemption keeps it (every delta reports one figure).
        grammar: its `voltserve.grammar.GrammarState` when params.grammar is set: the tokens allowed next.
        error: None, or why the sequence failed rather than finished (its grammar's error at decode time): it
            ends with finish_reason ABORT and its request fails with that error.
        draft_misses / drafts_resume_at: speculative decoding's backoff (`voltserve.spec.backoff`): verifies in a
            row that accepted no draft, and the output length from which it drafts again.
    """

    seq_id: int
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator | None = None
    philox_seed: int = 0
    philox_offset: int = 0
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    prompt_hashes: list[int] | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    grammar: Any = None
    error: str | None = None
    draft_misses: int = 0
    drafts_resume_at: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens_in(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output (a copy)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    def block_hash_chain(self, num_blocks: int, block_size: int) -> list[int]:
        """`block_hashes` extended to at least `num_blocks` full blocks of `block_size` tokens and returned
        (`voltserve.kv_cache.chain_hashes`): those of prompt blocks taken from `prompt_hashes` when it is shared
        (hashed there by whichever sibling asks first), the rest hashed from this sequence's tokens."""
        hashes = self.block_hashes
        if self.prompt_hashes is not None:
            prompt_blocks = min(num_blocks, len(self.prompt_ids) // block_size)
            if len(hashes) < prompt_blocks:
                hashes += chain_hashes(self.prompt_hashes, self.tokens_in, prompt_blocks, block_size)[
                    len(hashes):prompt_blocks]
        return chain_hashes(hashes, self.tokens_in, num_blocks, block_size)

    def truncate_output(self, num_output: int, block_size: int) -> None:
        """Keep the first `num_output` output tokens (a stop string cut a verify's tokens), and the block hashes
        of the full blocks left: no cached hash may outlive a change of its block's tokens."""
        del self.output_ids[num_output:]
        del self.block_hashes[self.num_tokens // block_size:]

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
