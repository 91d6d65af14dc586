"""Chat messages -> prompt token ids: content checks, the model's chat template, tokenization.

User text is never read as special tokens (case S6): the rendered template is tokenized with special-token
parsing on, except the spans that are message content and would tokenize differently with it on.
"""

from __future__ import annotations

import asyncio
import re

from api.openai.protocol import ChatCompletionRequest
from voltserve.errors import InvalidRequestError, VoltError

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"


def _content_text(content, i: int) -> str:
    """A message's content (a string or a list of parts) as one string; text parts join with newlines.

    Raises:
        InvalidRequestError: a non-text part (this server serves text-only models) or a text part without text.
    """
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise InvalidRequestError(
                f"content part type '{part.type}' is not supported: the served model accepts text only",
                param=f"messages.{i}.content.{j}.type")
        if part.text is None:
            raise InvalidRequestError("a text content part needs 'text'", param=f"messages.{i}.content.{j}.text")
        texts.append(part.text)
    return "\n".join(texts)


def _strip_billing_header(text: str) -> str:
    # Case S2: that first line changes every request and would defeat the prefix cache.
    if text.startswith(BILLING_HEADER_PREFIX):
        return text.partition("\n")[2]
    return text


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as plain dicts for the chat template.

    Raises:
        InvalidRequestError: empty `messages`, missing user/system content, multimodal parts or kwargs.
    """
    if not req.messages:
        raise InvalidRequestError("'messages' must contain at least one message", param="messages")
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        if getattr(req, name):
            raise InvalidRequestError(f"'{name}' is not accepted: the served model accepts text only", param=name)
    messages = []
    for i, msg in enumerate(req.messages):
        if msg.content is None and msg.role in ("system", "developer", "user"):
            raise InvalidRequestError(f"a {msg.role} message needs 'content'", param=f"messages.{i}.content")
        text = _content_text(msg.content, i)
        if msg.role == "system":
            text = _strip_billing_header(text)
        entry = {"role": msg.role, "content": text}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(msg, key) is not None:
                entry[key] = getattr(msg, key)
        messages.append(entry)
    return messages


def encode_rendered(tokenizer, rendered: str, contents: list[str]) -> list[int]:
    """Tokenize a rendered chat prompt, reading special tokens only where the template put them.

    Args:
        tokenizer: voltserve.tokenizer.Tokenizer.
        rendered: the template's output.
        contents: the message texts that went into it.

    Returns:
        [num_prompt_tokens] token ids.
    """
    risky = {c for c in contents if c and tokenizer.encode(c, add_special_tokens=False, parse_special=True)
             != tokenizer.encode(c, add_special_tokens=False, parse_special=False)}
    if not risky:
        return tokenizer.encode(rendered, add_special_tokens=False, parse_special=True)
    # Split on the risky contents (longest first): odd pieces are user text, tokenized as plain text.
    pattern = re.compile("(" + "|".join(re.escape(c) for c in sorted(risky, key=len, reverse=True)) + ")")
    ids: list[int] = []
    for k, piece in enumerate(pattern.split(rendered)):
        if piece:
            ids += tokenizer.encode(piece, add_special_tokens=False, parse_special=k % 2 == 0)
    return ids


def _render_and_encode(engine, req: ChatCompletionRequest, messages: list[dict]) -> list[int]:
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        rendered = engine.chat_template.render(messages, add_generation_prompt=True, tools=req.tools, **kwargs)
    except VoltError:
        raise
    except Exception as exc:  # a template's own raise_exception(), e.g. "roles must alternate"
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc
    return encode_rendered(engine.tokenizer, rendered, [m["content"] for m in messages])


async def chat_prompt_ids(engine, req: ChatCompletionRequest) -> list[int]:
    """Render and tokenize the request's messages off the event loop.

    Returns:
        [num_prompt_tokens] token ids, ending with the assistant generation prompt.

    Raises:
        InvalidRequestError: see `template_messages`; the template refused the conversation.
    """
    messages = template_messages(req)
    return await asyncio.to_thread(_render_and_encode, engine, req, messages)
