"""Chat messages -> prompt token ids: content checks, the model's chat template, tokenization.

User text is never read as special tokens (case S6): contents that spell a special token are rendered as unique
placeholders, and the rendered prompt is tokenized with special-token parsing on everywhere but those spans.
"""

from __future__ import annotations

import re
import secrets

from api.openai.common import INLINE_PROMPT_CHARS, prompt_work
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


def _has_special_text(tokenizer, text: str) -> bool:
    """True when `text` would tokenize differently with special-token parsing on (it spells a special token).
    The substring test first (`Tokenizer.may_spell_special`): most messages hold no special token's text, and
    the two encodes cost ~30 us for a short one."""
    may_spell = getattr(tokenizer, "may_spell_special", None)  # test doubles may lack it
    if not text or (may_spell is not None and not may_spell(text)):
        return False
    return tokenizer.encode(text, add_special_tokens=False, parse_special=True) != \
        tokenizer.encode(text, add_special_tokens=False, parse_special=False)


def encode_rendered(tokenizer, rendered: str, spans: dict[str, str] | None = None) -> list[int]:
    """Tokenize a rendered chat prompt, reading special tokens only where the template put them.

    Args:
        tokenizer: voltserve.tokenizer.Tokenizer.
        rendered: the template's output, where each key of `spans` stands once for a message's content.
        spans: placeholder -> the content it stands for; that content is tokenized as plain text (case S6).

    Returns:
        [num_prompt_tokens] token ids.
    """
    if not spans:
        return tokenizer.encode(rendered, add_special_tokens=False, parse_special=True)
    pattern = re.compile("(" + "|".join(re.escape(k) for k in spans) + ")")
    ids: list[int] = []
    for piece in pattern.split(rendered):
        if piece in spans:
            ids += tokenizer.encode(spans[piece], add_special_tokens=False, parse_special=False)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False, parse_special=True)
    return ids


def _render(engine, req: ChatCompletionRequest, messages: list[dict]) -> str:
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        return engine.chat_template.render(messages, add_generation_prompt=True, tools=req.tools, **kwargs)
    except VoltError:
        raise
    except Exception as exc:  # a template's own raise_exception(), e.g. "roles must alternate"
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc


def _render_and_encode(engine, req: ChatCompletionRequest, messages: list[dict]) -> list[int]:
    tokenizer = engine.tokenizer
    risky = [i for i, m in enumerate(messages) if _has_special_text(tokenizer, m["content"])]
    if not risky:
        return encode_rendered(tokenizer, _render(engine, req, messages))
    # Render with a unique placeholder in place of each such content, so the template's own markup and the
    # user's text are told apart by position, never by matching text (the user may type the template's markup).
    nonce = secrets.token_hex(8)
    spans = {f"voltserve{nonce}m{i}x": messages[i]["content"] for i in risky}
    masked = [dict(m, content=f"voltserve{nonce}m{i}x") if i in risky else m for i, m in enumerate(messages)]
    rendered = _render(engine, req, masked)
    if any(rendered.count(key) != 1 for key in spans):
        raise InvalidRequestError("a message spells a special token and the chat template does not place its "
                                  "content verbatim; remove the special-token text", param="messages")
    return encode_rendered(tokenizer, rendered, spans)


async def chat_prompt_ids(engine, req: ChatCompletionRequest) -> list[int]:
    """Render and tokenize the request's messages (off the event loop unless they are short: `prompt_work`).

    Returns:
        [num_prompt_tokens] token ids, ending with the assistant generation prompt.

    Raises:
        InvalidRequestError: see `template_messages`; the template refused the conversation.
    """
    messages = template_messages(req)
    # tools and earlier tool calls are rendered into the prompt too, uncounted here: such requests take the thread
    uncounted = req.tools or any("tool_calls" in m for m in messages)
    size = sum(len(m["content"]) for m in messages) + (INLINE_PROMPT_CHARS + 1 if uncounted else 0)
    return await prompt_work(size, _render_and_encode, engine, req, messages)
