"""Speculative decoding: drafters propose tokens, the target model verifies them in one forward.

`ngram.NgramDrafter` proposes (prompt lookup); `ladder.DraftLadder` sets how many drafts a step verifies at each
concurrency; `verify` accepts drafts against the target's logits (greedy: exact; sampled: rejection sampling).
The scheduler (`voltserve.scheduler.Scheduler(drafter=, ladder=)`) asks for drafts, the runner verifies them."""
