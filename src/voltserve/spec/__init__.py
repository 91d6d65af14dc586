"""Speculative decoding: drafters propose tokens, the target model verifies them in one forward.

`ngram.NgramDrafter` proposes by prompt lookup; `draft_model.DraftModelDrafter` with a smaller model (its drafts
computed before the step, `Scheduler.draft_work`); `ladder.DraftLadder` sets how many drafts a step verifies at
each concurrency; `backoff` pauses a sequence whose drafts keep failing; `gate.DraftGate` turns drafting off at a
concurrency where plain decoding measures faster; `verify` accepts drafts against the target's logits (greedy:
exact; sampled: rejection sampling). The scheduler (`voltserve.scheduler.Scheduler(drafter=,
ladder=)`) asks for drafts, the runner verifies them."""
