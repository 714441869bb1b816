"""The OpenAI wire format: request models (validated, unknown fields refused) and response builders.

Requests are pydantic models with ``extra="forbid"`` and ``strict=True``: an unknown field, a
string where a number belongs or a float where an int belongs is a 400, never a silent coercion.

Implemented as vLLM implements them: ``n``, ``logprobs`` / ``top_logprobs``, ``echo``
(completions), ``max_completion_tokens`` (chat), ``stream_options.include_usage``, ``seed``,
``stop``, assistant messages with ``content: null`` and ``tool_calls``, and ``tool`` messages
(rendered through the chat template, so a recorded tool conversation replays).

Fields OpenAI defines but OasisKV does not implement (:data:`UNSUPPORTED_FIELDS`: tools and
function calling, structured output, penalties, ``logit_bias``, ``suffix``, ``best_of``, audio,
...) are accepted only at a value that asks for nothing (``response_format: {"type": "text"}``,
``tool_choice: "none"``, ``parallel_tool_calls`` without tools, a zero penalty); any other value is
an :class:`UnsupportedParameter` (HTTP 400, code ``unsupported_parameter``) naming the field.

Responses are plain dicts (the shapes of OpenAI's ``Completion``, ``ChatCompletion`` and their
stream chunks), built by the ``*_response`` / ``*_chunk`` helpers below.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

#: Most stop strings per request, and the longest one (characters). Arbitrary (OpenAI allows 4).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
#: Most choices per request (``n``). Arbitrary: each choice is a request of its own in the engine.
MAX_N = 16
#: Most alternatives per token (``logprobs`` / ``top_logprobs``): vLLM's default ``max_logprobs``.
MAX_LOGPROBS = 20

_Float = Annotated[float, Field(strict=True)]
_Stop = StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None
_MaxTokens = Annotated[int, Field(strict=True, ge=1)] | None

#: Fields of OpenAI's API that the server does not implement, with the values that ask for
#: nothing (accepted and ignored). Any other value is refused as ``unsupported_parameter``.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None,),
    "tool_choice": (None, "none"),
    "functions": (None,),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "metadata": (None,),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    "suffix": (None, ""),
}
_WHY = {
    "tools": "tool calling is not supported; send the tools' descriptions in the messages instead",
    "tool_choice": "tool calling is not supported; only tool_choice 'none' is accepted",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "structured output is not supported; only response_format {'type': 'text'} "
    "is accepted",
}


def _is_neutral(value: Any, neutral: tuple) -> bool:
    """Whether ``value`` is one of ``neutral`` (bools apart from numbers: ``True`` is not 1)."""
    for v in neutral:
        if isinstance(value, bool) or isinstance(v, bool) or not isinstance(value, int | float):
            same_kind = type(value) is type(v)
        else:
            same_kind = isinstance(v, int | float)
        if same_kind and value == v:
            return True
    return False


class UnsupportedParameter(ValueError):
    """A request asks for something the server does not implement (``param`` names the field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: StrictBool | None = False


class _SamplingFields(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(strict=True, ge=0, lt=2**63)] | None = None
    stop: _Stop = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] | None = None
    user: StrictStr | None = None
    #: OasisKV extension (as vLLM's): keep generating past end-of-sequence tokens.
    ignore_eos: StrictBool = False
    # OpenAI fields the server does not implement (UNSUPPORTED_FIELDS): typed loosely, so that a
    # value asking for the feature is refused by name (``unsupported_parameter``), not as a type.
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stops:
            if not s:
                raise UnsupportedParameter("stop", "stop strings must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise UnsupportedParameter(
                    "stop", f"stop strings must be at most {MAX_STOP_CHARS} characters"
                )
        return stops

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        """Whether a stream carries ``"usage"`` (null on every chunk but the last)."""
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedParameter` for a field set to a value the server cannot honour."""
        for name, neutral in UNSUPPORTED_FIELDS.items():
            if name in type(self).model_fields and not _is_neutral(getattr(self, name), neutral):
                why = _WHY.get(name, f"{name} is not supported")
                raise UnsupportedParameter(name, f"{why}; leave {name} unset")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter("stream_options", "stream_options needs stream=true")
        self.stop_strings()


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: StrictStr | list[StrictInt] | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
    #: OpenAI's default for completions (absent: 16); ``null``: the server's default.
    max_tokens: _MaxTokens = 16
    logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1, self.num_choices):
            raise UnsupportedParameter("best_of", "best_of is not supported; leave it unset or equal to n")
        if self.echo and self.logprobs is not None:
            raise UnsupportedParameter(
                "echo", "echo with logprobs (the prompt's log-probabilities) is not supported; drop one"
            )

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids (a list holding one string counts as that string)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: StrictStr
    arguments: StrictStr


class ToolCall(BaseModel):
    """A tool call an assistant message made (replayed history; the server never makes one)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    #: null only in an assistant message (one that made tool calls, say).
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: StrictStr | None = None  # tool messages: the call this answers
    refusal: StrictStr | None = None  # assistant messages

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (only an assistant's may be null)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message may carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id, the id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message may carry tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (Hugging Face's conventions): ``role`` and
        ``content`` (text; "" for null), plus ``tool_calls`` / ``tool_call_id`` / ``name`` when
        given. A template that knows no tools renders a tool call's message by its content alone."""
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        d: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls is not None:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: _MaxTokens = None
    max_completion_tokens: _MaxTokens = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise UnsupportedParameter(
                "max_completion_tokens", "pass max_tokens or max_completion_tokens, not both"
            )

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


# ---------------------------------------------------------------------- responses
def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its alternatives, as the responses show them:
    ``token`` its text, ``bytes`` its UTF-8 bytes (a piece of a character has bytes but no text of
    its own), ``top`` the most likely tokens as ``(token, bytes, logprob)``, most likely first."""

    token: str
    bytes: list[int]
    logprob: float
    top: list[tuple[str, list[int], float]]


#: The floor of a reported log-probability: JSON has no -inf (vLLM's clamp).
LOGPROB_FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """OpenAI's ``ChoiceLogprobs`` of a chat choice (or of one stream chunk's tokens)."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _lp(e.logprob),
                "bytes": e.bytes,
                "top_logprobs": [{"token": t, "logprob": _lp(v), "bytes": b} for t, b, v in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[TokenLogprob], offsets: list[int]) -> dict:
    """The legacy completions ``logprobs`` object: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (a ``{token: logprob}`` per token: the alternatives and the token itself)
    and ``text_offset`` (where each token's text starts in the choice's text)."""
    tops = []
    for e in entries:
        d = {t: _lp(v) for t, _, v in e.top}
        d.setdefault(e.token, _lp(e.logprob))
        tops.append(d)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_lp(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def chat_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "tool_calls": []},
        "finish_reason": finish,
        "logprobs": logprobs,
    }


def chat_delta(index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}


def completion_response(rid: str, model: str, choices: list[dict], n_prompt: int, n_out: int) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(n_prompt, n_out),
    }


def chat_response(rid: str, model: str, choices: list[dict], n_prompt: int, n_out: int) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(n_prompt, n_out),
    }


def chunk(rid: str, obj: str, model: str, created: int, choices: list[dict], with_usage: bool) -> dict:
    """A stream chunk (``obj``: ``"text_completion"`` or ``"chat.completion.chunk"``). With
    ``stream_options.include_usage`` every chunk but the last carries ``"usage": null``."""
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(rid: str, obj: str, model: str, created: int, n_prompt: int, n_out: int) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(n_prompt, n_out),
    }
