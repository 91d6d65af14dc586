"""Grammars on the default model behind a real hypercorn (`server_url`), through the `openai` and `anthropic`
SDKs (slow): JSON output and forced tool calls parse, whatever the 135M model would have written freely."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.api.conftest import REAL_MODEL

pytestmark = pytest.mark.slow
WEATHER = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def gpt(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0, timeout=60)


def _valid(value: dict) -> None:
    assert set(value) == {"city", "days"} and 1 <= value["days"] <= 9 and len(value["city"]) <= 20


def test_chat_json_schema_and_forced_call(gpt):
    answer = gpt.chat.completions.create(model=REAL_MODEL, messages=WEATHER, temperature=0, max_tokens=60,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "w", "schema": SCHEMA}})
    _valid(json.loads(answer.choices[0].message.content))
    called = gpt.chat.completions.create(model=REAL_MODEL, messages=WEATHER, temperature=0, max_tokens=80,
                                         tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _valid(json.loads(call.function.arguments))


def test_responses_json_format(gpt):
    response = gpt.responses.create(model=REAL_MODEL, input=WEATHER[0]["content"], temperature=0,
                                    max_output_tokens=60,
                                    text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}})
    _valid(json.loads(response.output_text))


def test_A1_anthropic_forced_tool(server_url):
    """A named tool is one call (the grammar ends after it), so the message stops with tool_use."""
    claude = anthropic.Anthropic(base_url=server_url, api_key="x", max_retries=0, timeout=60)
    message = claude.messages.create(
        model=REAL_MODEL, max_tokens=80, messages=WEATHER, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "input_schema": SCHEMA}], tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    _valid(message.content[0].input)
