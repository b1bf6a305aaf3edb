"""System snapshots against real servers: a 4k-token system prompt with tools is warmed up once, new conversations
start from its snapshot and then get their own, turn N keeps turn 1's key, and a failed pre-warm saves nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import Stack
from tests.support import REPO, Conversation, Slotkeeper, words

pytestmark = pytest.mark.backend

TOOLS: list[Any] = [
    {"name": "read_file", "description": "Read a file of the project. " + words(200, 5),
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "run", "description": "Run a shell command.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
]


def reminders(n: int) -> list[dict[str, Any]]:
    return [{"type": "text", "text": f"<system-reminder>{words(150, 70 + i)}</system-reminder>"} for i in range(n)]


class Agent:
    """A Claude-Code-shaped conversation over the official Anthropic client: system blocks, tools, and reminder
    blocks in front of the first user message."""

    def __init__(self, keeper: Slotkeeper, session: str, system: str, seed: int) -> None:
        self.client = anthropic.Anthropic(base_url=keeper.url, api_key="unused", max_retries=0)
        self.session = session
        self.system = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": [*reminders(2), {"type": "text", "text": words(120, seed)}]}]
        self.seed = seed

    def turn(self) -> tuple[str, int]:
        """One turn; returns the X-Slotkeeper-Cache header and the tokens the backend reused."""
        raw = self.client.messages.with_raw_response.create(
            model="tiny", max_tokens=4, system=self.system, tools=TOOLS,  # type: ignore[arg-type]
            messages=self.messages, extra_headers={"X-Session-Id": self.session})  # type: ignore[arg-type]
        message = raw.parse()
        text = "".join(b.text for b in message.content if b.type == "text") or "."
        self.seed += 1
        self.messages += [{"role": "assistant", "content": text},
                          {"role": "user", "content": words(40, self.seed)}]
        return raw.headers["x-slotkeeper-cache"], int(message.usage.cache_read_input_tokens or 0)


def system_rows(keeper: Slotkeeper) -> list[dict[str, Any]]:
    return [r for r in keeper.index_rows() if r["kind"] == "system"]


def warm_ups(keeper: Slotkeeper) -> int:
    return keeper.log_text().count("warmed up in slot")


def test_a_4k_system_prompt_is_warmed_up_once_and_starts_new_conversations(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    system = "You are a coding agent. " + words(4800, 31)

    a = Agent(keeper, "conv-a", system, seed=1)
    cache, reused = a.turn()
    assert cache == "cold"
    assert warm_ups(keeper) == 1
    [row] = system_rows(keeper)
    assert row["n_tokens"] >= 4000
    # The warm-up left the system part in the slot, so even the first conversation's turn reused it.
    assert reused >= row["n_tokens"] - 16

    other = client_for(keeper)
    Conversation(other, "elsewhere", size=300, seed=9).turn()  # takes the only slot; conv-a is saved

    b = Agent(keeper, "conv-b", system, seed=2)
    cache, reused = b.turn()
    assert cache == "restored"  # from the system snapshot: conv-b has none of its own, conv-a's is not used
    assert reused >= row["n_tokens"] - 16
    [line] = [x for x in keeper.log_text().splitlines() if "session=tiny/conv-b " in x]
    assert f"cache=restored restored={row['n_tokens']} from=system:{row['session_id'][:12]} " in line
    Conversation(other, "elsewhere", size=300, seed=9).turn()
    rows = {r["session_id"]: r for r in keeper.index_rows()}
    assert {"conv-a", "conv-b"} <= rows.keys()
    assert len({rows["conv-a"]["filename"], rows["conv-b"]["filename"], row["filename"]}) == 3
    assert rows["conv-b"]["n_tokens"] > row["n_tokens"]

    # Turn 2 of each conversation hashes to the same system key: no second warm-up, still one system snapshot.
    assert a.turn()[0] == "restored" and b.turn()[0] == "restored"
    assert warm_ups(keeper) == 1
    [again] = system_rows(keeper)
    assert (again["filename"], again["checksum"]) == (row["filename"], row["checksum"])


def test_prewarm_command_saves_a_snapshot_that_survives_a_restart(stack: Stack, tmp_path: Path) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    prompt = tmp_path / "system.txt"
    prompt.write_text("Shared team instructions. " + words(3000, 44))
    done = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "prewarm", str(prompt), "--url", keeper.url],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "saved as a system snapshot" in done.stdout
    assert "prefill" in done.stderr and "tokens" in done.stderr  # progress from the backend's return_progress
    [row] = system_rows(keeper)
    again = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "prewarm", str(prompt), "--url", keeper.url,
                            "--json"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert again.returncode == 0 and '"status": "exists"' in again.stdout

    # A new slotkeeper (and a fresh backend) on the same cache: the first chat on the prompt restores it.
    keeper.stop()
    backend.stop()
    keeper = stack.slotkeeper(stack.backend(cache_ram=0))
    with httpx.Client(base_url=keeper.url, timeout=120) as client:
        response = client.post("/v1/chat/completions", headers={"X-Session-Id": "first-chat"}, json={
            "messages": [{"role": "system", "content": prompt.read_text()}, {"role": "user", "content": "hello"}],
            "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200
    assert response.headers["x-slotkeeper-cache"] == "restored"
    assert response.json()["timings"]["cache_n"] >= row["n_tokens"] - 16


def test_a_failed_prewarm_saves_nothing(stack: Stack) -> None:
    backend = stack.backend(cache_ram=0, ctx_per_slot=2048)
    keeper = stack.slotkeeper(backend)
    before = sorted(p.name for p in backend.slot_dir.iterdir())
    with httpx.Client(base_url=keeper.url, timeout=120) as client:
        # Longer than the slot's context: the backend refuses the warm-up.
        response = client.post("/api/sessions/prewarm", json={"system": words(4000, 3)})
        assert response.status_code == 400, response.text
        assert "context" in response.json()["error"]["message"]
        streamed = client.post("/api/sessions/prewarm", json={"system": words(4000, 3), "stream": True})
        lines = [json.loads(line) for line in streamed.text.splitlines()]
        assert streamed.status_code == 200  # the NDJSON answer started before the backend refused
        assert lines[0]["status"] == "started" and lines[-1]["status"] == "failed"
        assert "context" in lines[-1]["error"]
        # A conversation on that prompt fails the same way, and its warm-up saves nothing either.
        chat = client.post("/v1/chat/completions", headers={"X-Session-Id": "too-long"}, json={
            "messages": [{"role": "system", "content": words(4000, 3)}, {"role": "user", "content": "hi"}],
            "max_tokens": 4})
        assert chat.status_code == 400
        nothing = client.post("/api/sessions/prewarm", json={"tools": []})
        assert nothing.status_code == 400 and "nothing to pre-warm" in nothing.json()["error"]["message"]
    assert system_rows(keeper) == []
    assert sorted(p.name for p in backend.slot_dir.iterdir()) == before
    assert "no system snapshot was saved" in keeper.log_text()
