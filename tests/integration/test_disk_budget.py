"""The disk budget against real servers: the byte budget and the max age evict the least recently used files (with
their index rows), never a pinned one or one whose session is in a slot, and a system limit of 1 keeps one."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from slotkeeper.cache.blockstore import TAIL_SUFFIX
from tests.conftest import Stack
from tests.support import REPO, Conversation, Slotkeeper, chat, timings, wait_until, words

pytestmark = pytest.mark.backend


def rows(keeper: Slotkeeper, kind: str = "session") -> dict[str, dict[str, Any]]:
    return {r["session_id"]: r for r in keeper.index_rows() if r["kind"] == kind}


def files(stack: Stack) -> set[str]:
    """The saved states in the slot dir: whole files, and states kept as blocks by their tails."""
    return {p.name.removesuffix(TAIL_SUFFIX) for p in stack.slot_dir.iterdir() if p.is_file()}


def idle_saved(keeper: Slotkeeper, session: str, turns: int = 1) -> dict[str, Any]:
    assert wait_for(lambda: (rows(keeper).get(session) or {}).get("hits", -1) >= 0 and keeper.log_text().count(
        f"as tiny/{session}:") >= turns), f"{session} was not saved"
    return rows(keeper)[session]


def wait_for(predicate: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def cli(keeper: Slotkeeper, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slotkeeper.cli", *args, "--url", keeper.url], capture_output=True,
                          text=True, cwd=REPO, timeout=60)


def test_byte_budget_evicts_the_least_recently_used_but_not_pinned_or_active(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    # Measure one snapshot first, then allow two and a half of them.
    probe = stack.slotkeeper(backend, "--save-idle-seconds", "0.3")
    Conversation(client_for(probe), "probe", size=600, seed=1).turn()
    size = idle_saved(probe, "probe")["n_bytes"]
    probe.stop()
    budget = int(size * 2.5)
    keeper = stack.slotkeeper(backend, "--save-idle-seconds", "0.3", "--disk-budget", str(budget))
    client = client_for(keeper)
    assert "probe" in rows(keeper)  # under the budget: kept at start

    a, b, c, d = (Conversation(client, name, size=600, seed=i) for i, name in enumerate("abcd", start=2))
    a.turn()
    idle_saved(keeper, "a")
    assert set(rows(keeper)) == {"probe", "a"}
    b.turn()
    idle_saved(keeper, "b")
    assert set(rows(keeper)) == {"a", "b"}  # three did not fit: the least recently used went
    pinned = cli(keeper, "sessions", "pin", "a")
    assert pinned.returncode == 0 and "is pinned" in pinned.stdout, pinned.stderr
    c.turn()
    idle_saved(keeper, "c")
    # Three don't fit: b is the least recently used that is not pinned (a) or in the slot (c).
    assert set(rows(keeper)) == {"a", "c"}
    on_disk = files(stack)
    assert {r["filename"] for r in rows(keeper).values()} == on_disk  # evicted files went with their rows
    assert sum(r["n_bytes"] for r in rows(keeper).values()) <= budget
    assert "evicted session snapshot tiny/b" in keeper.log_text()

    d.turn()
    idle_saved(keeper, "d")
    assert set(rows(keeper)) == {"a", "d"}
    # An evicted session is prefilled again, nothing worse: its own state is gone (it would give all but the new
    # message, about 580 tokens). It may start from a state that shares the conversations' common opening (69
    # tokens): the system part's or another conversation's, whose restore the measured costs say pays (before any
    # restore is measured, the backend's saves stand in for its cost).
    again = chat(client, c.messages, "c")
    assert again.status_code == 200 and timings(again)["cache_n"] < 128, (again.headers, timings(again))

    with httpx.Client(base_url=keeper.url) as http:
        disk = http.get("/api/sessions/disk").json()
    assert disk["budget"]["max_bytes"] == budget and disk["evictions"] >= 3
    assert disk["snapshots"]["session"]["pinned"] == 1
    shown = cli(keeper, "sessions", "disk")
    assert shown.returncode == 0 and "evicted since start" in shown.stdout


def test_max_age_evicts_stale_snapshots_but_not_one_in_a_slot(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0, parallel=2)
    keeper = stack.slotkeeper(backend, "--save-idle-seconds", "0.3", "--max-snapshot-age", "3")
    client = client_for(keeper)
    a, b, c = (Conversation(client, name, size=400, seed=i) for i, name in enumerate("abc", start=1))
    a.turn()
    b.turn()
    idle_saved(keeper, "a")
    idle_saved(keeper, "b")
    time.sleep(3.5)
    c.turn()  # takes a's slot (the least recently used); its save applies the budget
    idle_saved(keeper, "c")
    assert wait_for(lambda: set(rows(keeper)) == {"b", "c"}), rows(keeper).keys()  # b is still in its slot
    assert {r["filename"] for r in rows(keeper).values()} == files(stack)
    assert "unused for more than 3 s (max age)" in keeper.log_text()


def test_a_system_snapshot_limit_of_one_keeps_exactly_one(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    # Idle saves on: each chat's slot is cut back to its new system part once saved, and that part is saved.
    keeper = stack.slotkeeper(backend, "--max-system-snapshots", "1", "--save-idle-seconds", "0.3")
    client = client_for(keeper)
    systems = [{"role": "system", "content": f"Agent profile {i}. " + words(800, 40 + i)} for i in range(3)]
    for i, system in enumerate(systems):
        response = chat(client, [system, {"role": "user", "content": words(50, i)}], f"chat-{i}")
        assert response.status_code == 200
        assert wait_until(lambda i=i: keeper.log_text().count("cut back to system prompt") == i + 1, timeout=30)
        assert wait_until(lambda: len(rows(keeper, "system")) == 1)
    assert keeper.log_text().count("cut back to system prompt") == 3
    [kept] = rows(keeper, "system").values()
    assert {r["filename"] for r in keeper.index_rows()} == files(stack)
    Conversation(client, "elsewhere", size=300, seed=9).turn()
    # The one kept is the latest: a new chat on that prompt starts from it.
    response = chat(client, [systems[2], {"role": "user", "content": "a new chat"}], "chat-new")
    assert response.headers["x-slotkeeper-cache"] == "restored"
    assert response.json()["timings"]["cache_n"] >= kept["n_tokens"] - 16
