"""Conversations without a session id (coding agents: Maki, several terminals on one prompt) against both real
backends, through the official `openai` client, on one slot without a RAM cache.

Two agents on one system prompt are two conversations (named by the system prompt and their first message), not
one `sys-<hash>` session: each resumed turn reuses that agent's own previous prompt, minus 8 tokens, although every
turn of the other agent took the slot in between. A subagent on the same system prompt starts from the system
state, cut from a slot once the agents paused. The client sends back a short assistant message, not what was
generated. Dense, recurrent, hybrid and sliding-window tiny models; on b11434 a sliding-window state cannot be
reused after a restore, so none is attempted. Assertions are on counts (timings.cache_n, prompt_n, headers, index
rows), never on the random model's text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from slotkeeper.serving.identity import session_group, system_session_id
from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from tests.conftest import Stack
from tests.support import wait_until, words

pytestmark = pytest.mark.backend

SLACK = 8
TURNS = 6
SYSTEM = "You are a coding agent. Use the tools, then answer. " + words(400, 7)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("conversation-models")
    out = {}
    for arch in ("mamba", "jamba", "gemma3"):
        out[arch] = directory / f"{arch}.gguf"
        write_tiny_model(out[arch], TinyModelSpec(arch=arch))  # type: ignore[arg-type]
    return out


class Agent:
    """An agent without a session id: its own history on the shared system prompt; what it last sent, in tokens."""

    def __init__(self, sdk: openai.OpenAI, task: str, seed: int) -> None:
        self.sdk = sdk
        self.seed = seed
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": f"{task} " + words(120, seed)}]
        self.last_prompt = 0

    def turn(self) -> tuple[str, str, dict[str, Any]]:
        raw = self.sdk.chat.completions.with_raw_response.create(model="tiny", messages=self.messages,  # type: ignore[arg-type]
                                                                 max_tokens=12, temperature=0)
        body = raw.http_response.json()
        timings: dict[str, Any] = body["timings"]
        self.last_prompt = timings["cache_n"] + timings["prompt_n"]
        # The client's history: a short answer of its own (not what was generated), then the next request.
        self.seed += 1
        self.messages += [{"role": "assistant", "content": "done"}, {"role": "user", "content": words(40, self.seed)}]
        return raw.headers["x-slotkeeper-session"], raw.headers["x-slotkeeper-cache"], timings


@pytest.mark.parametrize("arch", ["llama", "mamba", "jamba", "gemma3"])
def test_two_agents_on_one_system_prompt_without_ids_keep_their_own_state(stack: Stack, client_for,
                                                                         models: dict[str, Path], arch: str) -> None:
    nothing_restores = arch == "gemma3" and stack.kind == "binary"
    backend = stack.backend(model=None if arch == "llama" else models[arch], parallel=1, cache_ram=0)
    keeper = stack.slotkeeper(backend, "--save-idle-seconds", "0.5")  # the system part is cut when a slot idles
    client = client_for(keeper)
    with openai.OpenAI(base_url=keeper.url + "/v1", api_key="x", max_retries=0, timeout=120) as sdk:
        agents = [Agent(sdk, "Fix the failing parser test.", 21), Agent(sdk, "Write the release notes.", 31)]
        sessions: list[str] = []
        for number in range(TURNS):
            for agent in agents:
                owed = agent.last_prompt
                session, outcome, t = agent.turn()
                if number == 0:  # a first turn, with no answer yet, is saved under a name of its own
                    assert session.startswith(system_session_id([SYSTEM]) + ".c") and ".t" in session, session
                    continue
                if number == 1:  # named by its first message and first answer from then on
                    sessions.append(session)
                assert session == sessions[agents.index(agent)], (number, session, sessions)
                if nothing_restores:
                    assert outcome == "cold", (number, outcome, t)
                else:
                    # The other agent held the slot: this agent's own state came back, all of its previous prompt
                    # (its first turn's, under that turn's own name, on the second turn).
                    expected = "prefix" if number == 1 else "restored"
                    assert outcome == expected and t["cache_n"] >= owed - SLACK, (number, owed, outcome, t)

        # A subagent on the same system prompt: a conversation of its own that starts from its system part, cut from
        # the slot once the agents paused.
        if not nothing_restores:
            assert wait_until(lambda: client.get("/api/sessions", params={"kind": "system"}).json()["sessions"],
                              timeout=60), keeper.log_text()[-2000:]
        sub = Agent(sdk, "Subagent: list the files that import the parser.", 41)
        session, outcome, t = sub.turn()
    group = system_session_id([SYSTEM])
    assert len(set(sessions)) == 2 and session not in sessions
    assert {session_group(s) for s in (*sessions, session)} == {group}
    if not nothing_restores:
        system_row = client.get("/api/sessions", params={"kind": "system"}).json()["sessions"]
        assert len(system_row) == 1, system_row
        # From the slot (the other agent left its system part there) or from the system snapshot.
        assert t["cache_n"] >= system_row[0]["tokens"] - SLACK, (outcome, t, system_row)
    # The session API lists the agents' conversations under their system prompt's group.
    listed = client.get("/api/sessions", params={"group": group}).json()["sessions"]
    assert {row["session"] for row in listed} >= set(sessions) and {row["group"] for row in listed} == {group}
    recent = client.get("/api/requests/recent").json()["requests"]
    assert all(row["why"] != "slot-taken" or nothing_restores for row in recent), recent


def test_openwebui_chats_with_ids_on_one_system_prompt_still_share_its_snapshot(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0), "--save-idle-seconds", "0.5")
    client = client_for(keeper)
    system = {"role": "system", "content": SYSTEM}

    def first_turn(chat_id: str, seed: int) -> httpx.Response:
        body = {"model": "tiny", "messages": [system, {"role": "user", "content": words(60, seed)}],
                "max_tokens": 4, "temperature": 0}
        response = client.post("/v1/chat/completions", json=body, headers={"X-OpenWebUI-Chat-Id": chat_id})
        assert response.status_code == 200, response.text
        return response

    first_turn("chat-1", 51)
    # Saved once the slot idles, then cut back to the system part, which is saved on its own.
    assert wait_until(lambda: client.get("/api/sessions", params={"kind": "system"}).json()["sessions"], timeout=30)
    other = {"model": "tiny", "messages": [{"role": "system", "content": "Another assistant."},
                                           {"role": "user", "content": "hi"}], "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=other, headers={"X-Session-Id": "other"}).status_code == 200
    second = first_turn("chat-2", 52)  # the slot no longer holds the system part: its snapshot comes back
    assert second.headers["x-slotkeeper-session"] == "chat-2"
    system_row = client.get("/api/sessions", params={"kind": "system"}).json()["sessions"]
    assert len(system_row) == 1, system_row
    assert second.headers["x-slotkeeper-cache"] == "restored", second.headers
    assert second.json()["timings"]["cache_n"] >= system_row[0]["tokens"] - SLACK
    assert second.json()["timings"]["cache_n"] + second.json()["timings"]["prompt_n"] > system_row[0]["tokens"]

    def groups() -> dict[str, str | None]:
        rows = client.get("/api/sessions").json()["sessions"]
        return {row["session"]: row["group"] for row in rows if row["kind"] == "session"}

    assert wait_until(lambda: "chat-1" in groups()), groups()
    assert groups()["chat-1"] is None  # chats with ids are in no system prompt group
