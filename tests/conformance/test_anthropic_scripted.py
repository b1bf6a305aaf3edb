"""The official clients against slotkeeper over a scripted backend that replays llama-server's exact stream shapes
for what the tiny model cannot produce: tool calls, reasoning, a mid-stream error, a 500, keep-alive comments.

Protocol only: the scripted backend never stands in for cache behaviour (that is proven on real servers).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.protocol.fake_upstream import FakeUpstream, Recorded
from tests.support import Slotkeeper
from tests.unit.test_anthropic_dialect import check_grammar, parse_sse

TIMINGS = {"cache_n": 30, "prompt_n": 12, "predicted_n": 9}


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-s", "object": "chat.completion.chunk", "model": "fake", "created": 1,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def _call(index: int, arguments: str, call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return _chunk({"tool_calls": [call]})


ROLE = _chunk({"role": "assistant", "content": None})
PROGRESS = _chunk({"role": "assistant", "content": None},
                  prompt_progress={"total": 42, "cache": 30, "processed": 30, "time_ms": 0})
DONE = "[DONE]"
# Each script is what llama-server streams (data objects, ":" comments, "[DONE]") for one kind of answer.
SCRIPTS: dict[str, list[Any]] = {
    "tools": [PROGRESS, ROLE, _call(0, "", "call_a", "get_weather"), _call(0, '{"ci'), _call(0, 'ty": "Pa'),
              _call(0, 'ris"}'), _call(1, "", "call_b", "get_time"), _call(1, '{"tz": "CET"}'),
              _chunk({}, "tool_calls", timings=TIMINGS), DONE],
    "reasoning": [PROGRESS, ROLE, _chunk({"reasoning_content": "Think"}), _chunk({"reasoning_content": "ing."}),
                  _chunk({"content": "Done"}), _chunk({}, "stop", timings=TIMINGS), DONE],
    "midstream-error": [PROGRESS, ROLE, _chunk({"content": "par"}),
                        {"error": {"code": 500, "message": "decode failed", "type": "server_error"}}],
    "keepalive": [":", ":", PROGRESS, ":", ROLE, _chunk({"content": "a"}), ":", _chunk({"content": "b"}),
                  _chunk({}, "stop", timings=TIMINGS),
                  {"choices": [], "usage": {"prompt_tokens": 42, "completion_tokens": 9,
                                            "prompt_tokens_details": {"cached_tokens": 30}}, "timings": TIMINGS},
                  DONE],
    "truncated": [PROGRESS, ROLE, _chunk({"content": "cut"})],
}
UNARY: dict[str, dict[str, Any]] = {
    "tools": {"id": "chatcmpl-s", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "tool_calls",
              "message": {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_a", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}],
              "usage": {"prompt_tokens": 42, "completion_tokens": 9, "total_tokens": 51,
                        "prompt_tokens_details": {"cached_tokens": 30}}, "timings": TIMINGS},
    "reasoning": {"id": "chatcmpl-s", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                  "message": {"role": "assistant", "content": "Done", "reasoning_content": "Thinking."}}],
                  "usage": {"prompt_tokens": 42, "completion_tokens": 9, "total_tokens": 51}, "timings": TIMINGS},
}


class ScriptedUpstream(FakeUpstream):
    """FakeUpstream whose chat route plays the script named by the last user message's text."""

    def app(self) -> Starlette:
        app = super().app()

        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            self.requests.append(Recorded(request.url.path, dict(request.headers), body))
            name = _script_name(body)
            if name == "fail-500":
                return JSONResponse({"error": {"code": 500, "message": "kaboom", "type": "server_error"}},
                                    status_code=500)
            if not body.get("stream"):
                return JSONResponse(UNARY[name])

            async def play() -> AsyncIterator[bytes]:
                for item in SCRIPTS[name]:
                    if item == ":":
                        yield b":\n\n"
                    elif item == DONE:
                        yield b"data: [DONE]\n\n"
                    else:
                        yield b"data: " + json.dumps(item).encode() + b"\n\n"

            return StreamingResponse(play(), media_type="text/event-stream")

        app.router.routes.insert(0, Route("/v1/chat/completions", chat, methods=["POST"]))
        return app


def _script_name(body: dict[str, Any]) -> str:
    content = body["messages"][-1]["content"]
    return content if isinstance(content, str) else content[0]["text"]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ScriptedUpstream, Slotkeeper]]:
    root: Path = tmp_path_factory.mktemp("scripted")
    upstream = ScriptedUpstream(root / "slots").start()
    keeper = Slotkeeper(root / "cache", root / "slotkeeper.log")
    keeper.extra_args = ("--upstream", upstream.url, "--slot-dir", str(upstream.slot_dir))
    keeper.start()
    try:
        yield upstream, keeper
    finally:
        keeper.stop()
        upstream.stop()


@pytest.fixture(scope="module")
def client(scripted: tuple[ScriptedUpstream, Slotkeeper]) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=scripted[1].url, api_key="x", max_retries=0, timeout=30) as c:
        yield c


def say(script: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": script}]


TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}, {"name": "get_time", "input_schema": {}}]


def test_stream_tool_use_accumulates_input_json(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model="m", max_tokens=50, messages=say("tools"), tools=TOOLS) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.id, b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("tool_use", "call_a", "get_weather", {"city": "Paris"}), ("tool_use", "call_b", "get_time", {"tz": "CET"})]
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.cache_read_input_tokens) == (12, 9, 30)


def test_create_tool_use(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="m", max_tokens=50, messages=say("tools"), tools=TOOLS)
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.input) for b in message.content] == [("tool_use", {"city": "Paris"})]
    assert message.content[0].id == "call_a"  # type: ignore[union-attr]


def test_tool_use_round_trip_sends_tool_calls_and_tool_messages(
        client: anthropic.Anthropic, scripted: tuple[ScriptedUpstream, Slotkeeper]) -> None:
    first = client.messages.create(model="m", max_tokens=50, messages=say("tools"), tools=TOOLS)
    tool_use = first.content[0]
    assert tool_use.type == "tool_use"
    history = [*say("tools"), {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18 C"},
                                            {"type": "text", "text": "reasoning"}]}]
    answer = client.messages.create(model="m", max_tokens=50, messages=history, tools=TOOLS)  # type: ignore[arg-type]
    assert answer.stop_reason == "end_turn"
    sent = scripted[0].requests[-1].body
    assert sent["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": "call_a", "content": "18 C"}
    assert sent["messages"][3] == {"role": "user", "content": "reasoning"}
    assert sent["id_slot"] == 0 and sent["cache_prompt"] is True


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_thinking_block_comes_first(client: anthropic.Anthropic, stream: bool) -> None:
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 50, "messages": say("reasoning"),
                              "thinking": {"type": "enabled", "budget_tokens": 1024}}
    if stream:
        with client.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Thinking."  # type: ignore[union-attr]


def test_thinking_budget_reaches_the_backend(client: anthropic.Anthropic,
                                             scripted: tuple[ScriptedUpstream, Slotkeeper]) -> None:
    client.messages.create(model="m", max_tokens=50, messages=say("reasoning"),
                           thinking={"type": "enabled", "budget_tokens": 777})
    assert scripted[0].requests[-1].body["thinking_budget_tokens"] == 777


def test_stream_asks_for_progress_and_keeps_our_fields(client: anthropic.Anthropic,
                                                       scripted: tuple[ScriptedUpstream, Slotkeeper]) -> None:
    with client.messages.stream(model="m", max_tokens=50, messages=say("reasoning"), stop_sequences=["X"],
                                metadata={"user_id": "u1"}, extra_body={"session_id": "s1"}) as s:
        s.get_final_message()
    sent = scripted[0].requests[-1].body
    assert sent["return_progress"] is True and sent["stream"] is True
    assert sent["stop"] == ["X"] and sent["verbose"] is True
    assert not {"session_id", "metadata", "stop_sequences", "system", "thinking"} & set(sent)


def test_mid_stream_error_raises_in_the_sdk(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.APIStatusError) as info, client.messages.stream(
            model="m", max_tokens=50, messages=say("midstream-error")) as stream:
        stream.get_final_message()
    assert info.value.body == {"type": "error", "error": {"type": "api_error", "message": "decode failed"}}


def test_mid_stream_error_event_shape(scripted: tuple[ScriptedUpstream, Slotkeeper]) -> None:
    body = {"model": "m", "max_tokens": 5, "stream": True, "messages": say("midstream-error")}
    with httpx.Client(base_url=scripted[1].url, timeout=30) as http:
        raw = http.post("/v1/messages", json=body).content
    assert raw.endswith(b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                        b'"message":"decode failed"}}\n\n')
    assert b"message_stop" not in raw


def test_truncated_stream_ends_with_an_error_event(scripted: tuple[ScriptedUpstream, Slotkeeper]) -> None:
    body = {"model": "m", "max_tokens": 5, "stream": True, "messages": say("truncated")}
    with httpx.Client(base_url=scripted[1].url, timeout=30) as http:
        events = parse_sse(http.post("/v1/messages", json=body).content)
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"


def test_keepalives_become_pings_and_usage_is_final(scripted: tuple[ScriptedUpstream, Slotkeeper]) -> None:
    body = {"model": "m", "max_tokens": 5, "stream": True, "messages": say("keepalive")}
    with httpx.Client(base_url=scripted[1].url, timeout=30) as http:
        events = parse_sse(http.post("/v1/messages", json=body).content)
    assert [e["type"] for e in events[:4]] == ["message_start", "ping", "ping", "ping"]
    assert sum(e["type"] == "ping" for e in events) == 5  # four comments and one progress report
    message = check_grammar(events)
    assert message["content"] == [{"type": "text", "text": "ab"}]
    assert message["usage"]["cache_read_input_tokens"] == 30


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_backend_500_is_an_internal_server_error(client: anthropic.Anthropic, stream: bool) -> None:
    with pytest.raises(anthropic.InternalServerError) as info:
        if stream:
            with client.messages.stream(model="m", max_tokens=5, messages=say("fail-500")) as s:
                s.get_final_message()
        else:
            client.messages.create(model="m", max_tokens=5, messages=say("fail-500"))
    assert info.value.status_code == 500
    assert info.value.body == {"type": "error", "error": {"type": "api_error", "message": "kaboom"}}


@pytest.fixture(scope="module")
def guarded(scripted: tuple[ScriptedUpstream, Slotkeeper],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slotkeeper]:
    """A second slotkeeper on the scripted backend that requires a key and caps request bodies."""
    upstream = scripted[0]
    root: Path = tmp_path_factory.mktemp("guarded")
    keeper = Slotkeeper(root / "cache", root / "slotkeeper.log")
    keeper.extra_args = ("--upstream", upstream.url, "--slot-dir", str(upstream.slot_dir), "--api-key", "sekrit",
                         "--max-body-bytes", "20000")
    keeper.start()
    try:
        yield keeper
    finally:
        keeper.stop()


def test_configured_key_accepted_as_bearer_or_x_api_key(guarded: Slotkeeper) -> None:
    with anthropic.Anthropic(base_url=guarded.url, api_key="sekrit", max_retries=0, timeout=30) as client:
        assert client.messages.create(model="m", max_tokens=5, messages=say("reasoning")).type == "message"
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        response = http.post("/v1/messages", headers={"x-api-key": "sekrit", "anthropic-version": "2023-06-01"},
                             json={"model": "m", "max_tokens": 5, "messages": say("reasoning")})
    assert response.status_code == 200


def test_wrong_key_is_an_authentication_error(guarded: Slotkeeper) -> None:
    with anthropic.Anthropic(base_url=guarded.url, api_key="wrong", max_retries=0, timeout=30) as client, \
            pytest.raises(anthropic.AuthenticationError) as info:
        client.messages.create(model="m", max_tokens=5, messages=say("reasoning"))
    assert info.value.status_code == 401
    assert info.value.body["type"] == "error"  # type: ignore[index]
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_oversized_body_is_request_too_large(guarded: Slotkeeper) -> None:
    with anthropic.Anthropic(base_url=guarded.url, api_key="sekrit", max_retries=0, timeout=30) as client, \
            pytest.raises(anthropic.APIStatusError) as info:
        client.messages.create(model="m", max_tokens=5, messages=say("x" * 50_000))
    assert info.value.status_code == 413
    assert info.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
