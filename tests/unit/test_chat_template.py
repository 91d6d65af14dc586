"""ChatTemplate: the SmolLM2 template renders to the golden prompt ids and byte-identically to transformers."""

from __future__ import annotations

import json
import pathlib

import pytest

from voltserve.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from voltserve.errors import ConfigError, InvalidRequestError

DATA_DIR = pathlib.Path(__file__).parents[1] / "data"

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Count to 3"},
        {"role": "assistant", "content": "1, 2, 3"},
        {"role": "user", "content": "Now in français, with émojis 🎉"},
    ],
]


@pytest.fixture(scope="module")
def smollm2_template(smollm2):
    tok = smollm2.tokenizer
    return ChatTemplate(smollm2.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)


def test_golden_prompt_ids(smollm2_template, smollm2_tokenizer):
    golden = json.loads((DATA_DIR / "smollm2-golden.json").read_text())
    text = smollm2_template.render(golden["chat_messages"], add_generation_prompt=golden["add_generation_prompt"])
    assert smollm2_tokenizer.encode(text) == golden["prompt_token_ids"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(smollm2_template, hf_smollm2_tokenizer, messages, add_generation_prompt):
    expected = hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert smollm2_template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_default_is_chatml():
    text = ChatTemplate(None).render([{"role": "user", "content": "hi"}])
    assert ChatTemplate("").source == DEFAULT_CHAT_TEMPLATE
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_helpers_tools_and_kwargs():
    source = (
        "{% if tools %}{{ tools | tojson }}|{% endif %}{{ bos_token }}{{ messages[0]['content'] }}"
        "{% if enable_thinking is defined and not enable_thinking %}|no-think{% endif %}{{ eos_token }}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    tools = [{"name": "f", "description": "café <b>"}]
    out = template.render([{"role": "user", "content": "x"}], tools=tools, enable_thinking=False)
    assert out == '[{"name": "f", "description": "café <b>"}]|<s>x|no-think</s>'
    assert len(ChatTemplate("{{ strftime_now('%Y') }}").render([])) == 4


def test_raise_exception_becomes_invalid_request():
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(InvalidRequestError, match="Conversation roles must alternate") as info:
        template.render([{"role": "user", "content": "x"}])
    assert info.value.param == "messages"


def test_template_errors():
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(InvalidRequestError):  # the sandbox forbids mutating the arguments
        ChatTemplate("{{ messages.append(1) }}").render([])
