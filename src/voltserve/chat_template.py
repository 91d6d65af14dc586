"""Render a model's own Jinja2 chat template, the way HF transformers' `apply_chat_template` does.

Same environment as transformers (utils/chat_template_utils.py): an immutable sandbox with `trim_blocks`,
`lstrip_blocks` and loop controls, the `tojson` filter with `ensure_ascii=False`, and the `raise_exception`
and `strftime_now` helpers, so templates written for HF render byte-identically.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from voltserve.errors import ConfigError, InvalidRequestError

# ChatML, for models that ship no template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str):
    raise InvalidRequestError(str(message), param="messages")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HF's override: jinja2's built-in tojson escapes HTML characters and sorts keys, which changes prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: Jinja2 template text (tokenizer_config.json `chat_template` or GGUF `tokenizer.chat_template`);
            None or "" = ChatML (`DEFAULT_CHAT_TEMPLATE`).
        bos_token / eos_token: the strings templates see as `bos_token` / `eos_token`.

    Raises:
        ConfigError: the template does not compile (a model problem, not a request problem).
    """

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.source = source or DEFAULT_CHAT_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"the chat template does not compile: {exc.message} (line {exc.lineno})") from exc

    def __reduce__(self):  # pickled as its inputs: the compiled template is not picklable
        return type(self), (self.source, self.bos_token, self.eos_token)

    def render(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs,
    ) -> str:
        """Render a conversation to prompt text.

        Args:
            messages: OpenAI-style dicts (`role`, `content`, optionally `tool_calls`, `name`, ...).
            add_generation_prompt: end with the assistant turn's opening (e.g. `<|im_start|>assistant\\n`).
            tools: tool definitions (JSON-schema dicts), passed to the template as `tools`; None = no tools.
            **kwargs: extra template variables (e.g. `enable_thinking=False`, `documents`).

        Returns:
            The prompt text, special tokens as literal strings.

        Raises:
            InvalidRequestError: the template rejects the conversation (its `raise_exception` message) or fails
                on it (undefined value, wrong type).
        """
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        try:
            return self._template.render(
                messages=list(messages), tools=tools, add_generation_prompt=add_generation_prompt, **context
            )
        except InvalidRequestError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InvalidRequestError(f"the chat template failed on these messages: {exc}", param="messages") from exc
