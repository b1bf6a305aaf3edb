"""Side tasks (OpenWebUI's title, tags and follow-ups) start from the state an earlier task left that begins the
same way, found by its tokens like every saved state, also after slotkeeper and the backend restart and after an
upgrade from a version that kept them otherwise: against real llama.cpp servers, on counts."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from tests.conftest import Stack
from tests.support import Conversation, Slotkeeper, timings, wait_until, words

pytestmark = pytest.mark.backend

TEMPLATE = "### Task:\nSuggest 3-5 relevant follow-up questions.\n### Chat History:\n<chat_history>\n"


def task(history: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": TEMPLATE + history + "\n</chat_history>"}], "max_tokens": 4,
            "stream": False}


def shared_tokens(backend_url: str, a: dict[str, object], b: dict[str, object]) -> int:
    """The prompt tokens two requests share, as the backend renders and tokenizes them."""
    lists = []
    with httpx.Client(base_url=backend_url, timeout=30) as direct:
        for body in (a, b):
            rendered = direct.post("/apply-template", json={"messages": body["messages"]})
            tokens = direct.post("/tokenize", json={"content": rendered.json()["prompt"], "add_special": True,
                                                    "parse_special": True})
            lists.append(tokens.json()["tokens"])
    n = 0
    while n < min(map(len, lists)) and lists[0][n] == lists[1][n]:
        n += 1
    return n


def side_rows(keeper: Slotkeeper) -> list[dict[str, object]]:
    return [r for r in keeper.index_rows() if r["kind"] == "side"]


def test_a_follow_up_task_after_a_restart_starts_from_the_last_runs_state(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    client = client_for(keeper)
    history = "USER: " + words(700, 3) + "\nASSISTANT: " + words(300, 4)
    first = client.post("/v1/chat/completions", json=task(history), headers={"X-OpenWebUI-Chat-Id": "c1"})
    assert first.status_code == 200 and first.headers["x-slotkeeper-request"] == "side"
    first_prompt = timings(first)["prompt_n"] + timings(first)["cache_n"]
    assert first_prompt >= 256  # long enough to be kept
    # The chat's next turn takes the one slot: the task's state is saved first, as a side state.
    Conversation(client, "c1", size=300).turn()
    assert keeper.stop() in (0, -15)
    [kept] = side_rows(keeper)
    assert kept["n_prompt"] == first_prompt and str(kept["session_id"]).startswith("~side-")
    backend.stop()

    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    client = client_for(keeper)
    later = task(history + "\nUSER: " + words(60, 5))
    owed = shared_tokens(backend.url, task(history), later)
    assert first_prompt - 40 < owed < first_prompt
    second = client.post("/v1/chat/completions", json=later, headers={"X-OpenWebUI-Chat-Id": "c1"})
    assert second.status_code == 200
    assert second.headers["x-slotkeeper-cache"] == "prefix", second.headers
    assert timings(second)["cache_n"] >= owed - 1, (owed, timings(second))


def test_side_states_an_earlier_version_left_are_found_by_their_tokens(stack: Stack, client_for) -> None:
    """An earlier version kept side states as conversations' rows under `~side-` ids, with no token blocks: at the
    next start they become the side kind, their tokens are read from their files, and the next task finds them."""
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    client = client_for(keeper)
    history = "USER: " + words(700, 8)
    assert client.post("/v1/chat/completions", json=task(history)).status_code == 200
    Conversation(client, "c2", size=300).turn()
    assert keeper.stop() in (0, -15)
    [kept] = side_rows(keeper)
    with sqlite3.connect(stack.cache_dir / "index.sqlite3") as db:  # what an earlier version's index held
        db.execute("UPDATE snapshots SET kind = 'session', n_blocks = -1 WHERE kind = 'side'")
        db.execute("DELETE FROM blocks")

    keeper = stack.slotkeeper(backend)
    assert wait_until(lambda: "indexed the tokens of 1 state(s)" in keeper.log_text(), timeout=30)
    assert [r["session_id"] for r in side_rows(keeper)] == [kept["session_id"]]
    client = client_for(keeper)
    again = client.post("/v1/chat/completions", json=task(history + "\nUSER: more"))
    assert again.status_code == 200 and again.headers["x-slotkeeper-cache"] == "prefix"


def test_side_tasks_reuse_what_they_share_and_leave_the_conversation_alone(stack: Stack, client_for) -> None:
    """Three slots: a chat in one, its title task in another; the next task (its tags, another chat's follow-ups)
    begins with the same instructions and runs where the title ran, so the backend reuses them, rather than in the
    empty third slot. The chat's next turn is hot in its own slot: no task took or overwrote its state."""
    backend = stack.backend(cache_ram=0, parallel=3, ctx_per_slot=4096)
    keeper = stack.slotkeeper(backend)
    client = client_for(keeper)
    chat = Conversation(client, "c3", size=300)
    first = chat.turn()
    instructions = "### Task:\n" + words(150, 11) + "\n### Chat History:\n<chat_history>\n"

    def side(history: str, chat_id: str) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": instructions + history + "\n</chat_history>"}],
                "max_tokens": 4, "stream": False}
        response = client.post("/v1/chat/completions", json=body, headers={"X-OpenWebUI-Chat-Id": chat_id})
        assert response.status_code == 200 and response.headers["x-slotkeeper-request"] == "side"
        return response

    title = side("USER: " + words(80, 12), "c3")
    assert title.headers["x-slotkeeper-slot"] != first.headers["x-slotkeeper-slot"]
    tags = side("USER: " + words(80, 13), "c4")
    owed = shared_tokens(backend.url, *(
        {"messages": [{"role": "user", "content": instructions + h + "\n</chat_history>"}]}
        for h in ("USER: " + words(80, 12), "USER: " + words(80, 13))))
    assert owed >= 150
    assert tags.headers["x-slotkeeper-slot"] == title.headers["x-slotkeeper-slot"]
    assert timings(tags)["cache_n"] >= owed - 1, (owed, timings(tags))
    again = chat.turn()
    assert again.headers["x-slotkeeper-cache"] == "hot"
    assert again.headers["x-slotkeeper-slot"] == first.headers["x-slotkeeper-slot"]
    assert timings(again)["cache_n"] >= timings(first)["cache_n"] + timings(first)["prompt_n"]
    assert [r for r in keeper.index_rows() if r["kind"] == "session"] == []  # the chat's state is hot, not moved
