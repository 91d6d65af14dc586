"""ScriptedEngine: a test double of `actors.engine.AsyncEngine` that emits fixed texts; StreamedEngine (its deltas
through a real RequestStream), ChunkedEngine (several tokens a delta), MarkerTokenizer (`</think>` and
`<tool_call>` one token each), RecordingTemplate (a chat template double that keeps its input) and `hermes_call`
(tool-call markup to script).

It has the engine's interface (add_request validation, RequestStream deltas with counts and logprobs, abort,
is_healthy) and a byte-level tokenizer, so multi-byte characters span several tokens as with real BPE models.
"""

from __future__ import annotations

import asyncio
import codecs
import re
import uuid

from voltserve.config import EngineConfig
from voltserve.errors import EngineDeadError
from voltserve.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob, check_request

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
EOS_ID = 2


class ByteTokenizer:
    """Ids 0-2 are the specials above; id 3 + b is byte b."""

    vocab_size = 3 + 256

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            special = next((s for s in SPECIALS if parse_special and text.startswith(s, i)), None)
            if special is not None:
                ids.append(SPECIALS.index(special))
                i += len(special)
            else:
                ids.extend(3 + b for b in text[i].encode())
                i += 1
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return SPECIALS[token_id].encode() if token_id < 3 else bytes([token_id - 3])

    def id_to_token(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("latin-1")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(self.token_bytes(i) for i in ids if not (skip_special_tokens and i < 3))
        return data.decode("utf-8", errors="replace")

    def ll_tokenizer(self):
        """The `llguidance.LLTokenizer` of this vocabulary (`voltserve.grammar.ll_tokenizer`), built once."""
        if getattr(self, "_ll", None) is None:
            import llguidance

            class Vocabulary:  # what llguidance.TokenizerWrapper reads
                eos_token_id, bos_token_id = EOS_ID, None
                tokens = [self.token_bytes(i) for i in range(self.vocab_size)]
                special_token_ids = [0, 1, 2]

                def __call__(inner, text: str) -> list[int]:
                    return self.encode(text, parse_special=False)

            self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()))
        return self._ll

    def byte_table(self, skip_special_tokens: bool = True) -> tuple[bytes, ...]:
        """Bytes of each id as `decode` joins them (as `voltserve.tokenizer.Tokenizer.byte_table`)."""
        return tuple(b"" if skip_special_tokens and i < 3 else self.token_bytes(i) for i in range(self.vocab_size))


class MarkerTokenizer(ByteTokenizer):
    """ByteTokenizer with `</think>` (id 259) and `<tool_call>` (id 260) one token each: added tokens that are not
    special (as Qwen3's), so read as one token with or without special-token parsing and kept in the text."""

    MARKERS = ("</think>", "<tool_call>")
    vocab_size = ByteTokenizer.vocab_size + len(MARKERS)

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        ids: list[int] = []
        for k, part in enumerate(re.split("(" + "|".join(map(re.escape, self.MARKERS)) + ")", text)):
            if k % 2:  # a marker (split's captured separator)
                ids.append(ByteTokenizer.vocab_size + self.MARKERS.index(part))
            elif part:
                ids += super().encode(part, add_special_tokens, parse_special)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        if token_id >= ByteTokenizer.vocab_size:
            return self.MARKERS[token_id - ByteTokenizer.vocab_size].encode()
        return super().token_bytes(token_id)


class ChatMLTemplate:
    """ChatML, as SmolLM2's template renders it (without its default system prompt)."""

    def render(self, messages, add_generation_prompt=True, tools=None, **kwargs) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class ScriptedStream:
    """Async iterator of RequestOutput deltas: one token per delta, sequences interleaved."""

    def __init__(self, engine: "ScriptedEngine", request_id: str, prompt_len: int, params: SamplingParams):
        self.engine, self.request_id, self.prompt_len, self.params = engine, request_id, prompt_len, params
        self.finished = False  # every sequence delivered its last delta (as RequestStream.finished)
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        """As RequestStream.done: finished, failed or aborted."""
        return self.finished or self.error is not None or self.request_id in self.engine.aborted

    def fail(self, exc: BaseException) -> None:
        """As RequestStream.fail: the consumer gets `exc` instead of the next delta."""
        if self.error is None and not self.finished:
            self.error = exc

    def abort(self) -> None:
        self.engine.abort(self.request_id)

    def __aiter__(self):
        return self._run()

    def _logprob(self, token_id: int, position: int) -> TokenLogprob | None:
        """The scripted logprob of a token: -0.25 * (position % 4), its top k the ids after it, each 1 lower;
        none for EOS, which has no text (as the engine's: logprobs cover the returned text)."""
        if self.params.logprobs is None or token_id == EOS_ID:
            return None
        top = tuple((token_id + k, -0.25 * (position % 4) - k) for k in range(self.params.logprobs))
        return TokenLogprob(token_id, -0.25 * (position % 4), top)

    async def _run(self):
        e, p = self.engine, self.params
        ids = {i: e.tokenizer.encode(e.scripts[i % len(e.scripts)], parse_special=False) + [EOS_ID]
               for i in range(p.n)}
        decoders = {i: codecs.getincrementaldecoder("utf-8")() for i in range(p.n)}
        texts = {i: "" for i in range(p.n)}
        done: set[int] = set()
        budget = p.max_tokens if p.max_tokens is not None else e.max_model_len - self.prompt_len
        await asyncio.sleep(e.first_delay_s)
        for pos in range(budget):
            for i in range(p.n):
                if i in done:
                    continue
                if self.error is not None:
                    raise self.error
                if self.request_id in e.aborted or not e.is_healthy:
                    if not e.is_healthy:
                        raise EngineDeadError("scripted engine died")
                    return
                tid = ids[i][pos]
                text = "" if tid == EOS_ID else decoders[i].decode(e.tokenizer.token_bytes(tid))
                finish = FinishReason.STOP if tid == EOS_ID else None
                full = texts[i] + text
                hit = next((s for s in p.stop if s in full), None)
                if hit is not None:
                    text, finish = full[:full.index(hit)][len(texts[i]):], FinishReason.STOP
                elif finish is None and pos + 1 == budget:
                    finish = FinishReason.LENGTH
                texts[i] += text
                lp = self._logprob(tid, pos)
                yield RequestOutput(self.request_id, i, [tid], text, [lp] if lp else None, finish, stop_reason=hit,
                                    num_prompt_tokens=self.prompt_len, num_cached_tokens=e.cached_tokens,
                                    num_output_tokens=pos + 1)
                if finish is not None:
                    done.add(i)
            if len(done) == p.n:
                self.finished = True
                return
            await asyncio.sleep(e.delay_s)


class ScriptedEngine:
    """AsyncEngine double.

    Args:
        scripts: text of sequence i is scripts[i % len(scripts)] followed by EOS.
        delay_s: pause between decode steps; first_delay_s: pause before the first (queue + prefill).
        max_model_len: context window (tokens).
        cached_tokens: reported `num_cached_tokens`.
        config: EngineConfig (default: model "test-model").
        tokenizer: the tokenizer (default: a ByteTokenizer).
    """

    def __init__(self, scripts=("Hello, world!",), delay_s=0.0, first_delay_s=0.0, max_model_len=256,
                 cached_tokens=0, config: EngineConfig | None = None, tokenizer=None):
        self.scripts = list(scripts)
        self.delay_s, self.first_delay_s = delay_s, first_delay_s
        self.max_model_len, self.cached_tokens = max_model_len, cached_tokens
        self.config = config or EngineConfig(model="test-model").validate()
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.chat_template = ChatMLTemplate()
        self.requests: list[tuple[list[int], SamplingParams, str]] = []  # (prompt ids, params, request id)
        self.aborted: list[str] = []
        self.healthy = True
        self.started = False

    @property
    def is_healthy(self) -> bool:
        return self.healthy

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.healthy = False

    def add_request(self, prompt_token_ids, params, request_id=None) -> ScriptedStream:
        if not self.healthy:
            raise EngineDeadError("scripted engine is dead")
        n = len(prompt_token_ids)
        check_request(prompt_token_ids, params, self.tokenizer.vocab_size, self.max_model_len)
        request_id = request_id or uuid.uuid4().hex
        self.requests.append((list(prompt_token_ids), params, request_id))
        return ScriptedStream(self, request_id, n, params)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def kv_stats(self) -> dict:
        return {"num_blocks": 16, "num_free_blocks": 16, "num_running": 0, "num_waiting": 0}


class StreamedEngine(ScriptedEngine):
    """ScriptedEngine whose requests come through a real `actors.stream.RequestStream` (fed by a task), as
    AsyncEngine's and ProcessEngine's do: the consumer side (merging, `interrupt()`, the stream `interval`) is the
    real one."""

    def __init__(self, *args, interval: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.interval = interval
        self._feeders: set[asyncio.Task] = set()

    def add_request(self, prompt_token_ids, params, request_id=None):
        from actors.stream import RequestStream

        scripted = super().add_request(prompt_token_ids, params, request_id)
        stream = RequestStream(scripted.request_id, params.n, self.abort, self.interval)

        async def feed() -> None:
            try:
                async for out in scripted:
                    stream.put(out)
            except Exception as exc:
                stream.fail(exc)

        task = asyncio.get_running_loop().create_task(feed())
        self._feeders.add(task)
        task.add_done_callback(self._feeders.discard)
        return stream


def hermes_call(name: str, arguments: str) -> str:
    """A tool call as Hermes-format models write it (`voltserve.parsers.hermes`)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class ChunkedStream:
    """A ScriptedStream whose deltas come `size` tokens at a time (as several tokens a step do, or a consumer
    that fell behind); everything else is the wrapped stream's."""

    def __init__(self, inner, size: int):
        self._inner, self._size = inner, size

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def _run(self):
        group: list[RequestOutput] = []
        async for out in self._inner:
            group.append(out)
            if len(group) == self._size or out.finish_reason is not None:
                last = group[-1]
                yield RequestOutput(last.request_id, last.index, [t for o in group for t in o.token_ids],
                                    "".join(o.text for o in group), None, last.finish_reason, last.stop_reason,
                                    last.num_prompt_tokens, last.num_cached_tokens, last.num_output_tokens)
                group = []

    def __aiter__(self):
        return self._run()


class ChunkedEngine(ScriptedEngine):
    """A ScriptedEngine whose deltas hold `size` tokens (by default the whole output: every tool call of a script
    arrives complete in one delta, cases T8 and T12)."""

    def __init__(self, *args, size: int = 4096, **kwargs):
        super().__init__(*args, **kwargs)
        self.size = size

    def add_request(self, prompt_token_ids, params, request_id=None):
        return ChunkedStream(super().add_request(prompt_token_ids, params, request_id), self.size)


class RecordingTemplate:
    """A chat template double that keeps what it was given."""

    source = ""

    def __init__(self):
        self.calls = []

    def render(self, messages, add_generation_prompt=True, tools=None, **kwargs) -> str:
        self.calls.append((messages, tools))
        return "prompt"


class ThinkingTemplate(ChatMLTemplate):
    """ChatML whose generation prompt opens the reasoning (`<think>\\n`), as DeepSeek-R1's and Qwen3's
    thinking-only templates do; with `enable_thinking=False` it writes an empty reasoning instead (Qwen3's)."""

    source = "{{ '<think>' }}"  # what `reasoning_parser` "auto" looks for

    def render(self, messages, add_generation_prompt=True, tools=None, **kwargs) -> str:
        text = super().render(messages, add_generation_prompt, tools)
        if not add_generation_prompt:
            return text
        return text + ("<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False else "<think>\n")
