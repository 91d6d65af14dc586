"""Logprobs cover exactly the returned text, on the default model behind the HTTP app (CPU, greedy).

As OpenAI and vLLM return them: no entry for the EOS token that ended the output, none for the tokens from a
matched stop string's start on (the token where it begins is kept when some of its text is in the output), none
for the bytes of a character that max_tokens cut off; streamed chunks carry the same entries as the whole
response, a token's entry travelling with its text (`IncrementalDetokenizer.num_text_tokens`).
"""

from __future__ import annotations

import contextlib

import orjson
import pytest

from actors.engine import AsyncEngine
from api import create_app
from voltserve.config import EngineConfig

MODEL = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# greedy answer (CPU, float32): 7 text tokens, then <|im_end|> (EOS): 8 completion tokens
ANSWER = ["The", " capital", " of", " France", " is", " Paris", "."]


@contextlib.asynccontextmanager
async def _client(loaded):
    engine = AsyncEngine(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=128, max_model_len=1024),
                         loaded=loaded)
    async with create_app(engine).test_app() as test_app:
        yield test_app.test_client()


async def _both(client, path: str, body: dict) -> tuple[dict, list[dict]]:
    """(the whole response, the streamed chunks) of one greedy request."""
    body = {"model": MODEL, "temperature": 0, **body}
    whole = orjson.loads(await (await client.post(path, json=body)).get_data())
    data = await (await client.post(path, json={**body, "stream": True})).get_data()
    events = data.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    return whole, [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]


def _chat_streamed(chunks: list[dict]) -> tuple[str, list[dict]]:
    """(joined content, joined logprob entries) of a one-choice chat stream."""
    choices = [c["choices"][0] for c in chunks]
    return ("".join(c["delta"].get("content") or "" for c in choices),
            [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]])


async def test_chat_logprobs_leave_out_the_eos_token(smollm2):
    async with _client(smollm2) as client:
        whole, chunks = await _both(client, "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 20,
                                                                     "logprobs": True, "top_logprobs": 2})
    (choice,) = whole["choices"]
    entries = choice["logprobs"]["content"]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("The capital of France is Paris.", "stop")
    assert whole["usage"]["completion_tokens"] == len(ANSWER) + 1  # usage still counts the EOS token
    assert [e["token"] for e in entries] == ANSWER
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    content, streamed = _chat_streamed(chunks)
    assert content == choice["message"]["content"]
    assert [e["token"] for e in streamed] == ANSWER
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in entries], abs=1e-4)


@pytest.mark.parametrize("stop, include, content, tokens", [
    (" is Paris", False, "The capital of France", ANSWER[:4]),  # " is" was held back, then cut: no entry
    ("ital of", False, "The cap", ANSWER[:2]),  # " capital" holds the stop string's start: kept
    (" is", True, "The capital of France is", ANSWER[:5]),  # the stop string is in the output: so is " is"
])
async def test_chat_logprobs_end_where_a_stop_string_cuts_the_text(smollm2, stop, include, content, tokens):
    body = {"messages": FRANCE, "max_tokens": 20, "logprobs": True, "stop": [stop],
            "include_stop_str_in_output": include}
    async with _client(smollm2) as client:
        whole, chunks = await _both(client, "/v1/chat/completions", body)
    (choice,) = whole["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) == (content, "stop")
    assert [e["token"] for e in choice["logprobs"]["content"]] == tokens
    assert _chat_streamed(chunks) == (content, choice["logprobs"]["content"])
    # a chunk carries a token's entry only once some of the token's text is out (with it or before)
    text, entries = "", []
    for c in chunks:
        text += c["choices"][0]["delta"].get("content") or ""
        entries += [e["token"] for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
        assert not entries or len("".join(entries[:-1])) < len(text)


@pytest.mark.parametrize("prompt, max_tokens, stop, text, num_entries, num_tokens", [
    ("The capital of France is", 12, ["\n\n"], " Paris.", 2, 4),  # "\n" held back, cut with the next "\n"
    ("Write a smiley emoji:", 9, [], "\n\n```\n👍", 7, 9),  # the 2nd 👍 lacks its 3rd byte token: its 2 cut
])
async def test_completion_logprobs_per_choice_cover_the_text(smollm2, prompt, max_tokens, stop, text, num_entries,
                                                             num_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "stop": stop, "logprobs": 1, "n": 2}
    async with _client(smollm2) as client:
        whole, chunks = await _both(client, "/v1/completions", body)
    assert whole["usage"]["completion_tokens"] == 2 * num_tokens
    for index in (0, 1):
        (choice,) = [c for c in whole["choices"] if c["index"] == index]
        logprobs = choice["logprobs"]
        assert choice["text"] == text and len(logprobs["tokens"]) == num_entries
        if "👍" not in text:  # byte tokens of 👍 show as U+FFFD
            assert "".join(logprobs["tokens"]) == text
        streamed = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in streamed) == text
        joined = {key: [v for c in streamed if c["logprobs"] for v in c["logprobs"][key]]
                  for key in ("tokens", "token_logprobs", "text_offset")}
        assert joined["tokens"] == logprobs["tokens"] and joined["text_offset"] == logprobs["text_offset"]
        assert joined["token_logprobs"] == pytest.approx(logprobs["token_logprobs"], abs=1e-4)


async def test_completion_text_offset_indexes_the_returned_text(smollm2):
    """`text_offset` is where each token starts in `text` (OpenAI's meaning): the special token <|im_start|>,
    which the text leaves out, adds nothing, so text[offset:] starts with each shown token's text; streamed
    chunks carry the same offsets."""
    body = {"prompt": "<|im_start|>user\nhi<|im_end|>\n", "max_tokens": 4, "logprobs": 0}
    async with _client(smollm2) as client:
        whole, chunks = await _both(client, "/v1/completions", body)
    (choice,) = whole["choices"]
    logprobs = choice["logprobs"]
    assert choice["text"] == "assistant\n"
    assert logprobs["tokens"] == ["<|im_start|>", "ass", "istant", "\n"]
    assert logprobs["text_offset"] == [0, 0, 3, 9]
    assert [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
            for o in c["choices"][0]["logprobs"]["text_offset"]] == [0, 0, 3, 9]


@pytest.mark.parametrize("min_tokens, content, finish_reason", [
    (0, "The", "stop"),  # " capital" stops at once
    (2, "The capital of France", "stop"),  # " capital" ends in token 2's text: ignored; " is" stops
    (5, "The capital of France is Paris.", "stop"),  # both end within the first 5 tokens' text: EOS ends it
])
async def test_min_tokens_ignores_stop_strings_until_that_many_tokens(smollm2, min_tokens, content, finish_reason):
    """vLLM's min_tokens rule for stop strings (its test_min_tokens_with_stop): a stop string that ends in the
    text of the first min_tokens tokens is returned as text; streamed as not; logprobs cover the returned text."""
    body = {"messages": FRANCE, "max_tokens": 20, "logprobs": True, "stop": [" capital", " is"],
            "min_tokens": min_tokens}
    async with _client(smollm2) as client:
        whole, chunks = await _both(client, "/v1/chat/completions", body)
    (choice,) = whole["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) == (content, finish_reason)
    assert [e["token"] for e in choice["logprobs"]["content"]] == ANSWER[:len(ANSWER) if "." in content else
                                                                          content.count(" ") + 1]
    streamed, entries = _chat_streamed(chunks)
    assert (streamed, [e["token"] for e in entries]) == (content, [e["token"] for e in choice["logprobs"]["content"]])


async def test_responses_logprobs_are_chats(smollm2):
    """Responses with `include: ["message.output_text.logprobs"]`: the output_text's entries are Chat's for the same
    conversation (no EOS entry), and the streamed delta events carry the same tokens and values."""
    body = {"model": MODEL, "temperature": 0, "input": FRANCE, "max_output_tokens": 20,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    async with _client(smollm2) as client:
        whole = orjson.loads(await (await client.post("/v1/responses", json=body)).get_data())
        data = await (await client.post("/v1/responses", json={**body, "stream": True})).get_data()
        chat, _ = await _both(client, "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 20,
                                                               "logprobs": True, "top_logprobs": 2})
    (message,) = whole["output"]
    (part,) = message["content"]
    assert (whole["status"], part["text"]) == ("completed", "The capital of France is Paris.")
    assert [e["token"] for e in part["logprobs"]] == ANSWER
    assert all(e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 2 for e in part["logprobs"])
    expected = chat["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in part["logprobs"]] == pytest.approx([e["logprob"] for e in expected], abs=1e-4)
    events = [orjson.loads(frame.split(b"\ndata: ", 1)[1]) for frame in data.split(b"\n\n")[:-1]]
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert [e["token"] for e in streamed] == ANSWER
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in expected], abs=1e-4)
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == part["text"]
