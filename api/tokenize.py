"""POST /tokenize and POST /detokenize, with vLLM's request and response shapes (its `TokenizeCompletionRequest`,
`TokenizeChatRequest`, `TokenizeResponse`, `DetokenizeRequest`, `DetokenizeResponse`).

/tokenize takes a text `prompt`, read as /v1/completions reads one (special-token text is those tokens; BOS by
`add_special_tokens`, on by default), or chat `messages`, read through the path of /v1/chat/completions
(`api.openai.chat_prompt.chat_prompt_ids`): with the defaults its ids are the prompt a chat request with those
messages, tools and `chat_template_kwargs` runs. A prompt too long for the context is counted, not refused.
/detokenize keeps special tokens in the text, as vLLM's does. `model` may be left out; when given it must name
the served model (404 otherwise, as on every OpenAI route).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from quart import Blueprint

from api.openai.chat_prompt import chat_prompt_ids
from api.openai.common import check_token_ids, json_response, prompt_work, request_body
from api.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTool, parse_request
from api.state import get_state
from voltserve.errors import InvalidRequestError

bp = Blueprint("tokenize", __name__)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokenizeRequest(_Request):
    """vLLM's two /tokenize bodies in one: exactly one of `prompt` and `messages`. The chat fields are read with
    `messages` only.

    `add_special_tokens` None takes vLLM's defaults: on for a prompt, off for messages (their template writes the
    special tokens). `add_generation_prompt` None: on, unless `continue_final_message`.
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # refused unless trusted, as by the chat route (case S7)
    media_io_kwargs: dict[str, Any] | None = None

    template_tools = ChatCompletionRequest.template_tools  # what `chat_prompt_ids` renders


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with `return_token_strs`: each token as the vocabulary spells it


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _ready_engine(model: str | None):
    """The engine, after checking `model` when the request names one.

    Raises:
        ModelNotFoundError: another model (404); InvalidRequestError: an empty name.
        EngineDeadError, ServerShuttingDownError: as `ServerState.ready_engine`.
    """
    state = get_state()
    if model is not None:
        state.check_model(model)
    return state.ready_engine()


async def _chat_ids(engine, req: TokenizeRequest) -> list[int]:
    """The ids of `req.messages`, as the chat route renders and tokenizes them (options aside)."""
    add_generation_prompt = req.add_generation_prompt
    if req.continue_final_message and add_generation_prompt:
        raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                  param="continue_final_message")
    if add_generation_prompt is None:
        add_generation_prompt = not req.continue_final_message
    ids = await chat_prompt_ids(engine, req, get_state().config.trust_request_mm_kwargs, check_fit=False,
                                add_generation_prompt=add_generation_prompt,
                                continue_final=req.continue_final_message)
    if req.add_special_tokens:  # what `encode` adds for them (BOS where the model asks), ahead of the template's
        ids = engine.tokenizer.encode("", add_special_tokens=True) + ids
    return ids


def _token_strs(tokenizer, ids: list[int]) -> list[str]:
    """Each id's token as the vocabulary spells it (byte-level BPE: "Ġ" for a leading space), as vLLM returns."""
    return [tokenizer.id_to_token(i) for i in ids]


@bp.post("/tokenize")
async def tokenize():
    """A prompt's or chat messages' token ids, their count and the context window."""
    req = parse_request(TokenizeRequest, await request_body())
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give either 'prompt' (a string) or 'messages', not both"
                                  if req.prompt is not None else "missing required field 'prompt' or 'messages'",
                                  param="prompt")
    engine = _ready_engine(req.model)
    tokenizer = engine.tokenizer
    if req.prompt is not None:
        add_special = req.add_special_tokens is not False
        ids = await prompt_work(len(req.prompt), tokenizer.encode, req.prompt, add_special, True)
    else:
        ids = await _chat_ids(engine, req)
    # a Python loop over the ids: off the event loop for long prompts, as the encoding above
    strs = await prompt_work(len(ids), _token_strs, tokenizer, ids) if req.return_token_strs else None
    return json_response(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                          token_strs=strs))


@bp.post("/detokenize")
async def detokenize():
    """Token ids -> text, special tokens kept (400 with param "tokens" for an id outside the vocabulary)."""
    req = parse_request(DetokenizeRequest, await request_body())
    engine = _ready_engine(req.model)
    check_token_ids(engine.tokenizer, req.tokens, "tokens")
    text = await prompt_work(len(req.tokens), engine.tokenizer.decode, req.tokens, False)
    return json_response(DetokenizeResponse(prompt=text))
