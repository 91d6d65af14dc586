"""Factory helpers shared by tests (vLLM utils.py style)."""

from __future__ import annotations

import itertools
import subprocess

from voltserve.kv_cache import BlockPool
from voltserve.request import SamplingParams
from voltserve.scheduler import Scheduler
from voltserve.runner import StepHandle
from voltserve.sequence import Sequence

_ids = itertools.count()


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                   eos=(0,), prefix_caching=True, ahead_prefill_tokens=0, ahead_admissible=None,
                   admission_wait_steps=0, drafter=None, ladder=None, **kwargs) -> Scheduler:
    pool = BlockPool(num_blocks, block_size, prefix_caching)
    return Scheduler(pool, max_num_seqs, max_num_batched_tokens, max_model_len, eos, ahead_prefill_tokens,
                     ahead_admissible, admission_wait_steps, drafter, ladder, **kwargs)


def make_seq(prompt, max_tokens=8, request_id=None, **params) -> Sequence:
    seq_id = next(_ids)
    return Sequence(seq_id=seq_id, request_id=request_id or f"r{seq_id}", index=0, prompt_ids=list(prompt),
                    params=SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens)


def run_step(scheduler: Scheduler, next_token=lambda seq: 7):
    """Schedule one step and feed back `next_token(seq)` for each sampling entry. Returns (plan, touched)."""
    plan = scheduler.schedule()
    sampled = {e.seq.seq_id: next_token(e.seq) for e in plan.entries if e.sample}
    return plan, scheduler.update(plan, sampled)


def next_token(input_id: int, position: int) -> int:
    """The fake model's token after `input_id` at `position`."""
    return (input_id * 31 + position) % 97 + 1  # never 0 (EOS) on its own


class FakeAsyncRunner:
    """launch/collect like voltserve.runner.ModelRunner, with a 'model' that makes each token from the input id it
    is given (`next_token`): decode steps (with mixed=True: any step whose every entry samples, as mixed CUDA
    graphs allow) run 'asynchronously' (their ids stay on the fake device until collect, and a fed step reads the
    ids of its first entries from there, never from the sequences); other steps run at once.

    Args:
        eos_at: prompt length -> output index at which such a sequence samples EOS (id 0).
        mixed: steps with prefill entries run asynchronously too.
    """

    def __init__(self, eos_at=None, mixed=False):
        self.eos_at = eos_at or {}  # prompt length -> output index that samples EOS
        self.mixed = mixed
        self.fed = 0
        self.fed_with_prefill = 0  # fed steps that also started a new sequence
        self.fed_after_finish = 0  # fed steps without a sequence of the feeding step that finished

    def _token(self, e, input_id):
        seq = e.seq
        if self.eos_at.get(len(seq.prompt_ids)) == e.start + e.num_new - len(seq.prompt_ids):
            return 0
        return next_token(input_id, e.start + e.num_new - 1)

    def launch(self, plan, feed=None):
        entries = plan.entries
        is_async = all(e.sample for e in entries) and (self.mixed or all(e.num_new == 1 for e in entries))
        if feed is not None:
            rows = {e.seq.seq_id: i for i, e in enumerate(feed.plan.entries)}
            k = 0
            while k < len(entries) and entries[k].seq.seq_id in rows:
                k += 1
            assert is_async and k and all(e.num_new == 1 for e in entries[:k])
            assert not any(e.seq.seq_id in rows for e in entries[k:])
            self.fed += 1
            self.fed_with_prefill += len(entries) > k
            self.fed_after_finish += k < len(rows)
            # the previous step's ids (of the sequences still running), never read from the sequences; the rest
            # from the host
            inputs = [feed.ids_dev[rows[e.seq.seq_id]] for e in entries[:k]] + \
                [e.seq.token_at(e.start + e.num_new - 1) for e in entries[k:]]
        elif is_async:
            inputs = [e.seq.token_at(e.start + e.num_new - 1) for e in entries]
        else:
            sampled = {e.seq.seq_id: self._token(e, e.seq.token_at(e.start + e.num_new - 1))
                       for e in entries if e.sample}
            return StepHandle(plan, result=(sampled, {}))
        return StepHandle(plan, ids_dev=[self._token(e, i) for e, i in zip(entries, inputs)])

    def collect(self, handle):
        if handle.result is not None:
            return handle.result
        return {e.seq.seq_id: t for e, t in zip(handle.plan.entries, handle.ids_dev)}, {}


def stop_process(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM a server started by a test, then SIGKILL it if it has not exited within `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


class OracleDrafter:
    """A speculative decoding drafter (`propose(seq, k)`) that knows each prompt's output: all k drafts right at
    every third position, else the last one wrong (the next id mod `vocab_size`), so verify steps accept
    everything, a part, or (k = 1 wrong) nothing."""

    def __init__(self, prompts, outputs, vocab_size: int):
        self.known = list(zip(prompts, outputs))
        self.vocab_size = vocab_size

    def propose(self, seq, k):
        tokens = seq.token_ids()
        for prompt, out in self.known:
            if tokens[:len(prompt)] == prompt:
                j = len(tokens) - len(prompt)
                drafts = out[j:j + k]
                if j % 3 and drafts:
                    drafts[-1] = (drafts[-1] + 1) % self.vocab_size
                return drafts
        raise AssertionError("unknown sequence")
