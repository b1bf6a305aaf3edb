"""The official `openai` client over the scripted backend (see test_anthropic_scripted.py): tool-call deltas,
reasoning_content, keep-alive comments and errors, which the tiny model cannot produce, pass through intact."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.conformance.test_anthropic_scripted import ScriptedUpstream, say, scripted
from tests.support import Slotkeeper

__all__ = ["scripted"]  # the module-scoped fixture, shared with the Anthropic tests


@pytest.fixture(scope="module")
def client(scripted: tuple[ScriptedUpstream, Slotkeeper]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=scripted[1].url + "/v1", api_key="x", max_retries=0, timeout=30) as c:
        yield c


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_tool_call_deltas_accumulate_into_valid_json(client: openai.OpenAI) -> None:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model="m", messages=say("tools"), tools=TOOLS,  # type: ignore[arg-type]
                                                stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += call.id or ""
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
    assert finish == "tool_calls"
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("call_a", "get_weather", {"city": "Paris"}), ("call_b", "get_time", {"tz": "CET"})]


def test_tool_calls_not_streamed(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="m", messages=say("tools"), tools=TOOLS)  # type: ignore[arg-type]
    call = completion.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert completion.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


def test_reasoning_content_passes_through(client: openai.OpenAI) -> None:
    reasoning = ""
    for chunk in client.chat.completions.create(model="m", messages=say("reasoning"), stream=True):  # type: ignore[arg-type]
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert reasoning == "Thinking."
    unary = client.chat.completions.create(model="m", messages=say("reasoning"))  # type: ignore[arg-type]
    assert (unary.choices[0].message.model_extra or {})["reasoning_content"] == "Thinking."


def test_keepalive_comments_are_tolerated_and_usage_arrives(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=say("keepalive"), stream=True,  # type: ignore[arg-type]
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ab"
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 30


def test_mid_stream_error_raises_api_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIError) as info:
        for _ in client.chat.completions.create(model="m", messages=say("midstream-error"), stream=True):  # type: ignore[arg-type]
            pass
    assert "decode failed" in str(info.value)


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_backend_500_is_an_internal_server_error(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        result = client.chat.completions.create(model="m", messages=say("fail-500"), stream=stream)  # type: ignore[call-overload]
        if stream:
            list(result)
    assert info.value.status_code == 500
    assert info.value.body == {"message": "kaboom", "type": "server_error", "code": 500}
