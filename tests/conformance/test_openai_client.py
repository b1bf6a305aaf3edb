"""The official `openai` client against slotkeeper over a real llama-server (checklist 8.2).

The tiny model writes gibberish: assertions are on shapes, counts, statuses and headers, never on text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support import Slotkeeper, words

pytestmark = pytest.mark.backend

USER: list[Any] = [{"role": "user", "content": "Say something about the weather."}]
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(keeper: Slotkeeper) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=keeper.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(keeper: Slotkeeper) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keeper.url, timeout=120) as c:
        yield c


# -- models ------------------------------------------------------------------------------------------------------


def test_models_list(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    model = models.data[0]
    assert model.object == "model" and isinstance(model.created, int) and model.owned_by
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["has_more"] is False
    assert raw["first_id"] == raw["last_id"] == "tiny"
    assert raw["data"][0]["meta"]["n_ctx"] == 8192


def test_models_retrieve_and_404(client: openai.OpenAI) -> None:
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.status_code == 404


# -- chat ------------------------------------------------------------------------------------------------------------


def test_chat_not_streamed_has_usage_with_cached_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Cache me. " + words(300, 3)}, *USER]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                           extra_headers={"X-Session-Id": "usage"})
    second = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                                              extra_headers={"X-Session-Id": "usage"})
    completion = second.parse()
    assert first.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1  # type: ignore[union-attr]
    assert second.headers["x-slotkeeper-cache"] == "hot"
    assert completion.model_extra is not None and "timings" in completion.model_extra  # llama-server's extra


def test_chat_stream_shape_with_include_usage(client: openai.OpenAI) -> None:
    # llama-server sends the role with its first streamed piece of text; when a random-weight model's first token is
    # an incomplete UTF-8 byte, that piece comes with the second token and carries no role (6% of plain requests,
    # directly and through slotkeeper alike). Letters only, so the first token is text.
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, stream=True,  # type: ignore[arg-type]
                                                 stream_options={"include_usage": True},
                                                 extra_body={"grammar": "root ::= [a-z ]+"}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert with_choices[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert 0 < chunks[-1].usage.completion_tokens <= 6
    assert chunks[-1].usage.prompt_tokens_details is not None


def test_chat_stream_raw_ends_with_done(http: httpx.Client) -> None:
    body = {"messages": USER, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    assert text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_tools_and_tool_history_accepted(client: openai.OpenAI, stream: bool) -> None:
    # The tiny model's template cannot render tools: llama-server accepts them and the model answers in text.
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    result = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="auto",  # type: ignore[call-overload]
                                            max_tokens=3, stream=stream)
    if stream:
        chunks = list(result)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    else:
        assert result.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("extra_headers", "extra_body", "expected"),
    [
        ({"X-Session-Id": "hdr"}, {}, "hdr"),
        ({}, {"session_id": "body"}, "body"),
        ({"X-Session-Id": "hdr"}, {"session_id": "body"}, "hdr"),
        ({"Conversation-Id": "conv"}, {"chat_id": "chat"}, "conv"),
        ({}, {"conversation_id": "c2", "chat_id": "c3"}, "c2"),
    ],
    ids=["header", "body", "header-wins", "conversation-header", "body-order"],
)
def test_session_ids_from_extra_headers_and_body(client: openai.OpenAI, extra_headers: dict[str, str],
                                                 extra_body: dict[str, str], expected: str) -> None:
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=USER, max_tokens=1,  # type: ignore[arg-type]
                                                           extra_headers=extra_headers, extra_body=extra_body)
    assert raw.headers["x-slotkeeper-session"] == expected
    assert raw.parse().choices


@pytest.mark.parametrize(
    "extra",
    [{"thinking_budget_tokens": 0}, {"chat_template_kwargs": {"enable_thinking": False}},
     {"reasoning_effort": "none"}, {"return_progress": True}, {"timings_per_token": True},
     {"top_k": 5, "min_p": 0.05, "seed": 7}],
    ids=["thinking-budget", "template-kwargs", "reasoning-effort", "return-progress", "timings-per-token",
         "sampling"],
)
def test_llama_server_extras_pass_through(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    completion = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, extra_body=extra)  # type: ignore[arg-type]
    assert completion.choices[0].message.role == "assistant"


def test_response_format_reaches_the_backend(client: openai.OpenAI) -> None:
    # The tiny model's vocabulary cannot build a JSON grammar: llama-server's own 400 proves the field got there.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=3,
                                       response_format={"type": "json_object"})
    assert "sampler" in info.value.message


def test_return_progress_chunks_reach_the_client(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": words(3000, 4)}], "max_tokens": 2, "stream": True,
            "return_progress": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        text = response.read().decode()
    assert text.count('"prompt_progress"') >= 1


# -- errors ------------------------------------------------------------------------------------------------------


def test_bad_request_error_class(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=1)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_context_overflow_is_a_400(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        result = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x " * 9000}],
                                                max_tokens=2, stream=stream)
        if stream:
            list(result)  # type: ignore[arg-type]
    assert info.value.body["type"] == "exceed_context_size_error"  # type: ignore[index]


# -- completions, embeddings, responses --------------------------------------------------------------------------


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3)
    assert completion.choices[0].text is not None and completion.usage is not None
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_embeddings_not_supported_is_a_clear_501(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.embeddings.create(model="tiny", input="hello")
    assert info.value.status_code == 501
    assert info.value.body["type"] == "not_supported_error"  # type: ignore[index]
    assert "embeddings" in info.value.message


def test_embeddings_without_input_is_a_400(http: httpx.Client) -> None:
    response = http.post("/v1/embeddings", json={"model": "tiny"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_responses_pass_through_under_session_control(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(model="tiny", input="Hello there", max_output_tokens=3,
                                                    instructions="Be brief.")
    response = raw.parse()
    assert response.object == "response" and response.usage is not None
    assert raw.headers["x-slotkeeper-session"].startswith("sys-")  # `instructions` is the system prompt
    again = client.responses.with_raw_response.create(model="tiny", input="Hello there", max_output_tokens=3,
                                                      extra_headers={"X-Session-Id": "resp"})
    assert again.headers["x-slotkeeper-session"] == "resp"


def test_responses_stream(client: openai.OpenAI) -> None:
    # As in the chat stream test: llama-server sends response.created with the first piece of text, so a random
    # model whose first tokens are incomplete UTF-8 bytes gets a stream without it (2 of 100 requests, directly).
    events = list(client.responses.create(model="tiny", input="Hello there", max_output_tokens=3, stream=True,
                                          extra_body={"grammar": "root ::= [a-z ]+"}))
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"


def test_responses_without_input_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=[], max_output_tokens=3)
