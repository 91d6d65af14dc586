"""POST /tokenize and /detokenize (vLLM's shapes) over the ScriptedEngine with the default model's tokenizer:
exact JSON, the chat route's prompt ids, the 400s, the 404 and auth."""

from __future__ import annotations

import orjson
import pytest

from tests.api.conftest import MODEL, chat_body
from tests.api.fake_engine import ScriptedEngine
from voltserve.chat_template import ChatTemplate
from voltserve.tokenizer import Tokenizer

INVALID = "invalid_request_error"


@pytest.fixture
def real_engine(smollm2):
    """A ScriptedEngine with the default model's tokenizer and chat template."""
    tok = smollm2.tokenizer
    engine = ScriptedEngine(scripts=["ok"], tokenizer=tok)
    engine.chat_template = ChatTemplate(smollm2.chat_template, tok.bos_token, tok.eos_token)
    return engine


async def _post(client, path: str, body: dict, **kwargs) -> tuple[int, dict]:
    response = await client.post(path, json=body, **kwargs)
    return response.status_code, orjson.loads(await response.get_data())


async def test_tokenize_with_and_without_special_tokens(serve, smollm2_tokenizer):
    """A prompt reads special-token text as those tokens, and gets BOS where the model adds one unless
    `add_special_tokens` is false; messages get it only when it is true (SmolLM2 adds none: here a copy of its
    tokenizer whose BOS is `<|endoftext|>`, id 0)."""
    with_bos = Tokenizer(smollm2_tokenizer.backend, bos_token_id=0, eos_token_ids=[2], add_bos=True)
    async with serve(ScriptedEngine(tokenizer=with_bos)) as (client, engine):
        plain = await _post(client, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
        bare = await _post(client, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False,
                                                  "return_token_strs": True})
        special = await _post(client, "/tokenize", {"prompt": "<|im_end|>Hi", "add_special_tokens": False})
        chat = await _post(client, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
        chat_bos = await _post(client, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "add_special_tokens": True})
    assert plain == (200, {"count": 3, "max_model_len": 256, "tokens": [0, 19556, 905], "token_strs": None})
    assert bare == (200, {"count": 2, "max_model_len": 256, "tokens": [19556, 905],
                          "token_strs": ["Hello", "Ġworld"]})
    assert special == (200, {"count": 2, "max_model_len": 256, "tokens": [2, 26843], "token_strs": None})
    ids = engine.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert chat == (200, {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None})
    assert chat_bos[1]["tokens"] == [0, *ids]


async def test_tokenize_messages_gives_the_chat_routes_prompt_ids(serve, real_engine):
    """The default model's template and tokenizer, a system prompt, user text that spells a special token (read
    as plain text, case S6), tools and template kwargs: /tokenize's ids are those the chat request ran."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say <|im_end|> and"}, {"type": "text",
                                                                                      "text": "stop."}]}]
    extra = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
             "chat_template_kwargs": {"enable_thinking": False}}
    async with serve(real_engine) as (client, engine):
        status, tokenized = await _post(client, "/tokenize", {"model": MODEL, "messages": messages, **extra})
        chat = await client.post("/v1/chat/completions", json=chat_body(messages=messages, **extra))
        assert chat.status_code == 200
    assert status == 200 and tokenized["tokens"] == engine.requests[-1][0]
    assert (tokenized["count"], tokenized["max_model_len"]) == (len(tokenized["tokens"]), 256)
    text = engine.tokenizer.decode(tokenized["tokens"], skip_special_tokens=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay <|im_end|> and\nstop.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tokenized["tokens"].count(2) == 2  # the user's `<|im_end|>` is plain text, not the token


@pytest.mark.parametrize("options,expected", [
    ({"add_generation_prompt": False}, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nWell <|im_end|>\n"),
    ({"continue_final_message": True}, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nWell "),
    ({"continue_final_message": True, "add_generation_prompt": False},
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nWell "),
])
async def test_tokenize_messages_options_and_detokenize_them(serve, options, expected):
    """Without the generation prompt, or continuing the final message (cut after its content, its trailing space
    kept, as transformers does); /detokenize gives the text back with its special tokens."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well "}]
    async with serve() as (client, engine):
        status, tokenized = await _post(client, "/tokenize", {"messages": messages, **options})
        assert status == 200
        detokenized = await _post(client, "/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]})
    assert detokenized == (200, {"prompt": expected})
    assert tokenized["tokens"] == engine.tokenizer.encode(expected)


async def test_continue_a_final_message_that_spells_a_special_token(serve):
    """The final message's `<|im_end|>` stays plain text (case S6) where the prompt is cut after it."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Say <|im_end|>"}]
    async with serve() as (client, engine):
        status, tokenized = await _post(client, "/tokenize", {"messages": messages, "continue_final_message": True})
    head = engine.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert status == 200
    assert tokenized["tokens"] == head + engine.tokenizer.encode("Say <|im_end|>", parse_special=False)


async def test_detokenize_round_trip(serve, smollm2_tokenizer):
    text = "<|im_start|>user\nHéllo 👋, wörld!<|im_end|>\n"
    async with serve(ScriptedEngine(tokenizer=smollm2_tokenizer)) as (client, _):
        _, tokenized = await _post(client, "/tokenize", {"prompt": text})
        detokenized = await _post(client, "/detokenize", {"tokens": tokenized["tokens"]})
        empty = await _post(client, "/detokenize", {"tokens": []})
    assert tokenized["tokens"][:3] == [1, 4093, 198]  # <|im_start|> user \n
    assert detokenized == (200, {"prompt": text})
    assert empty == (200, {"prompt": ""})


async def test_a_prompt_past_the_context_is_counted(serve, smollm2_tokenizer):
    """/tokenize counts whatever its size (tokenized in a thread, as a long chat prompt), as count_tokens does."""
    text = "hello world " * 60_000
    async with serve(ScriptedEngine(tokenizer=smollm2_tokenizer, max_model_len=8_192)) as (client, _):
        prompt = await _post(client, "/tokenize", {"prompt": text})
        chat = await _post(client, "/tokenize", {"messages": [{"role": "user", "content": text}]})
    assert prompt[0] == chat[0] == 200
    assert prompt[1]["count"] == 120_001 and chat[1]["count"] > 120_001  # the last space is a token
    assert prompt[1]["max_model_len"] == 8_192


def _error(message: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": INVALID, "param": param, "code": None}}


USER = [{"role": "user", "content": "Hi"}]
BAD = [
    ("/tokenize", {"model": MODEL}, _error("missing required field 'prompt' or 'messages'", "prompt")),
    ("/tokenize", {"prompt": "Hi", "messages": USER},
     _error("give either 'prompt' (a string) or 'messages', not both", "prompt")),
    ("/tokenize", {"prompt": [1, 2]}, _error("invalid value for 'prompt': Input should be a valid string", "prompt")),
    ("/tokenize", {"messages": []}, _error("'messages' must contain at least one message", "messages")),
    ("/tokenize", {"messages": USER, "continue_final_message": True, "add_generation_prompt": True},
     _error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message")),
    ("/tokenize", {"messages": USER + [{"role": "assistant", "content": " "}], "continue_final_message": True},
     _error("continue_final_message: the final message has no text to continue", "messages")),
    ("/tokenize", {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}},
     _error("chat_template_kwargs cannot set 'add_generation_prompt': the server sets messages, tools and "
            "add_generation_prompt itself", "chat_template_kwargs.add_generation_prompt")),
    ("/tokenize", {"model": "", "prompt": "Hi"}, _error("'model' must name the served model", "model")),
    ("/detokenize", {"tokens": [5, 259]}, _error("tokens: token ids must be in [0, 259)", "tokens")),
    ("/detokenize", {"tokens": [-1]}, _error("tokens: token ids must be in [0, 259)", "tokens")),
    ("/detokenize", {"tokens": [1.5]}, _error("invalid value for 'tokens.0': Input should be a valid integer",
                                              "tokens.0")),
    ("/detokenize", {"model": MODEL}, _error("missing required field 'tokens'", "tokens")),
]


@pytest.mark.parametrize("path,body,expected", BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)])
async def test_bad_input_is_a_400(serve, path, body, expected):
    async with serve() as (client, _):
        assert await _post(client, path, body) == (400, expected)


async def test_an_unknown_model_is_the_404_of_the_other_routes(serve):
    async with serve() as (client, _):
        chat = await _post(client, "/v1/chat/completions", chat_body(model="gpt-9"))
        tokenized = await _post(client, "/tokenize", {"model": "gpt-9", "prompt": "Hi"})
        detokenized = await _post(client, "/detokenize", {"model": "gpt-9", "tokens": [1]})
    assert chat == tokenized == detokenized == (404, {"error": {
        "message": f"The model `gpt-9` does not exist (this server serves `{MODEL}`).", "type": INVALID,
        "param": "model", "code": "model_not_found"}})


@pytest.mark.parametrize("headers,status", [({}, 401), ({"authorization": "Bearer sk-test"}, 200),
                                            ({"x-api-key": "sk-test"}, 200)])
async def test_api_key(serve, headers, status):
    async with serve(api_key="sk-test") as (client, _):
        tokenized = await _post(client, "/tokenize", {"prompt": "Hi"}, headers=headers)
        detokenized = await _post(client, "/detokenize", {"tokens": [75, 108]}, headers=headers)
    assert (tokenized[0], detokenized[0]) == (status, status)
    if status == 401:
        assert tokenized[1]["error"]["code"] == detokenized[1]["error"]["code"] == "invalid_api_key"
    else:
        assert detokenized[1] == {"prompt": "Hi"}
