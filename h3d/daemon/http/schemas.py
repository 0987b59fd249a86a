"""The OpenAI HTTP API's request and response bodies, as typed models (pydantic).

Requests are parsed strictly: a parameter OpenAI defines but h3d does not implement (`tools`,
`logprobs`, `response_format` other than text, `n` above 1, ...) is refused with a 400 naming it,
never accepted silently; its harmless values (`n: 1`, `logprobs: false`, an empty `tools` list)
pass. A parameter OpenAI does not define is refused too (`extra="forbid"`), except h3d's own
extensions, named in each model (`top_k`, `ignore_eos`). What the daemon answers is a model of
OpenAI's shape too (`ChatCompletion`, `ChatCompletionChunk`, `Completion`, `Response` and its
stream's events, `ErrorBody`), written with `dump`.
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


def _refuse_unsupported(values: dict[str, Any], names: list[str]) -> None:
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

    @model_validator(mode="after")
    def _no_padding(self) -> StreamOptions:
        if self.include_obfuscation:
            raise BadParam("stream_options.include_obfuscation", "h3d does not pad stream chunks",
                           code="unsupported_parameter")  # fmt: skip
        return self


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

    # A subclass declares each OpenAI parameter it does not implement as `name: Any = None`; its
    # values are checked here against the harmless ones (`_HARMLESS`).
    @model_validator(mode="before")
    @classmethod
    def _supported(cls, values: Any) -> Any:
        if isinstance(values, dict):
            _refuse_unsupported(values, [n for n, f in cls.model_fields.items() if f.annotation is Any])
        return values


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


# ---- what the daemon answers ---------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


def dump(model: BaseModel, usage: bool = True) -> str:
    """Compact JSON of every field; `usage=False` leaves `usage` out (a stream's chunks without
    `stream_options.include_usage` carry no `usage` key at all)."""
    return model.model_dump_json(exclude=None if usage else {"usage"})


class ErrorObject(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(_Out):
    error: ErrorObject


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> ErrorBody:
    return ErrorBody(error=ErrorObject(message=message, type=kind, param=param, code=code))


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "h3d"


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Deleted(_Out):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(_Out):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class _Reply(_Out):
    """What every completion, whole or a stream's chunk, starts with."""

    id: str
    created: int
    model: str
    system_fingerprint: None = None


class ChatCompletion(_Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Out):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = None  # set (null, or the last chunk's figures) only with include_usage


class TextChoice(_Out):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(_Reply):
    """A `text_completion`, whole or as a stream's chunk."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]
    usage: Usage | None = None


class OutputText(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(_Out):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(_Out):
    cached_tokens: int


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class Response(_Out):
    """OpenAI's Response object, for the subset h3d implements (text in, one message of text out)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = False
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Literal["none"] = "none"
    tools: list[Any] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class StreamEvent(_Out):
    """What every event of a Responses stream carries: its `type` (also its SSE `event:` name) and its place."""

    type: str
    sequence_number: int


class ResponseEvent(StreamEvent):
    """`response.created`, `.in_progress`, `.completed`, `.incomplete`."""

    response: Response


class OutputItemEvent(StreamEvent):
    """`response.output_item.added`, `.done`."""

    output_index: int = 0
    item: OutputMessage


class _InItem(StreamEvent):
    item_id: str
    output_index: int = 0
    content_index: int = 0


class ContentPartEvent(_InItem):
    """`response.content_part.added`, `.done`."""

    part: OutputText


class TextDeltaEvent(_InItem):
    """`response.output_text.delta`."""

    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(_InItem):
    """`response.output_text.done`."""

    text: str
    logprobs: list[Any] = Field(default_factory=list)
