"""System states against real servers: a 4k-token system prompt with tools is never warmed up on a request's path;
the first conversation on it runs in one pass and its slot is cut back to the system part once it idles, saved
once; a new conversation then starts from the saved state sharing the most with it (another conversation's, when
it opens with the same reminders, else the system part's); a pre-warm saves a system state that survives a restart,
and a failed pre-warm saves nothing."""

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
from tests.support import REPO, Conversation, Slotkeeper, wait_until, words

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


def cuts(keeper: Slotkeeper) -> int:
    return keeper.log_text().count("cut back to system prompt")


def restored_from(keeper: Slotkeeper, session: str) -> str:
    [line, *_] = [x for x in reversed(keeper.log_text().splitlines()) if f"session=tiny/{session} " in x]
    return line.split(" from=", 1)[1].split(" ", 1)[0] if " from=" in line else ""


def test_a_4k_system_prompt_is_cut_from_the_first_conversation_and_starts_new_ones(stack: Stack,
                                                                                   client_for) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend, "--save-idle-seconds", "0.5")  # the cut follows an idle save
    system = "You are a coding agent. " + words(4800, 31)

    a = Agent(keeper, "conv-a", system, seed=1)
    cache, _ = a.turn()
    assert cache == "cold" and warm_ups(keeper) == 0  # nothing ran on the request's path before it
    # Once the turn is saved and the slot idles, the slot is cut back to the system part, saved on its own.
    assert wait_until(lambda: len(system_rows(keeper)) == 1, timeout=30), keeper.log_text()[-3000:]
    [row] = system_rows(keeper)
    assert row["n_tokens"] >= 3500 and cuts(keeper) == 1  # the system text and the tools, without the reminders
    assert wait_until(lambda: any(r["session_id"] == "conv-a" for r in keeper.index_rows()))

    other = client_for(keeper)
    Conversation(other, "elsewhere", size=300, seed=9).turn()  # takes the only slot

    # conv-b opens with the same reminder blocks as conv-a: conv-a's state shares the most with it.
    b = Agent(keeper, "conv-b", system, seed=2)
    cache, reused = b.turn()
    assert cache == "prefix" and restored_from(keeper, "conv-b") == "conv-a"
    assert reused >= row["n_tokens"] + 200  # the system part and the reminders

    # conv-c opens with other reminders: conv-b's state still shares a few tokens more than the system part's
    # (the user message's start and the reminder tag), so it is the one restored.
    Conversation(other, "elsewhere", size=300, seed=9).turn()
    c = Agent(keeper, "conv-c", system, seed=3)
    c.messages[0]["content"][:2] = [{"type": "text", "text": f"<system-reminder>{words(150, 90 + i)}"
                                                             "</system-reminder>"} for i in range(2)]
    cache, reused = c.turn()
    assert cache == "prefix" and restored_from(keeper, "conv-c") in ("conv-a", "conv-b")
    assert row["n_tokens"] - 16 <= reused < row["n_tokens"] + 100
    # conv-d opens with a plain message: the system part's state shares as much as any, and is the smallest.
    Conversation(other, "elsewhere", size=300, seed=9).turn()
    d = Agent(keeper, "conv-d", system, seed=4)
    d.messages[0]["content"] = words(30, 4)
    cache, reused = d.turn()
    assert cache == "restored" and restored_from(keeper, "conv-d") == f"system:{row['session_id'][:12]}"
    assert reused >= row["n_tokens"] - 16

    # Turn 2 of each conversation starts from its own state; the system part is never cut again.
    assert a.turn()[0] == "restored" and b.turn()[0] == "restored"
    assert warm_ups(keeper) == 0 and cuts(keeper) == 1
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
        # A conversation on that prompt fails the same way, and nothing of it is saved either.
        chat = client.post("/v1/chat/completions", headers={"X-Session-Id": "too-long"}, json={
            "messages": [{"role": "system", "content": words(4000, 3)}, {"role": "user", "content": "hi"}],
            "max_tokens": 4})
        assert chat.status_code == 400
        nothing = client.post("/api/sessions/prewarm", json={"tools": []})
        assert nothing.status_code == 400 and "nothing to pre-warm" in nothing.json()["error"]["message"]
    assert system_rows(keeper) == []
    assert sorted(p.name for p in backend.slot_dir.iterdir()) == before
    assert "no system snapshot was saved" in keeper.log_text()
