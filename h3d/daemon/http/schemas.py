"""The OpenAI HTTP API's request and response bodies, as typed models (pydantic).

Requests are parsed strictly: a parameter OpenAI defines but h3d does not implement (`tools`,
`logprobs`, `response_format` other than text, `n` above 1, ...) is refused with a 400 naming it,
never accepted silently; its harmless values (`n: 1`, `logprobs: false`, an empty `tools` list)
pass. A parameter OpenAI does not define is refused too (`extra="forbid"`), except h3d's own
extensions, named in each model (`top_k`, `ignore_eos`). Responses are built as dicts in OpenAI's
shapes (`chat_completion`, `chunk`, `response_object`, ...): the SDKs read them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from h3d.daemon.status import BadParam
from h3d.engine.sampling import MAX_PENALTY

# Parameters OpenAI defines that h3d does not implement, with the values that ask for nothing
# (accepted: an SDK or a framework may send them as defaults).
_HARMLESS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "reasoning": (None, {}),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "include": (None, []),
    "background": (None, False),
    "truncation": (None, "disabled"),
    "text": (None, {"format": {"type": "text"}}),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "conversation": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    "verbosity": (None,),
}


def _refuse_unsupported(values: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = values.get(name)
        if not any(value == ok and type(value) is type(ok) for ok in _HARMLESS[name]):
            raise BadParam(name, f"h3d does not support {name}={_short(value)}", code="unsupported_parameter")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream chunks: h3d adds none


class TextPart(_Strict):
    type: Literal["text", "input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text parts of earlier responses echo them back


class Message(_Strict):
    """A chat message. `developer` is OpenAI's name for a system message (rendered as one)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    type: Literal["message"] | None = None  # the Responses API's input items carry it
    id: str | None = None  # an earlier response's output item, sent back as input
    status: str | None = None

    @model_validator(mode="after")
    def _plain(self) -> Message:
        if self.name is not None:
            raise BadParam("name", "h3d does not support message names", code="unsupported_parameter")
        return self

    def as_chat(self) -> dict[str, str]:
        """{role, content} as the chat template reads it (the parts' texts joined)."""
        content = self.content
        text = "".join(p.text for p in content) if isinstance(content, list) else content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class _Sampling(_Strict):
    """What the three generating endpoints share: sampling and stop rules, and h3d's extensions."""

    model: str
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    user: str | None = None  # an end user's id: logged, nothing else
    # h3d's extensions (vLLM's names)
    top_k: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    verbosity: Any = None

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, values: Any) -> Any:
        if isinstance(values, dict):
            _refuse_unsupported(values, (
                "n", "logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "functions",
                "function_call", "parallel_tool_calls", "response_format", "modalities", "audio", "prediction",
                "reasoning_effort", "web_search_options", "service_tier", "store", "metadata", "prompt_cache_key",
                "safety_identifier", "verbosity",
            ))  # fmt: skip
        return values

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: Any = None
    best_of: Any = None
    logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    logit_bias: Any = None

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, values: Any) -> Any:
        if isinstance(values, dict):
            _refuse_unsupported(values, ("n", "best_of", "logprobs", "echo", "suffix", "logit_bias"))
        return values

    def one_prompt(self) -> tuple[str | None, list[int] | None]:
        """(text, token ids): the one prompt of the request (a list of several is refused)."""
        p = self.prompt
        if isinstance(p, str):
            return p, None
        if not p:
            raise BadParam("prompt", "is empty")
        if all(isinstance(x, int) for x in p):
            return None, [int(x) for x in p]  # type: ignore[arg-type]
        if len(p) > 1:
            raise BadParam("prompt", "h3d takes one prompt per request, got a batch", code="unsupported_parameter")
        only = p[0]
        return (only, None) if isinstance(only, str) else (None, list(only))  # type: ignore[arg-type]


class ResponsesRequest(_Sampling):
    input: str | list[Message]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    text: Any = None
    reasoning: Any = None
    include: Any = None
    background: Any = None
    truncation: Any = None
    service_tier: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, values: Any) -> Any:
        if isinstance(values, dict):
            _refuse_unsupported(values, (
                "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning", "include", "background",
                "truncation", "service_tier", "top_logprobs", "max_tool_calls", "prompt", "conversation",
                "prompt_cache_key", "safety_identifier",
            ))  # fmt: skip
        return values

    @model_validator(mode="after")
    def _bounded(self) -> ResponsesRequest:
        if self.metadata is not None and len(self.metadata) > 16:
            raise BadParam("metadata", f"at most 16 keys, got {len(self.metadata)}")
        return self

    def messages(self) -> list[dict[str, str]]:
        """The input as chat messages (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise BadParam("input", "is empty")
        return [m.as_chat() for m in self.input]


def stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# ---- responses -----------------------------------------------------------------------------


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_completion(
    rid: str, created: int, model: str, text: str, finish: str, usage_: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": usage_,
    }


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, Any] | None, finish: str | None, with_usage: bool
) -> dict[str, Any]:
    """A `chat.completion.chunk`; `delta` None: the usage chunk (no choices)."""
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if with_usage:
        out["usage"] = None
    return out


def completion(
    rid: str, created: int, model: str, text: str, finish: str | None, usage_: dict[str, Any] | None, chunk: bool
) -> dict[str, Any]:
    """A `text_completion`, whole or as a stream's chunk (`usage_` None: none given; a chunk with
    `text` None... is the usage chunk, made by the caller with no choices)."""
    out: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if usage_ is not None or chunk:
        out["usage"] = usage_
    return out
