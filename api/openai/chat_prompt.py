"""Chat messages -> prompt token ids: content checks, the model's chat template, tokenization.

User text is never read as special tokens (case S6): contents that spell a special token are rendered as unique
placeholders, and the rendered prompt is tokenized with special-token parsing on everywhere but those spans.
"""

from __future__ import annotations

import json
import re
import secrets

from api.openai.common import INLINE_PROMPT_CHARS, check_prompt_chars, prompt_work
from api.openai.protocol import ChatCompletionRequest
from voltserve.errors import InvalidRequestError, VoltError

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"


def template_role(role: str) -> str:
    """The role a chat template gets for an API message role: OpenAI's `developer` is the system role (as OpenAI
    treats it for every model but o1), so templates that know only `system` (SmolLM2's adds its default system
    prompt otherwise; Qwen's refuse any other role) render it as one."""
    return "system" if role == "developer" else role


def content_text(content, param: str, text_types: frozenset[str] = frozenset({"text"})) -> str:
    """A message's content (a string or a list of parts) as one string; text parts join with newlines.

    Args:
        content: None, a string, or a list of parts with `type` and `text` (`protocol.ContentPart`).
        param: the request field holding `content` (e.g. "messages.0.content"), for errors.
        text_types: the part types that carry text ("text" in Chat Completions; "input_text" and
            "output_text" in the Responses API).

    Raises:
        InvalidRequestError: a non-text part (this server serves text-only models) or a text part without text.
    """
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in text_types:
            raise InvalidRequestError(
                f"content part type '{part.type}' is not supported: the served model accepts text only",
                param=f"{param}.{j}.type")
        if part.text is None:
            raise InvalidRequestError(f"a content part of type '{part.type}' needs 'text'", param=f"{param}.{j}.text")
        texts.append(part.text)
    return "\n".join(texts)


def strip_billing_header(text: str) -> str:
    """System text without a first line starting with `x-anthropic-billing-header` (case S2: that line changes
    every request and would defeat the prefix cache)."""
    if text.startswith(BILLING_HEADER_PREFIX):
        return text.partition("\n")[2]
    return text


def check_mm_kwargs(req, trusted: bool) -> None:
    """Case S7: non-empty `mm_processor_kwargs` / `media_io_kwargs` (any OpenAI request model) are refused unless
    the server trusts them (`EngineConfig.trust_request_mm_kwargs`; no effect then: the models are text-only).

    Raises:
        InvalidRequestError: such kwargs, untrusted.
    """
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        if getattr(req, name) and not trusted:
            raise InvalidRequestError(f"'{name}' is not accepted unless the server runs with "
                                      "--trust-request-mm-kwargs (the served model accepts text only)", param=name)


def template_messages(req: ChatCompletionRequest, trust_mm_kwargs: bool = False) -> list[dict]:
    """The request's messages as plain dicts for the chat template; a `developer` message is a system one
    (`template_role`).

    Args:
        trust_mm_kwargs: accept (and, the model being text-only, ignore) non-empty `mm_processor_kwargs` /
            `media_io_kwargs` (`EngineConfig.trust_request_mm_kwargs`; case S7).
    Raises:
        InvalidRequestError: empty `messages`, missing user/system content, multimodal parts, or multimodal
            kwargs unless trusted.
    """
    if not req.messages:
        raise InvalidRequestError("'messages' must contain at least one message", param="messages")
    check_mm_kwargs(req, trust_mm_kwargs)
    messages = []
    for i, msg in enumerate(req.messages):
        if msg.content is None and msg.role in ("system", "developer", "user"):
            raise InvalidRequestError(f"a {msg.role} message needs 'content'", param=f"messages.{i}.content")
        text = content_text(msg.content, f"messages.{i}.content")
        role = template_role(msg.role)
        if role == "system":
            text = strip_billing_header(text)
        entry = {"role": role, "content": text}
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


def _render(engine, messages: list[dict], tools: list[dict] | None, template_kwargs: dict, param: str,
            add_generation_prompt: bool = True, continue_final: bool = False) -> str:
    try:
        rendered = engine.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                               **template_kwargs)
    except InvalidRequestError as exc:  # the template's raise_exception() or failure: blame the request's field
        raise InvalidRequestError(exc.message, param=param) from exc
    except VoltError:
        raise
    except Exception as exc:  # a template's own raise_exception(), e.g. "roles must alternate"
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}", param=param) from exc
    return _cut_after_final(rendered, messages[-1]["content"], param) if continue_final else rendered


def _cut_after_final(rendered: str, content: str, param: str) -> str:
    """`rendered` cut right after the last occurrence of the final message's `content`, so that the model continues
    that message (transformers' `continue_final_message`): the template's end-of-turn markup is dropped, and
    whitespace the template trimmed off the content's end stays off.

    Raises:
        InvalidRequestError: the final message has no text to continue, or the template did not write its content
            (stripped) verbatim.
    """
    stripped = (content or "").strip()
    if not stripped:  # rfind("") would match the end: the prompt would close the message instead
        raise InvalidRequestError("continue_final_message: the final message has no text to continue", param=param)
    at = rendered.rfind(stripped)
    if at < 0:
        raise InvalidRequestError("continue_final_message: the chat template does not write the final message's "
                                  "content verbatim", param=param)
    kept = content.lstrip()
    return rendered[:at + (len(kept) if rendered.startswith(kept, at) else len(stripped))]


def _render_and_encode(engine, messages: list[dict], tools: list[dict] | None, template_kwargs: dict,
                       param: str, check_fit: bool = True, add_generation_prompt: bool = True,
                       continue_final: bool = False) -> list[int]:
    tokenizer = engine.tokenizer
    risky = [i for i, m in enumerate(messages) if _has_special_text(tokenizer, m["content"])]
    if not risky:
        rendered = _render(engine, messages, tools, template_kwargs, param, add_generation_prompt, continue_final)
        if check_fit:
            check_prompt_chars(engine, len(rendered), param)
        return encode_rendered(tokenizer, rendered)
    # Render with a unique placeholder in place of each such content, so the template's own markup and the
    # user's text are told apart by position, never by matching text (the user may type the template's markup).
    nonce = secrets.token_hex(8)
    spans = {f"voltserve{nonce}m{i}x": messages[i]["content"] for i in risky}
    masked = [dict(m, content=f"voltserve{nonce}m{i}x") if i in risky else m for i, m in enumerate(messages)]
    rendered = _render(engine, masked, tools, template_kwargs, param, add_generation_prompt, continue_final)
    if any(rendered.count(key) != 1 for key in spans):
        raise InvalidRequestError("a message spells a special token and the chat template does not place its "
                                  "content verbatim; remove the special-token text", param=param)
    if check_fit:
        check_prompt_chars(engine, len(rendered) + sum(len(text) - len(key) for key, text in spans.items()), param)
    return encode_rendered(tokenizer, rendered, spans)


def with_argument_objects(message: dict) -> dict:
    """`message` with its earlier tool calls' `function.arguments` as objects where the API gave JSON text: chat
    templates render them with `tojson` (Llama 3.1, Hermes) or test `is string` (Qwen2.5), as transformers'
    `apply_chat_template` documents them (a dict). Arguments that are not a JSON object, nest too deeply for the
    json module or hold a lone surrogate escape are left as text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
                # kept as text when UTF-8 cannot carry it (a lone surrogate escape): the prompt must encode
                json.dumps(parsed, ensure_ascii=False).encode()
            except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        converted.append(call)
    return {**message, "tool_calls": converted}


async def messages_prompt_ids(engine, messages: list[dict], tools: list[dict] | None = None,
                              template_kwargs: dict | None = None, param: str = "messages",
                              check_fit: bool = True, add_generation_prompt: bool = True,
                              continue_final: bool = False) -> list[int]:
    """Render and tokenize chat messages (off the event loop unless they are short: `prompt_work`); the one
    path from messages to prompt ids of every chat-shaped endpoint (Chat Completions, Responses, /tokenize).

    Args:
        messages: `{"role", "content": str, ...}` dicts as `template_messages` makes them.
        tools: the tool definitions the template renders, if any.
        template_kwargs: extra variables for the chat template (`chat_template_kwargs`).
        param: the request field the messages came from, blamed by errors ("messages", or "input").
        check_fit: refuse a rendered prompt whose characters alone prove it cannot fit the context before it is
            tokenized (`check_prompt_chars`); False where only its count is asked for.
        add_generation_prompt: end with the assistant turn's opening (what every chat endpoint generates after).
        continue_final: end inside the final message instead, right after its content (`_cut_after_final`).

    Returns:
        [num_prompt_tokens] token ids, ending with the assistant generation prompt (by default).

    Raises:
        InvalidRequestError: the template refused the conversation, or a special token's text it would not place
            verbatim (case S6).
        ContextLengthError: with check_fit, a prompt that cannot fit.
    """
    # tools and earlier tool calls are rendered into the prompt too, uncounted here: such requests take the thread
    uncounted = tools or any("tool_calls" in m for m in messages)
    if uncounted:
        messages = [with_argument_objects(m) for m in messages]
    size = sum(len(m["content"]) for m in messages) + (INLINE_PROMPT_CHARS + 1 if uncounted else 0)
    return await prompt_work(size, _render_and_encode, engine, messages, tools, dict(template_kwargs or {}),
                             param, check_fit, add_generation_prompt, continue_final)


# The chat template arguments the server gives itself. vLLM lets `chat_template_kwargs` override them; here they
# are refused: `messages` would skip the special-token masking (case S6), `tools` the tool checks, and every chat
# endpoint answers as the assistant (the reasoning and prefill handling read the prompt's generation prompt).
_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")


def _check_template_kwargs(template_kwargs: dict | None) -> None:
    """Raises InvalidRequestError (param `chat_template_kwargs.<key>`) for a key the server sets itself."""
    for key in _RESERVED_TEMPLATE_KWARGS:
        if key in (template_kwargs or {}):
            raise InvalidRequestError(f"chat_template_kwargs cannot set '{key}': the server sets messages, tools "
                                      "and add_generation_prompt itself", param=f"chat_template_kwargs.{key}")


async def chat_prompt_ids(engine, req: ChatCompletionRequest, trust_mm_kwargs: bool = False,
                          **options: bool) -> list[int]:
    """A chat request's prompt ids (`template_messages`, then `messages_prompt_ids`).

    Args:
        req: a ChatCompletionRequest, or a request with its `messages`, `chat_template_kwargs`, multimodal kwargs
            and `template_tools()` (`api.tokenize.TokenizeRequest`).
        options: `messages_prompt_ids`' check_fit, add_generation_prompt and continue_final.

    Raises:
        InvalidRequestError: a reserved key in `chat_template_kwargs` (`_RESERVED_TEMPLATE_KWARGS`), or see
            `template_messages` and `messages_prompt_ids`.
    """
    _check_template_kwargs(req.chat_template_kwargs)
    return await messages_prompt_ids(engine, template_messages(req, trust_mm_kwargs), req.template_tools(),
                                     req.chat_template_kwargs, **options)
