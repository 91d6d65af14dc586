"""Speculative decoding behind a real hypercorn (slow): a verify step delivers several tokens at once, and the
API turns them into the same text, SSE stream and usage as the plain server's (case D1 through HTTP)."""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import REAL_MODEL as MODEL

pytestmark = pytest.mark.slow
COUNT = [{"role": "user", "content": "List the numbers from 1 to 30 separated by commas."}]


def _client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_D1_streamed_greedy_chat_equals_the_plain_server(server_url, spec_server_url):
    plain = _client(server_url).chat.completions.create(model=MODEL, messages=COUNT, temperature=0, max_tokens=90)
    chunks = list(_client(spec_server_url).chat.completions.create(
        model=MODEL, messages=COUNT, temperature=0, max_tokens=90, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and text.startswith("1, 2, 3, 4, 5")
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [plain.choices[0].finish_reason]
    # verify steps emit several tokens a delta: fewer content chunks than tokens
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) < plain.usage.completion_tokens


def test_stop_strings_and_logprobs_as_the_plain_server(server_url, spec_server_url):
    """A stop string met inside a verify step's tokens; a logprobs request (decoded without drafts)."""
    for kwargs in ({"stop": ["12"]}, {"logprobs": True, "top_logprobs": 2, "max_tokens": 12}):
        args = {"model": MODEL, "messages": COUNT, "temperature": 0, "max_tokens": 90, **kwargs}
        plain = _client(server_url).chat.completions.create(**args)
        spec = _client(spec_server_url).chat.completions.create(**args)
        assert spec.choices[0].message.content == plain.choices[0].message.content
        assert spec.choices[0].finish_reason == plain.choices[0].finish_reason
        assert spec.usage.completion_tokens == plain.usage.completion_tokens
        if "logprobs" in kwargs:
            assert spec.choices[0].logprobs.content == plain.choices[0].logprobs.content
        else:
            assert spec.choices[0].message.content.endswith("11, ")


def test_metrics_count_drafts(spec_server_url):
    """/metrics carries the engine's speculative decoding counters (vLLM's names)."""
    import httpx

    # 90 tokens, not 40: alone on a fresh server, 40 tokens had no n-gram draft token accepted
    _client(spec_server_url).chat.completions.create(model=MODEL, messages=COUNT, temperature=0, max_tokens=90)
    text = httpx.get(spec_server_url + "/metrics", timeout=10).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("voltserve:spec_decode_")}
    drafts, tokens, accepted = (values[f"voltserve:spec_decode_num_{n}_total"]
                                for n in ("drafts", "draft_tokens", "accepted_tokens"))
    assert drafts > 0 and tokens >= drafts and 0 < accepted <= tokens
    # the draft gate's steps by mode: off here (VOLTSERVE_SPECULATIVE_GATE reached the engine), none held back
    gate = {line.split('mode="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("voltserve:spec_decode_gate_steps_total{")}
    assert gate["draft"] > 0 and gate["plain"] == 0
