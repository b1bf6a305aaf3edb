"""A reason for every miss: each test provokes one reason on a real backend and finds it in the request's journal row
(`/api/requests/recent?session=`), its log line (`why=`) and /metrics (`slotkeeper_turn_reasons_total`); the last
one reads the story back with `slotkeeper sessions explain`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from tests.conftest import Stack
from tests.support import REPO, Slotkeeper, chat, turn_log, wait_until, words

pytestmark = pytest.mark.backend

SHORT_SYSTEM = "Be brief."  # too short to be worth a system snapshot: no warm-up gets in the way


@pytest.fixture
def backend_kind() -> str:
    return "binary"  # the reasons are slotkeeper's; the per-architecture one needs b11434 (below)


class Chat:
    def __init__(self, client: httpx.Client, session: str | None, seed: int, system: str | None = SHORT_SYSTEM,
                 size: int = 500) -> None:
        self.client, self.session, self.seed = client, session, seed
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.messages.append({"role": "user", "content": words(size, seed)})

    def turn(self, **extra: Any) -> httpx.Response:
        response = chat(self.client, self.messages, self.session, **extra)
        assert response.status_code == 200, response.text
        self.seed += 1
        self.messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": words(40, self.seed)}]
        return response


def reason_of(keeper: Slotkeeper, client: httpx.Client, session: str) -> dict[str, Any]:
    """The session's newest journal row, checked against its log line and /metrics."""
    row: dict[str, Any] = client.get("/api/requests/recent", params={"session": session}).json()["requests"][0]
    assert row["session"] == session
    log_rows = turn_log(keeper, session)
    assert log_rows and log_rows[-1]["why"] == row["why"], (log_rows, row)
    metrics = client.get("/metrics").text
    found = re.search(rf'^slotkeeper_turn_reasons_total{{reason="{re.escape(row["why"])}"}} (\S+)$', metrics, re.M)
    assert found and float(found.group(1)) >= 1, metrics
    return row


def test_new_session(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(cache_ram=0))
    client = client_for(keeper)
    Chat(client, "fresh", 1).turn()
    assert reason_of(keeper, client, "fresh")["why"] == "new-session"


def test_hot(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(cache_ram=0))
    client = client_for(keeper)
    conversation = Chat(client, "warm", 1)
    conversation.turn()
    conversation.turn()
    assert reason_of(keeper, client, "warm")["why"] == "hot"


def test_own_snapshot_after_another_session_took_the_slot(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    client = client_for(keeper)
    first, second = Chat(client, "first", 1), Chat(client, "second", 2)
    first.turn()
    second.turn()
    first.turn()
    row = reason_of(keeper, client, "first")
    assert row["why"] == "own" and "taken by session second" in row["why_detail"], row


def test_side_task(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(cache_ram=0))
    client = client_for(keeper)
    Chat(client, "chat", 1).turn()
    title = {"messages": [{"role": "user", "content": "### Task:\nGenerate a title."}], "max_tokens": 4}
    response = client.post("/v1/chat/completions", json=title, headers={"X-Session-Id": "chat",
                                                                        "X-OpenWebUI-Task": "title_generation"})
    assert response.status_code == 200
    assert reason_of(keeper, client, "chat")["why"] == "side-task"


def test_history_rewritten_at_a_message(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(cache_ram=0))
    client = client_for(keeper)
    conversation = Chat(client, "editor", 1)
    conversation.turn()
    conversation.messages[1]["content"] = words(500, 99)  # the user edits the first message
    conversation.turn()
    row = reason_of(keeper, client, "editor")
    assert row["why"] == "rewritten" and "message 2 (user)" in row["why_detail"], row


def test_snapshot_evicted_by_the_budget(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0), "--disk-budget", "1K")
    client = client_for(keeper)
    chats = [Chat(client, name, seed) for seed, name in enumerate(["a", "b", "c"])]
    for conversation in chats:
        conversation.turn()  # each takes the one slot: the one before is saved, the one before that evicted
    assert wait_until(lambda: keeper.row("a") is None)
    chats[0].turn()
    assert reason_of(keeper, client, "a")["why"] == "evicted"


def test_snapshot_of_another_model_file(stack: Stack, client_for, foreign_model: Path) -> None:
    backend = stack.backend(parallel=1, cache_ram=0)
    keeper = stack.slotkeeper(backend)
    conversation = Chat(client_for(keeper), "moved", 1)
    conversation.turn()
    keeper.stop()  # saves it
    assert keeper.row("moved") is not None
    backend.stop()
    keeper = stack.slotkeeper(stack.backend(model=foreign_model, parallel=1, cache_ram=0))
    conversation.client = client = client_for(keeper)
    conversation.turn()
    assert reason_of(keeper, client, "moved")["why"] == "not-restorable"


def test_snapshot_quarantined(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    client = client_for(keeper)
    victim, other = Chat(client, "victim", 1), Chat(client, "other", 2)
    victim.turn()
    other.turn()  # saves the victim
    assert wait_until(lambda: keeper.row("victim") is not None)
    row = keeper.row("victim")
    assert row is not None
    path = stack.slot_dir / (row["filename"] + (".tail" if row["tail_bytes"] else ""))  # its file, or its tail
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    victim.turn()
    assert reason_of(keeper, client, "victim")["why"] == "quarantined"


def test_backend_restarted_before_the_state_was_saved(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend, "--save-idle-seconds", "-1")  # saved only on a switch or at exit
    client = client_for(keeper)
    conversation = Chat(client, "survivor", 1)
    conversation.turn()
    port = backend.port
    backend.stop()
    backend.port = port
    backend.start()  # same address, fresh process: the slot's state is gone
    assert wait_until(lambda: client.get("/api/sessions/current").json()["slots"][0]["session"] is None, 10)
    conversation.turn()
    assert reason_of(keeper, client, "survivor")["why"] == "backend-restarted"


def test_slot_taken_on_a_backend_that_keeps_sessions_hot(stack: Stack, client_for, tmp_path: Path) -> None:
    """A sliding-window model on b11434 (no checkpoints in its slot files): restores cannot help."""
    model = tmp_path / "gemma3.gguf"
    write_tiny_model(model, TinyModelSpec(arch="gemma3"))
    keeper = stack.slotkeeper(stack.backend(model=model, parallel=1, cache_ram=0))
    client = client_for(keeper)
    assert client.get("/api/sessions/current").json()["restoring"]["strategy"] == "keep-hot"
    first, second = Chat(client, "first", 1), Chat(client, "second", 2)
    first.turn()
    second.turn()
    first.turn()
    row = reason_of(keeper, client, "first")
    assert row["why"] == "slot-taken" and "taken by session second" in row["why_detail"], row


def test_default_session(stack: Stack, client_for) -> None:
    """Only a request without messages or an id is the catch-all session; a chat without an id or a system prompt is
    named by its first message and planned like any other."""
    keeper = stack.slotkeeper(stack.backend(cache_ram=0))
    client = client_for(keeper)
    response = client.post("/v1/completions", json={"prompt": words(50, 1), "max_tokens": 2})
    assert response.status_code == 200
    assert reason_of(keeper, client, "default")["why"] == "default-session"
    named = Chat(client, None, 1, system=None).turn()
    assert named.headers["x-slotkeeper-session"].startswith("chat-")
    assert reason_of(keeper, client, named.headers["x-slotkeeper-session"])["why"] == "new-session"


def test_a_new_system_prompt_and_the_next_chat_on_it(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0), "--save-idle-seconds", "0.5")
    client = client_for(keeper)
    system = "You are a coding agent. " + words(1500, 5)
    Chat(client, "one", 1, system=system).turn()
    first = reason_of(keeper, client, "one")
    assert first["why"] == "new-session" and first["cache"] == "cold", first
    # Nothing was evaluated before the turn; its slot is cut back to the system part once it idles.
    assert wait_until(lambda: "cut back to system prompt" in keeper.log_text(), timeout=30)
    Chat(client, "between", 3).turn()  # takes the one slot: the next chat on the prompt starts from the system state
    Chat(client, "two", 2, system=system).turn()
    second = reason_of(keeper, client, "two")
    assert second["why"] == "new-session" and "system part" in second["why_detail"], second
    assert second["cache_n"] > 0


def test_sessions_explain_tells_the_story(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    client = client_for(keeper)
    first, second = Chat(client, "storied", 1), Chat(client, "intruder", 2)
    first.turn()
    first.turn()
    second.turn()
    first.turn()
    command = [sys.executable, "-m", "slotkeeper.cli", "sessions", "explain", "storied", "--url", keeper.url]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    story = result.stdout
    assert "session storied: its last 3 request(s)" in story, story
    for reason in ("new-session:", "hot:", "own:"):
        assert reason in story, story
    assert "taken by session intruder" in story and "prompt tokens reused" in story, story
