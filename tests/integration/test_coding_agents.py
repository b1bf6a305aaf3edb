"""OpenCode- and Qwen-Code-shaped sessions (tests/fixtures/clients/*.json) through the official `openai` client,
against both real llama.cpp servers on one slot. Each resumed turn must reuse what its prompt shares with the best
earlier state, minus 8 tokens; what it shares is counted exactly, with the backend's own template and tokenizer.

- OpenCode sends its session id (`x-session-affinity`, `X-Session-Id`) and moves its `<system-reminder>` from one
  user message to the next: the history is rewritten there, reuse stops there, and the turn says so (`rewritten`).
- Qwen Code sends no session id and a system prompt of about 20k tokens on every new session: each new session starts
  from the state sharing the most with it (another session's, holding the system prompt), also after a restart and
  after another conversation took the slot."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.client_fixtures import expand, load, prompt_tokens, shared
from tests.conftest import Stack
from tests.support import Slotkeeper, wait_until

pytestmark = pytest.mark.backend

SLACK = 8


def newest(client: httpx.Client, n: int, session: str | None = None) -> dict[str, Any]:
    """The newest journal row (of `session`), once there are `n`: a streamed turn's row is written when its stream
    has ended on slotkeeper's side, a moment after the client read the last event."""
    params = {"session": session} if session else {}

    def rows() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = client.get("/api/requests/recent", params=params).json()["requests"]
        return found

    assert wait_until(lambda: len(rows()) >= n, timeout=10), rows()
    return rows()[0]


def stream_chat(sdk: openai.OpenAI, body: dict[str, Any]) -> str:
    stream = sdk.chat.completions.create(model="tiny", messages=body["messages"], tools=body["tools"], stream=True,
                                         stream_options={"include_usage": True}, max_tokens=8, temperature=0)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    return text or "..."


class OpenCodeSession:
    def __init__(self, fixture: dict[str, Any], name: str) -> None:
        self.fixture = fixture
        self.names = {"SESSION": name}
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": expand(t, self.names)}
                                               for t in fixture["system"]]
        self.previous: list[int] = []

    def body(self, step: dict[str, Any], number: int) -> dict[str, Any]:
        reminder = self.fixture["reminder"]
        if "user" in step:
            if step.get("reminder"):  # the reminder moves: off every earlier user message, onto the new one
                for message in self.messages:
                    if message["role"] == "user" and isinstance(message["content"], str):
                        message["content"] = message["content"].replace("\n\n" + reminder, "")
            text = f"[{self.names['SESSION']}] " + expand(step["user"], self.names)  # two different tasks
            text += "\n\n" + reminder if step.get("reminder") else ""
            self.messages.append({"role": "user", "content": text})
        else:  # the model's last answer called a tool: the client sends the call and its output back
            call_id = f"call_{number}"
            self.messages[-1]["tool_calls"] = [{"id": call_id, "type": "function", "function": step["tool_call"]}]
            self.messages.append({"role": "tool", "tool_call_id": call_id,
                                  "content": expand(step["tool_output"], self.names)})
        return {"messages": self.messages, "tools": self.fixture["tools"]}


def test_opencode_sessions_reuse_what_they_share(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    client = client_for(keeper)
    fixture = load("opencode")
    sessions = [OpenCodeSession(fixture, f"ses_{i}abc") for i in range(2)]
    sdks = [openai.OpenAI(base_url=keeper.url + "/v1", api_key="x", max_retries=0, timeout=120,
                          default_headers=expand(fixture["headers"], s.names)) for s in sessions]
    rewritten = []
    for number, step in enumerate(fixture["requests"]):
        for session, sdk in zip(sessions, sdks, strict=True):  # two agents on one slot: every resumed turn restores
            body = session.body(step, number)
            tokens = prompt_tokens(client, body)
            text = stream_chat(sdk, body)
            row = newest(client, number + 1, session.names["SESSION"])
            assert row["session"] == session.names["SESSION"] and row["status"] == 200, row
            if session.previous:
                owed = shared(session.previous, tokens)
                assert row["cache_n"] >= owed - SLACK, (number, step["what"], owed, row)
                assert row["cache"] == "restored", (number, row)  # the other session had the slot
            if row["why"] == "rewritten":
                rewritten.append(row["why_detail"])
            session.previous = tokens
            session.messages.append({"role": "assistant", "content": text})
    # The reminder moved off the first user message (the third message) on the third request of each session.
    assert len(rewritten) == 2 and all("message 3 (user)" in d for d in rewritten), rewritten
    for sdk in sdks:
        sdk.close()


def qwen_body(fixture: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": expand(fixture["system"], {})},
                         {"role": "user", "content": expand(step["user"], {})}], "tools": fixture["tools"]}


def qwen_turn(keeper: Slotkeeper, client: httpx.Client, fixture: dict[str, Any], body: dict[str, Any]) -> dict:
    before = len(client.get("/api/requests/recent").json()["requests"])
    with openai.OpenAI(base_url=keeper.url + "/v1", api_key="x", max_retries=0, timeout=300,
                       default_headers=fixture["headers"]) as sdk:
        stream_chat(sdk, body)
    return newest(client, before + 1)


def test_qwen_code_new_sessions_start_from_the_system_prompts_state(stack: Stack, client_for) -> None:
    fixture = load("qwen-code")
    backend = stack.backend(parallel=1, cache_ram=0, ctx_per_slot=32768)
    keeper = stack.slotkeeper(backend)
    client = client_for(keeper)
    bodies = [qwen_body(fixture, step) for step in fixture["sessions"]]
    tokens = [prompt_tokens(client, body) for body in bodies]
    system_part = shared(tokens[0], tokens[1])
    assert system_part > 15000, system_part  # the fixture's shape: a system prompt of about 20k tokens

    first = qwen_turn(keeper, client, fixture, bodies[0])
    assert first["session"].startswith("sys-") and first["why"] == "new-session", first

    keeper.stop()  # the next day: slotkeeper and the server start again
    backend.stop()
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0, ctx_per_slot=32768))
    client = client_for(keeper)
    second = qwen_turn(keeper, client, fixture, bodies[1])
    # From the state sharing the most with it: the first session's (saved at exit; nothing was cut, with idle saves
    # off), which holds the system prompt.
    assert second["cache"] == "prefix" and second["cache_n"] >= system_part - SLACK, (system_part, second)

    other = {"messages": [{"role": "system", "content": "Another assistant."}, {"role": "user", "content": "hi"}],
             "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=other, headers={"X-Session-Id": "other"}).status_code == 200
    third = qwen_turn(keeper, client, fixture, bodies[2])
    best = max(shared(tokens[0], tokens[2]), shared(tokens[1], tokens[2]))
    assert third["cache"] in ("restored", "prefix") and third["cache_n"] >= best - SLACK, third
