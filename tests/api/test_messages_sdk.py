"""POST /v1/messages and /v1/messages/count_tokens on the default model behind a real hypercorn (`server_url`),
driven by the `anthropic` SDK (slow): a greedy answer, a prefill, a stream read through the SDK's own event
accumulator (case A4 for text), and an error the SDK maps to its exception class."""

from __future__ import annotations

import anthropic
import pytest

from tests.api.conftest import REAL_MODEL

pytestmark = pytest.mark.slow
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY_FRANCE = "The capital of France is Paris."  # as the chat tests' greedy answer (same template and prompt)
# anthropic 2.x no longer takes sampling arguments; the server still reads them from the body (default 1.0, as
# Anthropic's)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server_url, api_key="x", max_retries=0, timeout=30)


def test_messages_greedy_answer(client):
    message = client.messages.create(model=REAL_MODEL, max_tokens=32, extra_body=GREEDY, messages=FRANCE)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == GREEDY_FRANCE
    assert (message.role, message.stop_reason, message.stop_sequence) == ("assistant", "end_turn", None)
    counted = client.messages.count_tokens(model=REAL_MODEL, messages=FRANCE)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted.input_tokens > 0
    assert 0 < message.usage.output_tokens <= 32


def test_messages_prefill_and_stop_sequence(client):
    prefill = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    message = client.messages.create(model=REAL_MODEL, max_tokens=32, extra_body=GREEDY, messages=prefill)
    assert message.content[0].text == " Paris."
    stopped = client.messages.create(model=REAL_MODEL, max_tokens=32, extra_body=GREEDY, messages=FRANCE,
                                     stop_sequences=[" Paris"])
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == \
        ("The capital of France is", "stop_sequence", " Paris")


def test_A4_messages_stream_through_the_sdk(client):
    with client.messages.stream(model=REAL_MODEL, max_tokens=32, extra_body=GREEDY, messages=FRANCE) as stream:
        types = []
        text = ""
        for event in stream:
            types.append(event.type)
            if event.type == "text":
                text += event.text
        final = stream.get_final_message()
    raw = [t for t in types if t not in ("text",)]  # the SDK adds a "text" event per text delta
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert text == final.content[0].text == GREEDY_FRANCE
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_messages_errors_map_to_sdk_exceptions(client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=8, messages=FRANCE)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=REAL_MODEL, max_tokens=8, messages=[])
    assert bad.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'messages' must contain at least one message"}}
