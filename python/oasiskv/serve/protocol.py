"""The OpenAI wire format: request models (validated, unknown fields refused) and response builders.

Requests are pydantic models with ``extra="forbid"`` and ``strict=True``: an unknown field, a
string where a number belongs or a float where an int belongs is a 400, never a silent coercion.
Fields OpenAI defines but OasisKV does not implement (``n > 1``, ``logprobs``, ``echo``,
penalties, ``logit_bias``, ``suffix``, ``best_of > 1``) are accepted only at their neutral value,
so a client that sends the default still works and one that relies on the feature is told.

Responses are plain dicts (the shapes of OpenAI's ``Completion``, ``ChatCompletion`` and their
stream chunks), built by the ``*_response`` / ``*_chunk`` helpers below.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

#: Most stop strings per request, and the longest one (characters). Arbitrary (OpenAI allows 4).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64

_Float = Annotated[float, Field(strict=True)]
_Stop = StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None


class UnsupportedParameter(ValueError):
    """A request asks for something the server does not implement (``param`` names the field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(strict=True, ge=0, lt=2**63)] | None = None
    stop: _Stop = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    presence_penalty: _Float | None = None
    frequency_penalty: _Float | None = None
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None
    #: OasisKV extension (as vLLM's): keep generating past end-of-sequence tokens.
    ignore_eos: StrictBool = False

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

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedParameter` for a field set to a value the server cannot honour."""
        if self.n not in (None, 1):
            raise UnsupportedParameter("n", "only n=1 is supported; send n requests instead")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise UnsupportedParameter(name, f"{name} is not supported; leave it unset or 0")
        if self.logit_bias:
            raise UnsupportedParameter("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter("stream_options", "stream_options needs stream=true")
        self.stop_strings()


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: StrictStr | list[StrictInt] | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise UnsupportedParameter("logprobs", "logprobs is not supported; leave it unset")
        if self.echo:
            raise UnsupportedParameter("echo", "echo is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedParameter("best_of", "only best_of=1 is supported")
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix is not supported")

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids (a list holding one string counts as that string)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs is not None:
            raise UnsupportedParameter("logprobs", "logprobs is not supported; leave it unset")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise UnsupportedParameter(
                "max_completion_tokens", "pass max_tokens or max_completion_tokens, not both"
            )

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


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


def completion_response(rid: str, model: str, text: str, finish: str, n_prompt: int, n_out: int) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": usage(n_prompt, n_out),
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
    }


def chat_response(rid: str, model: str, text: str, finish: str, n_prompt: int, n_out: int) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": None,
            }
        ],
        "usage": usage(n_prompt, n_out),
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }


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
