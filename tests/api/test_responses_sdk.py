"""POST /v1/responses on the default model behind a real hypercorn (`server_url`), driven by the `openai` SDK's
`responses.create` (slow): a greedy answer, a stream whose events come in the documented order, and function
tools with an earlier call and its output as input items."""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import REAL_MODEL

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0, timeout=30)


def test_responses_greedy_mentions_paris(client):
    response = client.responses.create(model=REAL_MODEL, input=QUESTION, temperature=0, max_output_tokens=20)
    assert "Paris" in response.output_text
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_responses_stream_events_in_order(client):
    events = list(client.responses.create(model=REAL_MODEL, input=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_output_tokens=20, stream=True))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1].response
    assert "".join(deltas) == completed.output_text == events[-4].text
    assert "Paris" in completed.output_text and completed.usage.input_tokens > 0


def test_responses_with_function_tools_and_call_items(client):
    """Function tools, and an earlier call with its output as input items, as the SDK sends them: accepted, and
    the tools echoed as the SDK's FunctionTool."""
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                           "additionalProperties": False}}
    response = client.responses.create(model=REAL_MODEL, temperature=0, max_output_tokens=10, tools=[tool], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"}])
    assert response.status in ("completed", "incomplete") and response.output
    assert [(t.type, t.name) for t in response.tools] == [("function", "get_weather")]
