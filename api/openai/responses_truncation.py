"""Responses' `truncation: "auto"`: drop input items from the start of the conversation until the prompt fits.

OpenAI (https://platform.openai.com/docs/api-reference/responses/create, `truncation`): with "auto", an input
that exceeds the model's context window is truncated by dropping items from the beginning of the conversation;
with "disabled" (the default) such a request fails with a 400. Here the leading system message (instructions and
the system / developer items before the first other item, `responses.input_messages`) always stays, and the
conversation restarts at a user message, so that no tool output or assistant turn is left without the turn that
led to it. The fewest messages are dropped: a binary search over those restart points (a shorter tail never
renders longer), a render and tokenization per probe, each under the bound "disabled" applies before tokenizing.
"""

from __future__ import annotations

from api.openai.chat_prompt import messages_prompt_ids
from voltserve.errors import ContextLengthError


def _restart_points(messages: list[dict]) -> tuple[int, list[int]]:
    """(the number of leading system messages, the indices of the user messages after them)."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    return head, [i for i in range(head, len(messages)) if messages[i]["role"] == "user"]


async def truncated_prompt_ids(engine, messages: list[dict], tools: list[dict] | None,
                               max_output_tokens: int | None, min_tokens: int = 0) -> list[int]:
    """The prompt ids of `messages` with the fewest leading non-system messages dropped (the tail starting at a
    user message) that leave room for the output (`max_output_tokens`, at least `min_tokens` and one token) in
    the engine's context window (`engine.max_model_len`).

    Each probe keeps `messages_prompt_ids`' bound: a tail whose characters alone prove it too long is never
    tokenized, so a huge input costs no more than under "disabled" (a tokenization per probe of what may fit).

    Returns:
        [num_prompt_tokens] token ids: the whole conversation's where it fits, else the longest tail that fits;
        where none does, the whole conversation's again, which `add_request` refuses as under "disabled".

    Raises:
        ContextLengthError: nothing fits and the whole conversation's characters alone prove it: the bound's
            error, as under "disabled" (`param` "input").
        InvalidRequestError: from rendering (`messages_prompt_ids`).
    """
    limit = engine.max_model_len - max(1, max_output_tokens or 1, min_tokens)
    head, starts = _restart_points(messages)

    async def render(start: int) -> list[int] | None:  # None: the characters alone prove it too long
        try:
            return await messages_prompt_ids(engine, messages[:head] + messages[start:], tools=tools, param="input")
        except ContextLengthError:
            return None

    whole = await render(head)
    if whole is not None and len(whole) <= limit:  # the common case: one render
        return whole
    candidates = [s for s in starts if s > head]
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:  # the earliest restart point whose tail fits
        mid = (lo + hi) // 2
        ids = await render(candidates[mid])
        if ids is not None and len(ids) <= limit:
            best, hi = ids, mid - 1
        else:
            lo = mid + 1
    if best is not None:
        return best
    if whole is not None:
        return whole  # add_request refuses it as under "disabled"
    return await messages_prompt_ids(engine, messages, tools=tools, param="input")  # raises the bound's error
