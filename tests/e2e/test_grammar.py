"""Grammar-constrained decoding (`voltserve.grammar`, llguidance) on the default model, CPU: what the model
writes under a JSON schema or a forced tool call parses, whatever the model would have written freely."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.e2e.engine_helpers import chat_ids, complete, running_engine
from voltserve import grammar
from voltserve.errors import InvalidRequestError
from voltserve.parsers.hermes import ToolCall, parse_tool_calls

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "parameters": CITY}, {"name": "now"}]
# on a GPU, grammar rows take the host sampler in synchronous steps (`ModelRunner.async_sampler`): run there too
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
async def test_json_schema_output_parses(smollm2, device):
    async with running_engine(smollm2, device=device) as engine:
        prompt = chat_ids(engine, "What is the capital of France?")
        free, _, _ = await complete(engine, prompt, temperature=0, max_tokens=40)
        text, tokens, last = await complete(engine, prompt, temperature=0, max_tokens=60,
                                            grammar=grammar.json_schema_grammar(CITY))
        sampled, _, _ = await complete(engine, prompt, temperature=1.0, seed=7, max_tokens=60,
                                       grammar=grammar.json_schema_grammar(CITY))
    assert not free.lstrip().startswith("{")  # free text: the answer in words
    for out in (text, sampled):
        value = json.loads(out)
        assert set(value) == {"city", "days"} and 1 <= value["days"] <= 9 and len(value["city"]) <= 20
    assert last.finish_reason.value == "stop"  # the grammar completed: EOS or nothing more allowed


@pytest.mark.parametrize("device", DEVICES)
async def test_forced_tool_calls_parse(smollm2, device):
    async with running_engine(smollm2, device=device) as engine:
        prompt = chat_ids(engine, "What is the weather in Paris for the next 3 days?")
        one, _, _ = await complete(engine, prompt, temperature=0, max_tokens=80,
                                   grammar=grammar.tool_calls_grammar(TOOLS, max_calls=1))
        named, _, _ = await complete(engine, prompt, temperature=0, max_tokens=80,
                                     grammar=grammar.tool_calls_grammar(TOOLS[1:], max_calls=1))
    content, calls = parse_tool_calls(one)
    assert content == "" and len(calls) == 1 and calls[0].name in ("get_weather", "now")
    if calls[0].name == "get_weather":
        assert set(json.loads(calls[0].arguments)) == {"city", "days"}
    # a tool without parameters takes exactly {} (case T4)
    assert parse_tool_calls(named) == ("", [ToolCall("now", "{}")])


def test_check_names_the_request_field(smollm2):
    bad = grammar.tool_calls_grammar([{"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Missing"}}}}])
    with pytest.raises(InvalidRequestError) as info:
        grammar.check(smollm2.tokenizer, bad, "tools")
    assert info.value.param == "tools" and "Missing" in info.value.message
    # $defs of a tool's parameters are moved to where its references resolve (case T11)
    ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
           "$defs": {"P": {"type": "integer"}}}
    grammar.check(smollm2.tokenizer, grammar.tool_calls_grammar([{"name": "f", "parameters": ref}]), "tools")


@pytest.mark.parametrize("device", DEVICES)
async def test_a_grammar_complete_at_max_tokens_is_a_stop(smollm2, device):
    """The grammar ends the output on its last token: finish_reason stop, even when that token is the
    max_tokens-th (the grammar's end is checked before the length)."""
    async with running_engine(smollm2, device=device) as engine:
        prompt = chat_ids(engine, "What is the capital of France?")
        g = grammar.json_schema_grammar(CITY)
        _, tokens, _ = await complete(engine, prompt, temperature=0, max_tokens=60, grammar=g)
        text, _, last = await complete(engine, prompt, temperature=0, max_tokens=len(tokens), grammar=g)
    json.loads(text)
    assert last.finish_reason.value == "stop"


@pytest.mark.parametrize("device", DEVICES)
async def test_a_grammar_request_beside_free_ones(smollm2, device):
    """Free greedy requests batched with a grammar request answer as they do beside a free request of as many
    tokens (on a GPU: their steps are then synchronous, the grammar row sampled on the host), and on the CPU
    (batch invariant) as they do alone. A GPU's numerics depend on the step's shape (a batch of 3 runs other
    GEMV kernels than one row), so there the comparison keeps the batch the same."""
    async with running_engine(smollm2, device=device) as engine:
        prompts = [chat_ids(engine, q) for q in ("What is the capital of France?", "Name a color.")]
        alone = [(await complete(engine, p, temperature=0, max_tokens=24))[1] for p in prompts]
        together = await asyncio.gather(
            complete(engine, prompts[0], temperature=0, max_tokens=40, grammar=grammar.json_schema_grammar(CITY)),
            *(complete(engine, p, temperature=0, max_tokens=24) for p in prompts))
        beside_free = await asyncio.gather(
            complete(engine, prompts[0], temperature=0, max_tokens=len(together[0][1]), ignore_eos=True),
            *(complete(engine, p, temperature=0, max_tokens=24) for p in prompts))
    json.loads(together[0][0])
    assert len(beside_free[0][1]) == len(together[0][1])
    assert [t[1] for t in together[1:]] == [t[1] for t in beside_free[1:]]
    if device == "cpu":
        assert [t[1] for t in together[1:]] == alone
