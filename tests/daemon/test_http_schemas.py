"""The HTTP API's request models and error mapping, without a daemon (h3d.daemon.http.schemas,
h3d.daemon.status.http_status_of): what passes, what is refused and how it is named."""

from __future__ import annotations

from typing import Any

import pytest

from h3d.daemon.http.schemas import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from h3d.daemon.status import HTTP, BadParam, Draining, Overloaded, http_status_of
from h3d.errors import ContextTooLong, H3Error, SessionBusy, SessionNotFound

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "harmless",
    [{"n": 1}, {"logprobs": False}, {"tools": []}, {"tool_choice": "none"}, {"response_format": {"type": "text"}},
     {"stream_options": {"include_usage": True}}, {"user": "u-1"}, {"store": False}, {"parallel_tool_calls": True}],
)  # fmt: skip
def test_default_values_of_unimplemented_parameters_pass(harmless: dict[str, Any]) -> None:
    ChatCompletionRequest.model_validate({**CHAT, **harmless})


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"n": 3}, "n"), ({"n": True}, "n"), ({"logit_bias": {"5": 10}}, "logit_bias"), ({"store": True}, "store"),
     ({"tools": [{"type": "function"}]}, "tools"), ({"audio": {"voice": "x"}}, "audio")],
)  # fmt: skip
def test_unimplemented_parameters_are_named(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(BadParam) as e:
        ChatCompletionRequest.model_validate({**CHAT, **extra})
    assert e.value.param == param and e.value.code == "unsupported_parameter"


def test_stream_padding_is_refused() -> None:
    ChatCompletionRequest.model_validate({**CHAT, "stream_options": {"include_obfuscation": False}})
    with pytest.raises(BadParam) as e:
        ChatCompletionRequest.model_validate({**CHAT, "stream_options": {"include_obfuscation": True}})
    assert e.value.param == "stream_options.include_obfuscation"


def test_messages_as_the_template_reads_them() -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ]}
    )  # fmt: skip
    assert [m.as_chat() for m in body.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    with pytest.raises(BadParam):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x", "name": "n"}]}
        )


def test_completion_prompts() -> None:
    def one(prompt: Any) -> tuple[str | None, list[int] | None]:
        return CompletionRequest.model_validate({"model": "m", "prompt": prompt}).one_prompt()

    assert one("text") == ("text", None)
    assert one([1, 2]) == (None, [1, 2])
    assert one(["only"]) == ("only", None)
    assert one([[3, 4]]) == (None, [3, 4])
    for batch in (["a", "b"], [[1], [2]]):
        with pytest.raises(BadParam, match="one prompt per request"):
            one(batch)


def test_responses_input() -> None:
    assert ResponsesRequest.model_validate({"model": "m", "input": "hi"}).messages() == [
        {"role": "user", "content": "hi"}
    ]
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}]
    assert ResponsesRequest.model_validate({"model": "m", "input": items}).messages() == [
        {"role": "user", "content": "q"}
    ]
    with pytest.raises(BadParam, match="metadata"):
        ResponsesRequest.model_validate({"model": "m", "input": "x", "metadata": {str(i): "v" for i in range(17)}})
    with pytest.raises(BadParam) as e:
        ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": [{"type": "web_search"}]})
    assert e.value.param == "tools"


def test_every_error_class_has_an_http_status() -> None:
    assert http_status_of(SessionNotFound("x"))[0] == 404
    assert http_status_of(SessionBusy("x"))[0] == 409  # before InvalidRequest, its base
    assert http_status_of(ContextTooLong("x"))[:3] == (400, "invalid_request_error", "context_length_exceeded")
    assert http_status_of(Overloaded("x", 100))[:2] == (429, "rate_limit_error")
    assert http_status_of(Draining("x"))[0] == 503
    assert http_status_of(ValueError("a bug"))[0] == 500
    assert http_status_of(BadParam("p", "bad", code="c"))[2] == "c"
    for i, (cls, *_) in enumerate(HTTP):  # most specific first: no class shadowed by one before it
        assert not any(issubclass(cls, earlier) for earlier, *_ in HTTP[:i]), cls
    assert HTTP[-1][0] is H3Error
