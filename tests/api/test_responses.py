"""POST /v1/responses (api/openai/responses.py): exact JSON and SSE bytes (fixed ids and clock), the input items
taking the chat path to prompt ids (cases S2, S6), the table of refused inputs, cases T3 and S1, a client that
leaves, an engine error mid-stream, and the wire shapes the `openai` SDK's typed models accept."""

from __future__ import annotations


import orjson
import pytest
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from tests.api.conftest import MODEL, chat_body, leave_mid_stream, stream_until_engine_dies, wait_for_abort
from tests.api.fake_engine import ByteTokenizer, ScriptedEngine, StreamedEngine
from tests.api.test_metrics import _m, _scrape
from tests.api.fake_engine import hermes_call as call

from api import sse
from api.openai.responses_protocol import LOGPROBS_INCLUDE, Includable, OutputTextDeltaEvent

URL = "/v1/responses"
INVALID = "invalid_request_error"
# the `include` values OpenAI takes, in the `openai` SDK's order, as the 400 for any other lists them
INCLUDE_VALUES = ("'file_search_call.results', 'web_search_call.results', 'web_search_call.action.sources', "
                  "'message.input_image.image_url', 'computer_call_output.output.image_url', "
                  "'code_interpreter_call.outputs', 'reasoning.encrypted_content' or 'message.output_text.logprobs'")
STREAM_OPTIONS_WITHOUT_STREAM = "The 'stream_options' parameter is only allowed when 'stream' is enabled."
PROMPT_HI = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # ChatML of one user message "Hi"


def body(**extra) -> dict:
    """A valid Responses request, with `extra` fields merged in."""
    return {"model": MODEL, "input": "Hi", **extra}


def response_object(status: str, output: list, usage: dict | None, max_output_tokens=None, details=None,
                    top_logprobs: int = 0) -> dict:
    """The response object as the server renders it for `body()` (field order included)."""
    return {"id": "resp_0", "object": "response", "created_at": 1700000000, "status": status, "error": None,
            "incomplete_details": details, "instructions": None, "max_output_tokens": max_output_tokens,
            "model": MODEL, "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "top_logprobs": top_logprobs, "top_p": 1.0, "truncation": "disabled", "usage": usage, "user": None,
            "metadata": {}}


def message(text: str, status: str) -> dict:
    return {"type": "message", "id": "msg_0", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text is not None
            else []}


def usage(input_tokens: int, output_tokens: int, cached: int = 0, reasoning: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input_tokens + output_tokens}


def event(event_type: str, payload: dict) -> bytes:
    return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def events_of(data: bytes) -> list[tuple[str, dict]]:
    """(event name, payload) of each frame of a Responses stream; checks the framing on the way."""
    assert data.endswith(b"\n\n") and b"[DONE]" not in data
    frames = []
    for frame in data.split(b"\n\n")[:-1]:
        name, payload = frame.split(b"\n")
        assert name.startswith(b"event: ") and payload.startswith(b"data: ")
        frames.append((name[7:].decode(), orjson.loads(payload[6:])))
    return frames


async def post(serve, engine, json: dict, **config) -> tuple[int, bytes, ScriptedEngine]:
    async with serve(engine, **config) as (client, engine):
        response = await client.post(URL, json=json)
        return response.status_code, await response.get_data(), engine


async def test_non_stream_exact_json(serve):
    status, data, _ = await post(serve, ScriptedEngine(scripts=["Hé"], cached_tokens=3), body())
    assert status == 200
    prompt_tokens = len(ScriptedEngine().tokenizer.encode(PROMPT_HI))
    expected = response_object("completed", [message("Hé", "completed")], usage(prompt_tokens, 4, cached=3))
    assert data == orjson.dumps(expected)  # field order too
    assert SdkResponse.model_validate(orjson.loads(data)).output_text == "Hé"


def opening_events(started: dict) -> list[bytes]:
    """response.created and response.in_progress, numbered 0 and 1, carrying the response object `started`."""
    return [event(name, {"type": name, "sequence_number": k, "response": started})
            for k, name in enumerate(("response.created", "response.in_progress"))]


def message_events(deltas: list[str], first: int) -> list[bytes]:
    """The events of message item "msg_0" (output 0) whose text comes as `deltas`, numbered from `first`: added,
    its part added, the deltas, the text, its part and the item done (completed)."""
    text = "".join(deltas)
    head = {"item_id": "msg_0", "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    payloads = [
        ("response.output_item.added", {"output_index": 0, "item": message(None, "in_progress")}),
        ("response.content_part.added", {**head, "part": {**part, "text": ""}}),
        *(("response.output_text.delta", {**head, "delta": delta, "logprobs": []}) for delta in deltas),
        ("response.output_text.done", {**head, "text": text, "logprobs": []}),
        ("response.content_part.done", {**head, "part": part}),
        ("response.output_item.done", {"output_index": 0, "item": message(text, "completed")}),
    ]
    return [event(name, {"type": name, "sequence_number": first + k, **payload})
            for k, (name, payload) in enumerate(payloads)]


async def test_stream_exact_bytes(serve):
    status, data, _ = await post(serve, ScriptedEngine(scripts=["Hé"]), body(stream=True))
    assert status == 200
    done = response_object("completed", [message("Hé", "completed")], usage(21, 4))
    expected = b"".join([
        *opening_events(response_object("in_progress", [], None)),
        # "é" is two byte tokens: the first delta has no text and makes no event
        *message_events(["H", "é"], 2),
        event("response.completed", {"type": "response.completed", "sequence_number": 9, "response": done}),
    ])
    assert data == expected


async def test_incomplete_at_max_output_tokens(serve):
    engine = ScriptedEngine(scripts=["abcdef"])
    _, data, _ = await post(serve, engine, body(max_output_tokens=2))
    assert orjson.loads(data) == response_object("incomplete", [message("ab", "incomplete")], usage(21, 2),
                                                 max_output_tokens=2, details={"reason": "max_output_tokens"})
    assert engine.requests[0][1].max_tokens == 2
    _, data, _ = await post(serve, ScriptedEngine(scripts=["abcdef"]), body(max_output_tokens=2, stream=True))
    (*_, (done_name, done_item), (last_name, last)) = events_of(data)
    assert (done_name, done_item["item"]["status"]) == ("response.output_item.done", "incomplete")
    assert (last_name, last["type"], last["sequence_number"]) == ("response.incomplete", "response.incomplete", 9)
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["content"][0]["text"] == "ab"
    assert last["response"]["usage"] == usage(21, 2)


CONVERSATION = [  # (Responses input item, the chat message it stands for)
    ({"role": "system", "content": "Be brief."}, {"role": "system", "content": "Be brief."}),
    ({"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "No emoji."}]},
     {"role": "developer", "content": "No emoji."}),
    ({"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "there"}]},
     {"role": "user", "content": "Hi\nthere"}),
    ({"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
      "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
     {"role": "assistant", "content": "Hello!"}),
    ({"role": "user", "content": "Bye"}, {"role": "user", "content": "Bye"}),
]


async def test_input_forms_give_the_chat_prompt(serve):
    """A string, a message list with string or part contents, and chat's messages: the same prompt ids."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        for json in (body(), body(input=[{"role": "user", "content": "Hi"}]),
                     body(input=[{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                  "text": "Hi"}]}])):
            assert (await client.post(URL, json=json)).status_code == 200
        await client.post(URL, json=body(input=[item for item, _ in CONVERSATION]))
        await client.post("/v1/chat/completions", json=chat_body(messages=[m for _, m in CONVERSATION]))
    ids = [prompt for prompt, _, _ in engine.requests]
    assert ids[0] == ids[1] == ids[2] == engine.tokenizer.encode(PROMPT_HI)
    turns = ("<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
             "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    # the developer message is a system one; Responses joins the leading system messages into one, Chat does not
    assert ids[3] == engine.tokenizer.encode("<|im_start|>system\nBe brief.\n\nNo emoji.<|im_end|>\n" + turns)
    assert ids[4] == engine.tokenizer.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>system\nNo emoji.<|im_end|>\n" + turns)


async def test_truncation_auto_drops_leading_items_until_the_input_fits(serve):
    """truncation "auto" (OpenAI's: items dropped from the start of the conversation): the system message stays,
    the conversation restarts at the earliest user message whose tail fits with max_output_tokens (ByteTokenizer:
    a token a byte, 256 in the window), the response echoes "auto"; "disabled" (and null) refuse the same input;
    an input that fits is sent whole."""
    old = [{"role": "user", "content": "a" * 80}, {"role": "assistant", "content": "b" * 80}]
    recent = [{"role": "user", "content": "c" * 40}, {"role": "assistant", "content": "d" * 10},
              {"role": "user", "content": "Hi"}]
    json = body(instructions="Be brief.", input=old + recent, max_output_tokens=20)
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        refused = await client.post(URL, json={**json, "truncation": "disabled"})
        response = await client.post(URL, json={**json, "truncation": "auto"})
        whole = await client.post(URL, json={**body(input=recent), "truncation": "auto"})
    assert refused.status_code == 400
    assert orjson.loads(await refused.get_data())["error"]["code"] == "context_length_exceeded"
    assert response.status_code == 200 and whole.status_code == 200
    data = orjson.loads(await response.get_data())
    assert data["truncation"] == "auto" and data["output"][0]["content"][0]["text"] == "ok"
    kept = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + "c" * 40 +
            "<|im_end|>\n<|im_start|>assistant\n" + "d" * 10 + "<|im_end|>\n" + PROMPT_HI)
    assert engine.requests[0][0] == engine.tokenizer.encode(kept)
    assert data["usage"]["input_tokens"] == len(engine.tokenizer.encode(kept)) <= 256 - 20
    assert engine.requests[1][0] == engine.tokenizer.encode(
        "<|im_start|>user\n" + "c" * 40 + "<|im_end|>\n<|im_start|>assistant\n" + "d" * 10 + "<|im_end|>\n" +
        PROMPT_HI)


async def test_truncation_auto_still_refuses_a_last_message_that_cannot_fit(serve):
    """With nothing left to drop (the last user message alone is too long), "auto" answers the 400 "disabled"
    answers, the whole input's; a huge last message is refused by the character bound without being tokenized,
    by any probe (a tokenizer whose bound is a token a character: ByteTokenizer's own on ASCII)."""

    class Bounded(ByteTokenizer):
        longest = 0

        def min_num_tokens(self, num_chars: int) -> int:
            return num_chars

        def may_spell_special(self, text: str) -> bool:  # Tokenizer's substring test: no special token's text here
            return False

        def encode(self, text: str, *args, **kwargs) -> list[int]:
            Bounded.longest = max(Bounded.longest, len(text))
            return super().encode(text, *args, **kwargs)

    errors = {}
    for last in ("x" * 300, "y" * 100_000):
        json = body(input=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": last}])
        for truncation in ("auto", "disabled"):
            status, data, _ = await post(serve, ScriptedEngine(scripts=["ok"], tokenizer=Bounded()),
                                         {**json, "truncation": truncation})
            assert status == 400, (len(last), truncation)
            errors[len(last), truncation] = orjson.loads(data)["error"]
    for n in (300, 100_000):
        assert errors[n, "auto"] == errors[n, "disabled"] and errors[n, "auto"]["param"] == "input"
        assert errors[n, "auto"]["code"] == "context_length_exceeded"
    assert Bounded.longest < 1000  # the 300-character input was tokenized, the 100,000-character one never


async def test_truncation_auto_leaves_room_for_min_tokens(serve):
    """The tail kept leaves min_tokens (vLLM's field) in the window, not only one token: the 60-token tail would
    leave 196 < 200, so only the last message stays."""
    json = body(input=[{"role": "user", "content": "a" * 30}, {"role": "assistant", "content": "b"},
                       {"role": "user", "content": "Hi"}], truncation="auto", min_tokens=200)
    status, _, engine = await post(serve, ScriptedEngine(scripts=["ok"]), json)
    assert status == 200
    assert engine.requests[0][0] == engine.tokenizer.encode(PROMPT_HI)


async def test_S2_instructions_are_the_first_system_message_without_billing_header(serve):
    billing = "x-anthropic-billing-header: cc=123\n"
    json = body(instructions=billing + "Be brief.", input=[{"role": "system", "content": billing + "Rule two."},
                                                            {"role": "user", "content": "Hi"}])
    status, data, engine = await post(serve, ScriptedEngine(scripts=["ok"]), json)
    assert status == 200
    assert engine.requests[0][0] == engine.tokenizer.encode(
        "<|im_start|>system\nBe brief.\n\nRule two.<|im_end|>\n" + PROMPT_HI)
    assert orjson.loads(data)["instructions"] == billing + "Be brief."  # echoed as sent


async def test_S6_special_tokens_in_input_are_plain_text(serve):
    content = "say <|im_end|> now"
    _, _, engine = await post(serve, ScriptedEngine(scripts=["ok"]), body(input=content))
    tok = engine.tokenizer
    assert engine.requests[0][0] == (tok.encode("<|im_start|>user\n") + tok.encode(content, parse_special=False)
                                     + tok.encode("<|im_end|>\n<|im_start|>assistant\n"))


async def test_T3_responses_accepts_null_parallel_tool_calls(serve):
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, _):
        for value, echoed in ((None, True), (False, False), (True, True)):
            response = await client.post(URL, json=body(parallel_tool_calls=value, tools=[], tool_choice="auto"))
            assert response.status_code == 200
            assert orjson.loads(await response.get_data())["parallel_tool_calls"] is echoed


async def test_settings_echoed_and_chat_only_fields_ignored(serve):
    json = body(temperature=0, top_p=0.5, seed=7, top_k=3, store=True, metadata={"k": "v"}, user="u1",
                tool_choice="none", text={"format": {"type": "text"}}, n=3, max_tokens=1, instructions="Sys.")
    status, data, engine = await post(serve, ScriptedEngine(scripts=["ok"]), json)
    assert status == 200
    response = orjson.loads(data)
    assert {k: response[k] for k in ("temperature", "top_p", "metadata", "user", "tool_choice", "instructions")} == {
        "temperature": 0.0, "top_p": 0.5, "metadata": {"k": "v"}, "user": "u1", "tool_choice": "none",
        "instructions": "Sys."}
    params = engine.requests[0][1]
    assert (params.n, params.max_tokens, params.temperature, params.top_k, params.seed) == (1, None, 0.0, 3, 7)
    assert response["output"][0]["content"][0]["text"] == "ok"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, echoed", [({}, 0), ({"top_logprobs": None}, 0), ({"top_logprobs": 0}, 0),
                                           ({"top_logprobs": 5}, 5),
                                           ({"top_logprobs": 20, "include": [LOGPROBS_INCLUDE]}, 20)])
async def test_top_logprobs_echoed(serve, stream, extra, echoed):
    """The response object echoes `top_logprobs` (0 by default, as OpenAI's), with or without the logprobs
    `include`: whole, and in every lifecycle event of a stream (created, in_progress, completed)."""
    status, data, _ = await post(serve, ScriptedEngine(scripts=["ok"]), body(stream=stream, **extra))
    assert status == 200
    if not stream:
        assert orjson.loads(data)["top_logprobs"] == echoed
        assert SdkResponse.model_validate(orjson.loads(data)).top_logprobs == echoed
        return
    events, final = sdk_checked(data)
    lifecycle = [(name, e["response"]["top_logprobs"]) for name, e in events if "response" in e]
    assert lifecycle == [(name, echoed) for name in ("response.created", "response.in_progress",
                                                     "response.completed")]
    assert final.top_logprobs == echoed


async def test_top_logprobs_echoed_by_a_failed_response(serve):
    """An error mid-stream: `response.failed` echoes `top_logprobs` too."""
    engine = ScriptedEngine(scripts=["abcdef"], delay_s=0.05)
    async with serve(engine) as (client, _):
        data = await stream_until_engine_dies(client, engine, URL, body(stream=True, top_logprobs=3))
    failed = [e["response"] for name, e in events_of(data) if name == "response.failed"]
    assert [r["top_logprobs"] for r in failed] == [3]


@pytest.mark.parametrize("value", [v for v in Includable.__args__ if v != LOGPROBS_INCLUDE])
async def test_other_include_values_change_nothing(serve, value):
    """OpenAI's other `include` values ask for data of items this server refuses earlier (built-in tool calls,
    computer call outputs, input images) or never makes (reasoning's encrypted_content): accepted, and the
    response, whole and streamed, is byte for byte the one without them."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        for stream in (False, True):
            plain = await client.post(URL, json=body(stream=stream))
            included = await client.post(URL, json=body(stream=stream, include=[value, value]))
            assert included.status_code == 200
            assert await included.get_data() == await plain.get_data()
        assert all(params.logprobs is None for _, params, _ in engine.requests)


@pytest.mark.parametrize("options", [{"include_obfuscation": True}, {"include_obfuscation": False},
                                     {"include_obfuscation": None}, {}, {"include_usage": True}])
async def test_stream_options_accepted_with_stream(serve, options):
    """With `stream: true`, Responses' `stream_options` are accepted and change nothing: this server pads no
    delta with an `obfuscation` field, and Chat's `include_usage` is an unknown field here (the usage is always
    in the last event); null `stream_options` is fine streamed or not."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, _):
        plain = await (await client.post(URL, json=body(stream=True))).get_data()
        response = await client.post(URL, json=body(stream=True, stream_options=options))
        assert response.status_code == 200 and await response.get_data() == plain
        for stream in (False, True, None):
            assert (await client.post(URL, json=body(stream=stream, stream_options=None))).status_code == 200


def _missing(key: str) -> dict:
    json = body()
    del json[key]
    return json


# (id, body (dict -> JSON, bytes -> raw), status, param, code, message)
CASES = [
    ("malformed_json", b'{"model": "test-model", "input": ', 400, None, None,
     "request body is not a valid JSON object: Invalid JSON: EOF while parsing a value at line 1 column 33"),
    ("missing_input", _missing("input"), 400, "input", None, "missing required field 'input'"),
    ("missing_model", _missing("model"), 400, "model", None, "missing required field 'model'"),
    ("unknown_model", body(model="gpt-9"), 404, "model", "model_not_found",
     "The model `gpt-9` does not exist (this server serves `test-model`)."),
    ("input_wrong_type", body(input=5), 400, "input", None, "invalid value for 'input': Input should be a valid array"),
    ("empty_input_list", body(input=[]), 400, "input", None, "'input' must contain at least one item"),
    ("unknown_role", body(input=[{"role": "robot", "content": "x"}]), 400, "input.0.role", None,
     "invalid value for 'input.0.role': Input should be 'user', 'assistant', 'system' or 'developer'"),
    ("content_wrong_type", body(input=[{"role": "user", "content": 5}]), 400, "input.0.content", None,
     "invalid value for 'input.0.content': Input should be a valid array"),
    ("content_part_without_type", body(input=[{"role": "user", "content": [{"text": "x"}]}]), 400,
     "input.0.content.0.type", None, "missing required field 'input.0.content.0.type'"),
    ("message_without_content", body(input=[{"role": "user"}]), 400, "input.0.content", None,
     "missing required field 'input.0.content'"),
    ("message_without_role", body(input=[{"type": "message", "content": "x"}]), 400, "input.0.role", None,
     "missing required field 'input.0.role'"),
    ("S7_image_part", body(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]), 400, "input.0.content.1.type", None,
     "content part type 'input_image' is not supported: the served model accepts text only"),
    ("S7_file_part", body(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), 400,
     "input.0.content.0.type", None,
     "content part type 'input_file' is not supported: the served model accepts text only"),
    ("text_part_without_text", body(input=[{"role": "user", "content": [{"type": "input_text"}]}]), 400,
     "input.0.content.0.text", None, "a content part of type 'input_text' needs 'text'"),
    ("reasoning_item_alone", body(input=[{"type": "reasoning", "id": "rs_1", "summary": []}]), 400, "input", None,
     "'input' holds no message, function call or function call output"),
    ("web_search_item", body(input=[{"type": "web_search_call", "id": "ws_1"}]), 400, "input.0", None,
     "input items of type 'web_search_call' are not supported yet: this server takes messages, function calls "
     "and function call outputs"),
    ("function_call_output_without_call_id", body(input=[{"type": "function_call_output", "output": "42"}]), 400,
     "input.0.call_id", None, "missing required field 'input.0.call_id'"),
    ("function_call_output_without_output", body(input=[{"type": "function_call_output", "call_id": "c1"}]), 400,
     "input.0.output", None, "missing required field 'input.0.output'"),
    ("function_call_output_image_part", body(input=[{"type": "function_call_output", "call_id": "c1", "output": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]), 400, "input.0.output.0.type", None,
     "content part type 'input_image' is not supported: the served model accepts text only"),
    ("function_call_without_name", body(input=[{"type": "function_call", "call_id": "c1", "arguments": "{}"}]),
     400, "input.0.name", None, "missing required field 'input.0.name'"),
    ("function_call_arguments_object", body(input=[{"type": "function_call", "call_id": "c1", "name": "f",
                                                    "arguments": {}}]), 400, "input.0.arguments", None,
     "invalid value for 'input.0.arguments': Input should be a valid string"),
    ("max_output_tokens_zero", body(max_output_tokens=0), 400, "max_output_tokens", None,
     "max_output_tokens must be >= 1"),
    ("max_output_tokens_string", body(max_output_tokens="5"), 400, "max_output_tokens", None,
     "invalid value for 'max_output_tokens': Input should be a valid integer"),
    ("max_output_tokens_above_context", body(max_output_tokens=1000), 400, "max_output_tokens",
     "context_length_exceeded", None),
    ("input_above_context", body(input="x" * 300), 400, "input", "context_length_exceeded", None),
    ("truncation_other", body(truncation="middle"), 400, "truncation", None,
     "invalid value for 'truncation': Input should be 'auto' or 'disabled'"),
    ("temperature_negative", body(temperature=-1), 400, "temperature", None, None),
    ("web_search_tool", body(tools=[{"type": "function", "name": "f"}, {"type": "web_search"}]), 400,
     "tools.1.type", None, "tools of type 'web_search' are not supported yet: this server serves function tools only"),
    ("mcp_tool", body(tools=[{"type": "mcp", "server_label": "s", "server_url": "https://x"}]), 400, "tools.0.type",
     None, "tools of type 'mcp' are not supported yet: this server serves function tools only"),
    ("tool_without_type", body(tools=[{"name": "f"}]), 400, "tools.0.type", None,
     "missing required field 'tools.0.type'"),
    ("function_tool_without_name", body(tools=[{"type": "function", "parameters": {}}]), 400, "tools.0.name", None,
     "missing required field 'tools.0.name'"),
    ("function_tool_parameters_not_object", body(tools=[{"type": "function", "name": "f", "parameters": "x"}]), 400,
     "tools.0.parameters", None, "invalid value for 'tools.0.parameters': Input should be an object"),
    ("function_tool_parameters_string_schema", body(tools=[{"type": "function", "name": "f", "parameters": {
        "type": "string"}}]), 400, "tools.0.parameters", None,
     "Invalid schema for function 'f': schema must be a JSON Schema of 'type: \"object\"', got 'type: \"string\"'."),
    ("function_tool_parameters_type_list", body(tool_choice="none", tools=[{"type": "function", "name": "f"}, {
        "type": "function", "name": "g", "parameters": {"type": ["object", "null"]}}]), 400, "tools.1.parameters",
     None, "Invalid schema for function 'g': schema must be a JSON Schema of 'type: \"object\"', "
     "got 'type: [\"object\", \"null\"]'."),
    ("tool_choice_required", body(tool_choice="required"), 400, "tool_choice", None,
     "tool_choice forces a call but the request gives no tools"),
    ("tool_choice_named_unknown", body(tool_choice={"type": "function", "name": "g"},
                                       tools=[{"type": "function", "name": "f"}]), 400, "tool_choice", None,
     "tool_choice names 'g', which is not one of the tools"),
    ("tool_choice_malformed", body(tool_choice={"type": "function"}, tools=[{"type": "function", "name": "f"}]),
     400, "tool_choice", None, "a named tool_choice is {'type': 'function', 'name': ...}"),
    ("parallel_tool_calls_string", body(parallel_tool_calls="yes"), 400, "parallel_tool_calls", None,
     "invalid value for 'parallel_tool_calls': Input should be a valid boolean"),
    ("previous_response_id", body(previous_response_id="resp_1"), 400, "previous_response_id", None,
     "previous_response_id is not supported: this server does not store responses"),
    ("conversation", body(conversation="conv_1"), 400, "conversation", None,
     "conversation is not supported: this server does not store conversations"),
    ("prompt_template", body(prompt={"id": "pmpt_1"}), 400, "prompt", None,
     "prompt is not supported: this server does not store prompts"),
    ("background", body(background=True), 400, "background", None,
     "background responses are not supported: this server answers in the foreground"),
    ("text_format_json_schema_without_schema", body(text={"format": {"type": "json_schema", "name": "x"}}), 400,
     "text.format.schema", None, "text.format of type 'json_schema' needs 'schema'"),
    ("text_format_unknown", body(text={"format": {"type": "yaml"}}), 400, "text.format.type", None,
     "text.format of type 'yaml' is not supported"),
    ("metadata_value_not_string", body(metadata={"k": 1}), 400, "metadata.k", None,
     "invalid value for 'metadata.k': Input should be a valid string"),
    # `include`: OpenAI's values only; the error names the element, as every list element's does
    ("include_unknown", body(include=["message.output_text.logprobs", "file_search_call.result"]), 400,
     "include.1", None, f"invalid value for 'include.1': Input should be {INCLUDE_VALUES}"),
    ("include_chat_field", body(include=["logprobs"]), 400, "include.0", None,
     f"invalid value for 'include.0': Input should be {INCLUDE_VALUES}"),
    ("include_not_a_string", body(include=[1]), 400, "include.0", None,
     f"invalid value for 'include.0': Input should be {INCLUDE_VALUES}"),
    ("include_not_a_list", body(include="message.output_text.logprobs"), 400, "include", None,
     "invalid value for 'include': Input should be a valid array"),
    # `stream_options`: Responses' own ({"include_obfuscation"}), with `stream: true` only (Chat's rule)
    ("stream_options_without_stream", body(stream_options={"include_obfuscation": False}), 400, "stream_options",
     None, STREAM_OPTIONS_WITHOUT_STREAM),
    ("stream_options_stream_false", body(stream=False, stream_options={}), 400, "stream_options", None,
     STREAM_OPTIONS_WITHOUT_STREAM),
    ("stream_options_not_an_object", body(stream=True, stream_options=True), 400, "stream_options", None,
     "invalid value for 'stream_options': Input should be an object"),
    ("include_obfuscation_not_a_boolean", body(stream=True, stream_options={"include_obfuscation": "no"}), 400,
     "stream_options.include_obfuscation", None,
     "invalid value for 'stream_options.include_obfuscation': Input should be a valid boolean"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_bad_input(serve, case):
    _, json, status, param, code, message = case
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        kwargs = {"data": json} if isinstance(json, bytes) else {"json": json}
        response = await client.post(URL, headers={"content-type": "application/json"}, **kwargs)
        error = orjson.loads(await response.get_data())["error"]
        assert (response.status_code, error["type"], error["param"], error["code"]) == (status, INVALID, param, code)
        if message is not None:
            assert error == {"message": message, "type": INVALID, "param": param, "code": code}
        assert engine.requests == []  # refused before the engine
        good = await client.post(URL, json=body())
        assert orjson.loads(await good.get_data())["output"][0]["content"][0]["text"] == "ok"


async def test_unknown_routes_and_methods(serve):
    """Nothing is stored, so there is no GET /v1/responses/{id}: the usual 404; GET /v1/responses is a 405."""
    async with serve() as (client, _):
        by_id = await client.get("/v1/responses/resp_0")
        listed = await client.get(URL)
    assert by_id.status_code == 404
    assert orjson.loads(await by_id.get_data())["error"]["code"] == "unknown_url"
    assert listed.status_code == 405


async def test_null_stream_and_sampling_fields_mean_defaults(serve):
    nulls = dict.fromkeys(("stream", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                           "tool_choice", "parallel_tool_calls", "text", "store", "metadata"))
    status, data, engine = await post(serve, ScriptedEngine(scripts=["ok"]), body(**nulls))
    assert status == 200 and orjson.loads(data)["output"][0]["content"][0]["text"] == "ok"
    params = engine.requests[-1][1]
    assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 1.0, None)


async def test_S1_keep_alive_responses(serve):
    """Comments while the engine stalls (through a real RequestStream), and otherwise the same events."""
    _, slow, _ = await post(serve, StreamedEngine(scripts=["ab"], first_delay_s=0.5, delay_s=0.02),
                            body(stream=True), sse_keep_alive_interval=0.2)
    _, plain, _ = await post(serve, ScriptedEngine(scripts=["ab"]), body(stream=True))
    assert slow.count(sse.KEEP_ALIVE) >= 1
    assert slow.replace(sse.KEEP_ALIVE, b"") == plain
    assert sse.KEEP_ALIVE not in plain  # none by default


async def test_client_disconnect_aborts_request(serve):
    engine = ScriptedEngine(scripts=["x" * 200], delay_s=0.02)
    async with serve(engine) as (client, _):
        first = await leave_mid_stream(client, body(stream=True), chunks=6, path=URL)
        assert first.startswith(b"event: response.created\ndata: ")
        (_, _, request_id), = engine.requests
        await wait_for_abort(engine)
        assert set(engine.aborted) == {request_id}
        assert (await client.post(URL, json=body(max_output_tokens=2))).status_code == 200


async def test_engine_error_mid_stream_is_an_error_then_a_failed_response(serve):
    engine = ScriptedEngine(scripts=["abcdef"], delay_s=0.05)
    async with serve(engine) as (client, _):
        data = await stream_until_engine_dies(client, engine, URL, body(stream=True))
    events = events_of(data)
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    # the message item the stream opened ends "incomplete" with the text sent, before the error
    assert set(names[4:-5]) == {"response.output_text.delta"} and len(names) > 9
    assert names[-5:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "error", "response.failed"]
    sent = "".join(payload["delta"] for name, payload in events if name == "response.output_text.delta")
    assert sent and "abcdef".startswith(sent)
    item = message(sent, "incomplete")
    assert events[-3][1]["item"] == item and events[-5][1]["text"] == sent
    n = len(events) - 2
    error, failed = events[-2][1], events[-1][1]
    assert error == {"type": "error", "sequence_number": n, "code": "engine_dead", "message": "scripted engine died",
                     "param": None}
    assert failed["sequence_number"] == n + 1
    # response.failed's output holds every item the stream added, as the events left them
    assert (failed["response"]["status"], failed["response"]["error"], failed["response"]["output"]) == \
        ("failed", {"code": "server_error", "message": "scripted engine died"}, [item])
    for _, payload in events[-5:]:
        TypeAdapter(ResponseStreamEvent).validate_python(payload)  # the SDK reads them (ResponseFailedEvent ...)


TRICKY = 'a"b\\c\n\t\x01é€😀</script>\u2028'  # quotes, escapes, control bytes, 2-4 byte UTF-8, U+2028


def sdk_checked(data: bytes) -> tuple[list[tuple[str, dict]], SdkResponse]:
    """The events of a Responses stream, after checking them: sequence numbers count from 0, every event validates
    against the `openai` SDK's typed models, each delta event assembled from bytes is exactly our model's
    rendering, and the text deltas join to the final response's text.

    Returns:
        (the events, the final response as the SDK reads it).
    """
    events = events_of(data)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    deltas = []
    for (name, payload), frame in zip(events, data.split(b"\n\n")):
        parsed = SDK_EVENT.validate_python(payload)
        assert parsed.type == name
        if name == "response.output_text.delta":
            deltas.append(parsed.delta)
            assert frame + b"\n\n" == sse.typed_frame(name, OutputTextDeltaEvent.model_validate(payload))
    final = SdkResponse.model_validate(events[-1][1]["response"])
    assert "".join(deltas) == final.output_text
    return events, final


SDK_EVENT = TypeAdapter(ResponseStreamEvent)
FUNCTION_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": False},
                  {"type": "function", "name": "now"}]
# (script, extra request fields, server config, the final output text, the output items' types)
SDK_CASES = [
    (TRICKY, {}, {}, TRICKY, ["message"]),
    (TRICKY, {"max_output_tokens": 9}, {}, TRICKY[:8], ["message"]),
    # text, a call, text, a call: U+2028 at the text's end is not whitespace the parser holds back or drops
    (TRICKY + call("get_weather", '{"city": "Paris"}') + TRICKY + call("now", "{}"),
     {"tools": FUNCTION_TOOLS}, {"tool_call_parser": "hermes"}, TRICKY * 2,
     ["message", "function_call", "message", "function_call"]),
]


@pytest.mark.parametrize("case", SDK_CASES, ids=["text", "max_output_tokens", "tools"])
async def test_events_match_models_and_the_sdk(serve, case):
    """`sdk_checked`'s checks on each stream; the non-streamed object, which the SDK reads too, equals the final
    streamed one."""
    script, extra, config, text, types = case
    async with serve(ScriptedEngine(scripts=[script], max_model_len=4096), **config) as (client, _):
        data = await (await client.post(URL, json=body(stream=True, **extra))).get_data()
        whole = orjson.loads(await (await client.post(URL, json=body(**extra))).get_data())
    events, final = sdk_checked(data)
    assert final.output_text == text and [item.type for item in final.output] == types
    assert SdkResponse.model_validate(whole).output_text == text
    assert whole == events[-1][1]["response"]


async def test_metrics_count_responses(serve):
    async with serve(ScriptedEngine(scripts=["Hello"])) as (client, _):
        streamed = events_of(await (await client.post(URL, json=body(stream=True))).get_data())
        whole = orjson.loads(await (await client.post(URL, json=body(max_output_tokens=2))).get_data())
        metrics = await _scrape(client)
    usages = [streamed[-1][1]["response"]["usage"], whole["usage"]]
    assert metrics[("voltserve:request_success_total", _m(finished_reason="stop"))] == 1
    assert metrics[("voltserve:request_success_total", _m(finished_reason="length"))] == 1
    assert metrics[("voltserve:prompt_tokens_total", _m())] == sum(u["input_tokens"] for u in usages)
    assert metrics[("voltserve:generation_tokens_total", _m())] == sum(u["output_tokens"] for u in usages) == 6 + 2


async def test_template_rejection_blames_input(serve):
    engine = ScriptedEngine()

    def reject(messages, **kwargs):
        raise ValueError("Conversation roles must alternate user/assistant")

    engine.chat_template.render = reject
    status, data, _ = await post(serve, engine, body(input=[{"role": "user", "content": "a"},
                                                            {"role": "user", "content": "b"}]))
    assert (status, orjson.loads(data)) == (400, {"error": {
        "message": "the chat template rejected the messages: Conversation roles must alternate user/assistant",
        "type": INVALID, "param": "input", "code": None}})
