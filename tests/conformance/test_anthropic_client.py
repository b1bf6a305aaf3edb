"""The official `anthropic` client against slotkeeper over a real llama-server (checklist 8.3).

The tiny model writes gibberish: assertions are on shapes, counts, stop reasons, statuses and headers, never text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.support import Slotkeeper, words
from tests.unit.test_anthropic_dialect import check_grammar, parse_sse

pytestmark = pytest.mark.backend

USER = [{"role": "user", "content": "Say something about the weather."}]
WEATHER = {"name": "get_weather", "description": "Current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}


@pytest.fixture(scope="module")
def client(keeper: Slotkeeper) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=keeper.url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(keeper: Slotkeeper) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keeper.url, timeout=120) as c:
        yield c


def assert_message(message: anthropic.types.Message, max_tokens: int) -> None:
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert message.stop_reason in STOP_REASONS
    assert isinstance(message.usage.input_tokens, int) and message.usage.input_tokens >= 0
    assert 0 <= message.usage.output_tokens <= max_tokens
    assert isinstance(message.usage.cache_read_input_tokens, int)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 0
    for block in message.content:
        assert block.type in ("text", "thinking", "tool_use")


# -- POST /v1/messages, not streamed -----------------------------------------------------------------------------


def test_messages_create_parses(client: anthropic.Anthropic) -> None:
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=6, messages=USER)
    message = raw.parse()
    assert_message(message, 6)
    assert message.model == "tiny"
    # The limit gives max_tokens after 6 tokens; the model's own end of turn may come first, or be token 6 itself.
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 6
    else:
        assert message.stop_reason == "end_turn" and message.usage.output_tokens <= 6
    assert raw.headers["x-slotkeeper-cache"] in ("hot", "restored", "cold")
    assert raw.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize(
    "system",
    ["You are terse.", [{"type": "text", "text": "You are terse."}],
     [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
      {"type": "text", "text": "Second block.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]],
    ids=["string", "one-block", "blocks-with-cache-control"],
)
def test_system_as_string_and_blocks(client: anthropic.Anthropic, system: Any) -> None:
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=3, system=system, messages=USER)
    assert_message(raw.parse(), 3)
    assert raw.headers["x-slotkeeper-session"].startswith("sys-")  # the system prompt names the session


def test_system_blocks_and_string_are_one_session(client: anthropic.Anthropic) -> None:
    # A second turn: a first turn, with no answer yet, is a conversation of its own whatever its system prompt.
    later: Any = [*USER, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And then?"}]
    as_string = client.messages.with_raw_response.create(model="tiny", max_tokens=1, system="Same prompt.",
                                                          messages=later)
    as_block = client.messages.with_raw_response.create(
        model="tiny", max_tokens=1, messages=later,
        system=[{"type": "text", "text": "Same prompt.", "cache_control": {"type": "ephemeral"}}])
    assert as_string.headers["x-slotkeeper-session"] == as_block.headers["x-slotkeeper-session"]


@pytest.mark.parametrize(
    "headers",
    [{"x-api-key": "k"}, {"authorization": "Bearer k"}, {}, {"x-api-key": "a", "authorization": "Bearer b"}],
    ids=["x-api-key", "bearer", "no-key", "both"],
)
@pytest.mark.parametrize("version", ["2023-06-01", "2026-10-21", "not-a-version", None])
def test_any_key_and_version_accepted(http: httpx.Client, headers: dict[str, str], version: str | None) -> None:
    if version is not None:
        headers = {**headers, "anthropic-version": version, "anthropic-beta": "prompt-caching-2024-07-31"}
    response = http.post("/v1/messages", headers=headers,
                         json={"model": "tiny", "max_tokens": 1, "messages": USER})
    assert response.status_code == 200, response.text
    assert response.json()["type"] == "message"


def test_metadata_user_id_is_a_session_hint(client: anthropic.Anthropic) -> None:
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=1, messages=USER, system="S",
                                                    metadata={"user_id": "user_42_session_abc"})
    assert raw.headers["x-slotkeeper-session"] == "user_42_session_abc"
    explicit = client.messages.with_raw_response.create(model="tiny", max_tokens=1, messages=USER,
                                                         metadata={"user_id": "user_42_session_abc"},
                                                         extra_headers={"X-Session-Id": "explicit"})
    assert explicit.headers["x-slotkeeper-session"] == "explicit"
    body_id = client.messages.with_raw_response.create(model="tiny", max_tokens=1, messages=USER,
                                                        metadata={"user_id": "hint"},
                                                        extra_body={"session_id": "from-body"})
    assert body_id.headers["x-slotkeeper-session"] == "from-body"


def test_sampling_fields_through_extra_body(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="tiny", max_tokens=4, messages=USER,
                                     extra_body={"temperature": 0.2, "top_p": 0.9, "top_k": 20, "seed": 1})
    assert_message(message, 4)


def _stop_sequence_candidates(client: anthropic.Anthropic) -> tuple[list[dict[str, str]], list[str]]:
    """A prompt whose greedy answer has text after its first characters, and stop sequences taken from that text.

    Several candidates (words and a space): greedy output can shift by a token when the prompt comes from cache.
    """
    for seed in range(8):
        messages = [{"role": "user", "content": f"{words(40, seed)} and so"}]
        first = client.messages.create(model="tiny", max_tokens=24, messages=messages,
                                       extra_body={"temperature": 0})
        text = "".join(b.text for b in first.content if b.type == "text")
        found = [m.group() for m in re.finditer(r"[A-Za-z]{3,}", text) if m.start() >= 2][:3]
        if found or " " in text[1:]:
            return messages, [*found, " "]
    pytest.skip("the tiny model produced no text to stop on")


def test_stop_sequence_is_reported(client: anthropic.Anthropic) -> None:
    messages, stops = _stop_sequence_candidates(client)
    message = client.messages.create(model="tiny", max_tokens=24, messages=messages,
                                     stop_sequences=["\u2603never\u2603", *stops], extra_body={"temperature": 0})
    assert message.stop_reason == "stop_sequence", message
    assert message.stop_sequence in stops
    with client.messages.stream(model="tiny", max_tokens=24, messages=messages, stop_sequences=stops,
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence in stops


def test_max_tokens_stop_reason(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="tiny", max_tokens=5, messages=USER,
                                     extra_body={"ignore_eos": True})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5


@pytest.mark.parametrize(
    "tool_choice",
    [None, {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "none"},
     {"type": "auto", "disable_parallel_tool_use": True}],
    ids=["default", "auto", "any", "named", "none", "no-parallel"],
)
def test_tools_and_tool_choice_accepted(client: anthropic.Anthropic, tool_choice: Any) -> None:
    # The tiny model's ChatML template has no tool support: llama-server accepts tools and answers in text.
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    message = client.messages.create(model="tiny", max_tokens=4, messages=USER, tools=[WEATHER], **extra)
    assert_message(message, 4)


TOOL_ROUND_TRIP = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 C, sunny"},
        {"type": "text", "text": "Thanks."}]},
]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_tool_use_round_trip(client: anthropic.Anthropic, stream: bool) -> None:
    conversation = [*TOOL_ROUND_TRIP, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_02", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_02", "is_error": True,
                                      "content": [{"type": "text", "text": "service down"}]}]}]
    if stream:
        with client.messages.stream(model="tiny", max_tokens=4, tools=[WEATHER], messages=conversation) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(model="tiny", max_tokens=4, tools=[WEATHER], messages=conversation)
    assert_message(message, 4)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 20


def test_thinking_accepted(client: anthropic.Anthropic) -> None:
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        message = client.messages.create(model="tiny", max_tokens=4, messages=USER, thinking=thinking)  # type: ignore[arg-type]
        assert_message(message, 4)
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I think.", "signature": "sig"}, {"type": "text", "text": "a"}]},
        {"role": "user", "content": "again"}]
    assert_message(client.messages.create(model="tiny", max_tokens=2, messages=history), 2)


# -- POST /v1/messages, streamed ---------------------------------------------------------------------------------


def test_stream_final_message_equals_the_deltas(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model="tiny", max_tokens=12, messages=USER) as stream:
        deltas = "".join(stream.text_stream)
        final = stream.get_final_message()
        headers = stream.response.headers
    assert "".join(b.text for b in final.content if b.type == "text") == deltas
    assert_message(final, 12)
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-slotkeeper-session"].startswith("chat-")  # no id, no system prompt: named by its message


def test_stream_event_sequence(http: httpx.Client) -> None:
    body = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": USER}
    with http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        events = parse_sse(response.read())  # every event has an `event:` line equal to data.type
    message = check_grammar(events)  # start, contiguous blocks, message_delta, message_stop
    assert 0 < message["usage"]["output_tokens"] <= 8
    assert message["stop_reason"] in STOP_REASONS
    assert events[0]["type"] == "message_start" and events[1]["type"] == "ping"


def test_stream_pings_during_a_long_prefill(http: httpx.Client) -> None:
    """A prompt of several backend batches: each progress report reaches the client as a ping before any text."""
    body = {"model": "tiny", "max_tokens": 2, "stream": True, "system": words(7000, 11),
            "messages": USER}
    with http.stream("POST", "/v1/messages", json=body, headers={"X-Session-Id": "long-prefill"}) as response:
        events = parse_sse(response.read())
    before_text = []
    for event in events:
        if event["type"] == "content_block_start":
            break
        before_text.append(event["type"])
    assert before_text[0] == "message_start"
    assert before_text.count("ping") >= 3, before_text
    usage = check_grammar(events)["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 5000


def test_stream_usage_reports_cache_reads(client: anthropic.Anthropic) -> None:
    system = "Shared system prompt for caching. " + words(600, 5)
    kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 3, "system": system, "messages": USER,
                              "extra_headers": {"X-Session-Id": "stream-cache"}}
    first = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        second = stream.get_final_message()
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens - 1
    assert second.usage.input_tokens <= 2


# -- count_tokens and models -------------------------------------------------------------------------------------


def test_count_tokens(client: anthropic.Anthropic) -> None:
    short = client.messages.count_tokens(model="tiny", messages=USER)
    longer = client.messages.count_tokens(model="tiny", messages=USER, system="A much longer system prompt. " * 20)
    with_tools = client.messages.count_tokens(model="tiny", messages=TOOL_ROUND_TRIP, tools=[WEATHER])
    assert short.input_tokens > 0
    assert longer.input_tokens > short.input_tokens
    assert with_tools.input_tokens > 0


def test_count_tokens_matches_the_prompt_of_a_turn(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="tiny", messages=USER, system="count me")
    message = client.messages.create(model="tiny", max_tokens=1, messages=USER, system="count me")
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_count_tokens_rejects_a_bad_body(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.count_tokens(model="tiny", messages=[])
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_models_list_and_retrieve(client: anthropic.Anthropic) -> None:
    page = client.models.list()
    assert [m.id for m in page.data] == ["tiny"]
    model = page.data[0]
    assert model.type == "model" and model.display_name == "tiny" and model.created_at.tzinfo is not None
    assert page.has_more is False and page.first_id == page.last_id == "tiny"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model")


# -- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"model": "tiny", "messages": USER}, "max_tokens"),
        ({"model": "tiny", "max_tokens": 5}, "messages"),
        ({"model": "tiny", "max_tokens": 5, "messages": []}, "messages"),
        ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
         "bogus"),
        ("{not json", "not valid JSON"),
        ("", "empty"),
    ],
    ids=["no-max-tokens", "no-messages", "empty-messages", "unknown-block", "bad-json", "empty-body"],
)
@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_bad_requests_are_anthropic_400s(http: httpx.Client, body: Any, fragment: str, route: str) -> None:
    if route.endswith("count_tokens") and fragment == "max_tokens":
        return  # count_tokens needs no max_tokens
    content = body if isinstance(body, str) else json.dumps(body)
    response = http.post(route, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert fragment in response.json()["error"]["message"]


def test_error_classes(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny", max_tokens=0, messages=USER)
    assert bad.value.status_code == 400 and bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.batches.retrieve("msgbatch_1")
    assert missing.value.body["type"] == "error"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_context_overflow_is_a_400_before_the_first_byte(client: anthropic.Anthropic, stream: bool) -> None:
    too_long = [{"role": "user", "content": "x " * 9000}]
    with pytest.raises(anthropic.BadRequestError) as info:
        if stream:
            with client.messages.stream(model="tiny", max_tokens=2, messages=too_long) as s:
                s.get_final_message()
        else:
            client.messages.create(model="tiny", max_tokens=2, messages=too_long)
    assert info.value.body["type"] == "error"  # type: ignore[index]
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "context" in info.value.body["error"]["message"]  # type: ignore[index]
    assert client.messages.create(model="tiny", max_tokens=1, messages=USER).type == "message"  # the slot is free
