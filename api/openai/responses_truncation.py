"""Responses' `truncation: "auto"`: drop input items from the start of the conversation until the prompt fits.

OpenAI (https://platform.openai.com/docs/api-reference/responses/create, `truncation`): with "auto", an input
that exceeds the model's context window is truncated by dropping items from the beginning of the conversation;
with "disabled" (the default) such a request fails with a 400. Here the leading system message (instructions and
the system / developer items before the first other item, `responses.input_messages`) always stays, and the
conversation restarts at a user message, so that no tool output or assistant turn is left without the turn that
led to it. The fewest messages are dropped: a binary search over those restart points (a shorter tail never
renders longer), a render and tokenization per probe.
"""

from __future__ import annotations

from api.openai.chat_prompt import messages_prompt_ids


def _restart_points(messages: list[dict]) -> tuple[int, list[int]]:
    """(the number of leading system messages, the indices of the user messages after them)."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    return head, [i for i in range(head, len(messages)) if messages[i]["role"] == "user"]


async def truncated_prompt_ids(engine, messages: list[dict], tools: list[dict] | None,
                               max_output_tokens: int | None) -> list[int]:
    """The prompt ids of `messages` with the fewest leading non-system messages dropped (the tail starting at a
    user message) that leave room for `max_output_tokens` (at least one token when None) in the engine's context
    window (`engine.max_model_len`).

    Returns:
        [num_prompt_tokens] token ids: the whole conversation's where it fits; else the longest tail that fits;
        else the tail from the last user message (whose length `add_request` then refuses as "disabled" would).

    Raises:
        InvalidRequestError: from rendering (`messages_prompt_ids`).
    """
    limit = engine.max_model_len - max(1, max_output_tokens or 1)
    head, starts = _restart_points(messages)

    async def render(start: int) -> list[int]:
        return await messages_prompt_ids(engine, messages[:head] + messages[start:], tools=tools, param="input",
                                         check_fit=False)

    whole = await render(head)
    if len(whole) <= limit or not starts or starts == [head]:
        return whole
    candidates = [s for s in starts if s > head]
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:  # the earliest restart point whose tail fits
        mid = (lo + hi) // 2
        ids = await render(candidates[mid])
        if len(ids) <= limit:
            best, hi = ids, mid - 1
        else:
            lo = mid + 1
    return best if best is not None else await render(candidates[-1])
