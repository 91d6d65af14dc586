"""System and developer messages reaching the chat template: OpenAI's `developer` role is the system role (for
every model but o1) in Chat Completions' messages, Responses' input items and /tokenize's messages; Responses joins
`instructions` and the system/developer items that lead its input into one system message, for templates that take
a single leading one; a template's error blames the request's field (`input` in Responses). Golden prompt text."""

from __future__ import annotations

import orjson
import pytest

from tests.api.conftest import MODEL, chat_body
from tests.api.fake_engine import ScriptedEngine
from voltserve.chat_template import ChatTemplate

INVALID = "invalid_request_error"
GENERATION = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
# Qwen3's checks, in ChatML: one system message, first; no role but system, user, assistant and tool
ROLE_CHECKING = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('Unexpected message role.') }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture
def smollm2_engine(smollm2):
    """A ScriptedEngine with the default model's tokenizer and chat template (which adds its own system prompt
    when the first message is not a system one)."""
    tok = smollm2.tokenizer
    engine = ScriptedEngine(scripts=["ok"], tokenizer=tok)
    engine.chat_template = ChatTemplate(smollm2.chat_template, tok.bos_token, tok.eos_token)
    return engine


def role_checking_engine() -> ScriptedEngine:
    engine = ScriptedEngine(scripts=["ok"], max_model_len=1024)
    engine.chat_template = ChatTemplate(ROLE_CHECKING)
    return engine


async def _prompts(serve, engine, requests: list[tuple[str, dict]]) -> list[str]:
    """The prompt text each request ran (or /tokenize counted), each answered 200."""
    texts = []
    async with serve(engine) as (client, _):
        for path, json in requests:
            response = await client.post(path, json=json)
            assert response.status_code == 200, await response.get_data()
            ids = (orjson.loads(await response.get_data())["tokens"] if path == "/tokenize"
                   else engine.requests[-1][0])
            texts.append(engine.tokenizer.decode(ids, skip_special_tokens=False))
    return texts


async def test_developer_is_system_with_the_default_models_template(serve, smollm2_engine):
    """SmolLM2's template no longer renders `<|im_start|>developer` after its default system prompt."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    texts = await _prompts(serve, smollm2_engine, [
        ("/v1/chat/completions", chat_body(messages=messages)),
        ("/tokenize", {"model": MODEL, "messages": messages}),
        ("/v1/responses", {"model": MODEL, "input": messages}),
        ("/v1/responses", {"model": MODEL, "instructions": "Be brief.", "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "No emoji."}]},
            {"role": "user", "content": "Hi"}]}),
    ])
    one = "<|im_start|>system\nBe brief.<|im_end|>\n" + GENERATION
    assert texts == [one, one, one, "<|im_start|>system\nBe brief.\n\nNo emoji.<|im_end|>\n" + GENERATION]


async def test_templates_that_check_roles_take_developer_and_joined_system_messages(serve):
    texts = await _prompts(serve, role_checking_engine(), [
        ("/v1/chat/completions", chat_body(messages=[{"role": "developer", "content": "A."},
                                                     {"role": "user", "content": "Hi"}])),
        ("/tokenize", {"messages": [{"role": "developer", "content": "A."}, {"role": "user", "content": "Hi"}]}),
        ("/v1/responses", {"model": MODEL, "instructions": "A.", "input": [
            {"role": "system", "content": "B."}, {"role": "developer", "content": "C."},
            {"role": "user", "content": "Hi"}]}),
        ("/v1/responses", {"model": MODEL, "input": [{"role": "developer", "content": "A."}, {"role": "user",
                                                                                              "content": "Hi"}]}),
    ])
    one = "<|im_start|>system\nA.<|im_end|>\n" + GENERATION
    assert texts == [one, one, "<|im_start|>system\nA.\n\nB.\n\nC.<|im_end|>\n" + GENERATION, one]


@pytest.mark.parametrize("path, json, param", [
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": "Hi"},
                                                 {"role": "developer", "content": "Late."}]}, "input"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "Hi"},
                                                 {"role": "developer", "content": "Late."}]), "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late."}]},
     "messages"),
])
async def test_a_template_error_blames_the_requests_own_field(serve, path, json, param):
    """A system message after the conversation began stays one of its own, which this template refuses: the 400
    names `input` in Responses (it has no `messages`), `messages` in Chat and /tokenize."""
    async with serve(role_checking_engine()) as (client, engine):
        response = await client.post(path, json=json)
        assert (response.status_code, orjson.loads(await response.get_data())) == (400, {"error": {
            "message": "System message must be at the beginning.", "type": INVALID, "param": param, "code": None}})
        assert engine.requests == []
