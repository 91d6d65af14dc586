"""Logprobs in POST /v1/responses (`include: ["message.output_text.logprobs"]`, `top_logprobs`) over the
ScriptedEngine: the output_text part's entries (token, logprob, bytes, top_logprobs; exact JSON), the delta and done
events' (token, logprob, top_logprobs; no bytes, as the `openai` SDK's `ResponseTextDeltaEvent.Logprob`), streamed
as not; with the tool-call and reasoning parsers, a message gets only its own text's entries.

ScriptedEngine's logprobs: the token at output position p has -0.25 * (p % 4), its top k alternatives the ids
after it, each 1 lower; none for EOS."""

from __future__ import annotations

import functools

import orjson
import pytest

from api.openai.response_events import PendingLogprobs
from tests.api.fake_engine import MarkerTokenizer, ScriptedEngine, StreamedEngine, ThinkingTemplate
from tests.api.test_responses import (
    INVALID, URL, body, event, events_of, opening_events, post, response_object, sdk_checked, usage,
)
from tests.api.test_responses_tools import PARIS, PARIS_ARGS, WEATHER, both, function_call, names, with_tools
from voltserve.request import TokenLogprob

LOGPROBS = ["message.output_text.logprobs"]


def entry(token: str, raw: bytes, logprob: float, top: list[tuple[str, bytes, float]] = ()) -> dict:
    """An output_text logprob entry."""
    return {"token": token, "logprob": logprob, "bytes": list(raw),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, b, v in top]}


def event_entry(e: dict) -> dict:
    """The delta / done event form of an output_text entry: no bytes."""
    return {"token": e["token"], "logprob": e["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}


# "Hé" with top_logprobs 1: "H", then the two byte tokens of "é" (U+FFFD as a token's text, as in Chat); -0.0 is
# the double's -0.25 * 0, as the bytes show it
H_E = [entry("H", b"H", -0.0, [("H", b"H", -0.0)]),
       entry("\ufffd", b"\xc3", -0.25, [("\ufffd", b"\xc3", -0.25)]),
       entry("\ufffd", b"\xa9", -0.5, [("\ufffd", b"\xa9", -0.5)])]


def message_with(text: str, status: str, logprobs: list[dict] | None, item_id: str = "msg_0") -> dict:
    content = [] if logprobs is None else [{"type": "output_text", "text": text, "annotations": [],
                                            "logprobs": logprobs}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


async def test_non_stream_exact_json(serve):
    status, data, engine = await post(serve, ScriptedEngine(scripts=["Hé"]),
                                      body(include=LOGPROBS, top_logprobs=1))
    assert status == 200
    assert engine.requests[0][1].logprobs == 1
    assert data == orjson.dumps(response_object("completed", [message_with("Hé", "completed", H_E)], usage(21, 4),
                                                top_logprobs=1))


async def test_stream_exact_bytes(serve):
    status, data, _ = await post(serve, ScriptedEngine(scripts=["Hé"]),
                                 body(include=LOGPROBS, top_logprobs=1, stream=True))
    assert status == 200
    head = {"item_id": "msg_0", "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": "Hé", "annotations": [], "logprobs": H_E}
    payloads = [
        ("response.output_item.added", {"output_index": 0, "item": message_with("", "in_progress", None)}),
        ("response.content_part.added", {**head, "part": {**part, "text": "", "logprobs": []}}),
        # "é" is two byte tokens: the first delta has no text, its entry goes with the second's
        ("response.output_text.delta", {**head, "delta": "H", "logprobs": [event_entry(H_E[0])]}),
        ("response.output_text.delta", {**head, "delta": "é", "logprobs": [event_entry(e) for e in H_E[1:]]}),
        ("response.output_text.done", {**head, "text": "Hé", "logprobs": [event_entry(e) for e in H_E]}),
        ("response.content_part.done", {**head, "part": part}),
        ("response.output_item.done", {"output_index": 0, "item": message_with("Hé", "completed", H_E)}),
    ]
    done = response_object("completed", [message_with("Hé", "completed", H_E)], usage(21, 4), top_logprobs=1)
    expected = b"".join([
        *opening_events(response_object("in_progress", [], None, top_logprobs=1)),
        *(event(name, {"type": name, "sequence_number": k, **payload})
          for k, (name, payload) in enumerate(payloads, 2)),
        event("response.completed", {"type": "response.completed", "sequence_number": 9, "response": done}),
    ])
    assert data == expected
    sdk_checked(data)


@pytest.mark.parametrize("extra", [{}, {"top_logprobs": 3}, {"include": ["reasoning.encrypted_content"]}])
async def test_no_logprobs_without_the_include(serve, extra):
    """As OpenAI's: `top_logprobs` alone returns none (`logprobs` stays []); other `include` values are ignored."""
    status, data, engine = await post(serve, ScriptedEngine(scripts=["ok"]), body(**extra))
    assert status == 200 and engine.requests[0][1].logprobs is None
    assert orjson.loads(data)["output"][0]["content"][0]["logprobs"] == []


async def test_include_without_top_logprobs_lists_no_alternatives(serve):
    _, data, _ = await post(serve, ScriptedEngine(scripts=["ab"]), body(include=LOGPROBS))
    assert orjson.loads(data)["output"][0]["content"][0]["logprobs"] == [entry("a", b"a", 0.0),
                                                                         entry("b", b"b", -0.25)]


@pytest.mark.parametrize("top", [-1, 21])
async def test_top_logprobs_out_of_range_is_a_400(serve, top):
    status, data, engine = await post(serve, ScriptedEngine(), body(include=LOGPROBS, top_logprobs=top))
    assert (status, orjson.loads(data)) == (400, {"error": {"message": "top_logprobs must be between 0 and 20",
                                                            "type": INVALID, "param": "top_logprobs", "code": None}})
    assert engine.requests == []


def scripted(text: str, first: int, top: int = 0) -> list[dict]:
    """The entries of the one-byte tokens of `text` at output positions from `first` (ScriptedEngine's values)."""
    out = []
    for p, ch in enumerate(text, first):
        value = -0.25 * (p % 4)
        alternatives = [(chr(ord(ch) + k), chr(ord(ch) + k).encode(), value - k) for k in range(top)]
        out.append(entry(ch, ch.encode(), value, alternatives))
    return out


async def test_tool_calls_split_the_entries_between_the_messages(serve):
    """Text, a call, text: each message has its own text's entries; the line break the call drops and the call's
    markup have none. Streamed alike (`both`: the final streamed response equals the whole one)."""
    script = "Ok\n" + PARIS + "Bye"
    whole, events, _ = await both(serve, script, include=LOGPROBS, top_logprobs=1)
    after = len("Ok\n" + PARIS)
    assert whole == with_tools(response_object("completed", [
        message_with("Ok", "completed", scripted("Ok", 0, 1)), function_call(0, PARIS_ARGS),
        message_with("Bye", "completed", scripted("Bye", after, 1), "msg_0_1")], usage(21, len(script) + 1),
        top_logprobs=1))
    deltas = [(e["delta"], e["logprobs"]) for name, e in events if name == "response.output_text.delta"]
    entries = scripted("Ok", 0, 1) + scripted("Bye", after, 1)
    assert deltas == [(ch, [event_entry(e)]) for ch, e in zip("OkBye", entries)]


async def test_forced_call_has_no_message_and_no_logprobs(serve):
    whole, events, _ = await both(serve, PARIS, tool_choice="required", include=LOGPROBS)
    assert [item["type"] for item in whole["output"]] == ["function_call"]
    assert "response.output_text.delta" not in names(events)


async def test_reasoning_tokens_have_no_entries_in_the_message(serve):
    """ThinkingTemplate opens the reasoning; `</think>` is one token (MarkerTokenizer): the reasoning's tokens
    (`Hm` and `</think>`) have no entries in the message, whose text and entries begin after them."""
    engine = ScriptedEngine(scripts=["Hm</think>Hi"], tokenizer=MarkerTokenizer())
    engine.chat_template = ThinkingTemplate()
    async with serve(engine, tool_call_parser="hermes") as (client, _):
        json = body(include=LOGPROBS, tools=[WEATHER])
        whole = orjson.loads(await (await client.post(URL, json=json)).get_data())
        data = await (await client.post(URL, json={**json, "stream": True})).get_data()
    events, _ = sdk_checked(data)
    assert events[-1][1]["response"] == whole
    (message,) = [item for item in whole["output"] if item["type"] == "message"]
    assert message["content"][0]["text"] == "Hi"
    assert message["content"][0]["logprobs"] == scripted("Hi", 3)
    assert [e["logprobs"] for name, e in events_of(data) if name == "response.output_text.done"] == \
        [[event_entry(e) for e in scripted("Hi", 3)]]


async def test_text_the_parser_held_back_keeps_its_entries_once(serve):
    """`<` may begin a call: the parser holds it (the stream sends nothing for it), then releases it with `b`; its
    entry goes out once, with that delta."""
    whole, events, _ = await both(serve, "a<b", include=LOGPROBS)
    assert whole["output"][0]["content"][0]["logprobs"] == scripted("a<b", 0)
    deltas = [(e["delta"], [lp["token"] for lp in e["logprobs"]]) for name, e in events
              if name == "response.output_text.delta"]
    assert deltas == [("a", ["a"]), ("<b", ["<", "b"])]


@pytest.mark.parametrize("interval", [1, 4])
@pytest.mark.parametrize("script, messages", [
    ("Ok\n" + PARIS + "Bye", [("Ok", 0), ("Bye", len("Ok\n" + PARIS))]),
    (PARIS + "Done.", [("Done.", len(PARIS))]),
])
async def test_deltas_of_several_tokens_give_each_message_its_own_entries(serve, interval, script, messages):
    """A stream interval merges the engine's deltas (so does a consumer that fell behind, or a verify step): a delta
    holding a message's last text and a call's first markup, or a call's last markup and the next message's text,
    is read token by token, so each message still gets exactly its own text's entries (they once got the markup's
    or lost theirs with the call's); the merged text still goes out as one delta event."""
    whole, events, _ = await both(serve, script, functools.partial(StreamedEngine, interval=interval),
                                  include=LOGPROBS)
    got = [(item["content"][0]["text"], item["content"][0]["logprobs"]) for item in whole["output"]
           if item["type"] == "message"]
    assert got == [(text, scripted(text, first)) for text, first in messages]
    deltas = [(e["delta"], "".join(lp["token"] for lp in e["logprobs"])) for name, e in events
              if name == "response.output_text.delta"]
    assert all(delta == tokens for delta, tokens in deltas)
    assert (len(deltas) < sum(len(text) for text, _ in messages)) == (interval > 1)  # one event a merged delta


def test_by_token_cuts_a_delta_at_its_tokens_or_not_at_all():
    """A split character's text goes with the token that completes it; entries that do not spell the text (here
    text a stop string held back: the token " Thi" had its entry with " ") leave the delta whole."""
    pending = PendingLogprobs(MarkerTokenizer())
    h, c3, a9 = (TokenLogprob(3 + b, -1.0, ()) for b in b"H\xc3\xa9")
    assert pending.by_token("Hé", [h, c3, a9]) == [("H", (h,)), ("", (c3,)), ("é", (a9,))]
    assert pending.by_token("Hi", [h]) == [("Hi", [h])]
    assert pending.by_token("iH", [h, h]) == [("iH", [h, h])]
