"""Request-side types: SamplingParams (what the client asked for) and RequestOutput (what it gets back)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from voltserve.errors import ContextLengthError, InvalidRequestError

MAX_LOGPROBS = 20
# below this temperature sampling is greedy (as vLLM does): dividing logits by ~0 only overflows
GREEDY_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 2**31 - 1  # the CUDA sampler's int32 field; any k at or above the vocabulary size keeps every token


class FinishReason(str, enum.Enum):
    """Why a sequence stopped. Values are the OpenAI `finish_reason` strings."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # aborted by the client or the server


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop (OpenAI / vLLM semantics).

    Attributes:
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability mass reaches top_p, in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 = all.
        min_p: drop tokens whose probability is below min_p times the top token's, in [0, 1].
        seed: per-request generator seed; None draws from the engine's generator.
        max_tokens: most output tokens; None = up to the context window.
        min_tokens: EOS and stop ids are masked until this many tokens are out, and stop strings that end in
            their text are ignored (`detok.IncrementalDetokenizer`).
        stop: stop strings; the matched text is not returned.
        stop_token_ids: extra token ids that end the sequence (the token is not returned as text).
        ignore_eos: keep going past EOS.
        presence_penalty / frequency_penalty: OpenAI penalties on output tokens, in [-2, 2].
        repetition_penalty: CTRL-style penalty on prompt and output tokens, > 0 (1 = off).
        n: sequences to generate for the prompt.
        logprobs: None = no logprobs; k >= 0 = the sampled token's logprob plus the top-k alternatives.
        include_stop_str_in_output: keep the matched stop string in the text.
        grammar: an llguidance grammar (`voltserve.grammar`: a JSON schema's, forced tool calls') the output must
            follow; None = free text. Such sequences are sampled on the host, one step at a time.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    grammar: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self, max_tokens_name: str = "max_tokens") -> "SamplingParams":
        """Range checks. Raises InvalidRequestError with `param` set to the field name. Returns self.

        Args:
            max_tokens_name: the request's name for `max_tokens` (e.g. Responses' `max_output_tokens`), used in
                the messages and `param` of the errors about it.
        """
        numbers = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        for name in numbers:
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a finite number", param=name)
        checks = [
            (self.temperature >= 0, "temperature", "temperature must be >= 0"),
            (self.temperature <= MAX_TEMPERATURE, "temperature", f"temperature must be <= {MAX_TEMPERATURE:g}"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "top_k must be -1, 0 or positive"),
            (self.top_k <= MAX_TOP_K, "top_k", f"top_k must be <= {MAX_TOP_K}"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (self.max_tokens is None or self.max_tokens >= 1, max_tokens_name, f"{max_tokens_name} must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0"),
            (self.n >= 1, "n", "n must be >= 1"),
            (self.n <= 128, "n", "n must be <= 128"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (0.01 <= self.repetition_penalty <= 100, "repetition_penalty",
             "repetition_penalty must be in [0.01, 100]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be between 0 and {MAX_LOGPROBS}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (len(self.stop) <= 16, "stop", "at most 16 stop strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative token ids"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be <= {max_tokens_name}", param="min_tokens")
        return self


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one output token and, when asked, of the top alternatives at its position.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability under the model's distribution (before temperature/top-p filtering).
        top: [(token_id, logprob)] sorted by descending logprob; `logprobs` entries long.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One delta of one sequence of a request, as streamed by `AsyncEngine.generate()`.

    Attributes:
        request_id: the request this delta belongs to.
        index: which of the request's `n` sequences (the OpenAI choice index).
        token_ids: token ids new in this delta.
        text: text new in this delta (whole UTF-8 characters only; stop strings removed).
        logprobs: when the request asked for logprobs, one TokenLogprob per token whose text this delta releases
            (`IncrementalDetokenizer.num_text_tokens`: they follow the text, so they may lag `token_ids`, and the
            tokens left out of the final text, such as the EOS or stop token, never get one); else None.
        finish_reason: set on the sequence's last delta.
        stop_reason: the stop string or stop token id that ended it, when one did.
        num_prompt_tokens: prompt length in tokens.
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_output_tokens: output tokens so far (cumulative).
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def prompt_fills_context(max_model_len: int, num_tokens: str, param: str = "messages") -> ContextLengthError:
    """The ContextLengthError of a prompt that leaves no room for output; `num_tokens` as the message gives the
    prompt's length ("812", or "at least 8889" for a bound)."""
    return ContextLengthError(f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                              f"{num_tokens} tokens (no room for any output).", param=param)


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> int:
    """Validate a request against the model before it is queued.

    Args:
        prompt_token_ids: [num_prompt_tokens] token ids.
        params: the request's sampling parameters (validated here).
        vocab_size: the model's vocabulary size.
        max_model_len: context window in tokens (prompt + output).
    Returns:
        The output token budget: params.max_tokens, or the rest of the context when it is None.
    Raises:
        InvalidRequestError: empty prompt, ids outside the vocabulary, bad parameters, min_tokens above the
            budget (without max_tokens, the rest of the context).
        ContextLengthError: the prompt (plus max_tokens) does not fit the context; the message names both lengths.
    """
    params.validate()
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    if num_prompt >= max_model_len:
        raise prompt_fills_context(max_model_len, str(num_prompt))
    return check_output_budget(num_prompt, params, max_model_len)


def check_output_budget(num_prompt: int, params: SamplingParams, max_model_len: int,
                        max_tokens_name: str = "max_tokens") -> int:
    """The part of `check_request` that is about the output budget, for a prompt that leaves room for output.

    Args:
        num_prompt: the prompt's length in tokens (< max_model_len).
        params: the request's (validated) sampling parameters.
        max_model_len: context window in tokens (prompt + output).
        max_tokens_name: the request's name for `max_tokens` (Responses: `max_output_tokens`; Chat Completions:
            `max_completion_tokens` where given), used in the messages and `param` of the errors.
    Returns:
        The output token budget: params.max_tokens, or the rest of the context when it is None.
    Raises:
        ContextLengthError: the prompt plus max_tokens does not fit the context (param `max_tokens_name`).
        InvalidRequestError: min_tokens above the rest of the context, without max_tokens (param "min_tokens").
    """
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the completion). "
            f"Reduce the prompt or {max_tokens_name}.", param=max_tokens_name)
    if params.min_tokens > max_tokens:
        # only without max_tokens (validate() compared the two): the context's rest is the budget, and a min_tokens
        # past it would mask EOS until the window is full, then end "length" short of min_tokens anyway
        raise InvalidRequestError(
            f"min_tokens ({params.min_tokens}) must be <= {max_tokens_name}; without {max_tokens_name} that is the "
            f"rest of the context window: {max_tokens} tokens ({max_model_len} less {num_prompt} in the prompt)",
            param="min_tokens")
    return max_tokens
