"""Side tasks (OpenWebUI's title, tags and follow-ups) start from the state an earlier task left that begins the
same way, also after slotkeeper and the backend restart: against real llama.cpp servers, on counts."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import Stack
from tests.support import Conversation, timings, words

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


def test_a_follow_up_task_after_a_restart_starts_from_the_last_runs_state(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    client = client_for(keeper)
    history = "USER: " + words(700, 3) + "\nASSISTANT: " + words(300, 4)
    first = client.post("/v1/chat/completions", json=task(history), headers={"X-OpenWebUI-Chat-Id": "c1"})
    assert first.status_code == 200 and first.headers["x-slotkeeper-request"] == "side"
    first_prompt = timings(first)["prompt_n"] + timings(first)["cache_n"]
    assert first_prompt >= 256  # long enough to be kept
    # The chat's next turn takes the one slot: the task's state is saved first, like a session's.
    Conversation(client, "c1", size=300).turn()
    assert keeper.stop() in (0, -15)
    kept = json.loads((stack.cache_dir / "side-states.json").read_text())["states"]
    assert len(kept) == 1 and kept[0]["n_tokens"] == first_prompt
    assert keeper.row(kept[0]["session_id"]) is not None
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


def test_side_states_an_earlier_version_left_without_the_file_are_deleted(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    client = client_for(keeper)
    history = "USER: " + words(700, 8)
    assert client.post("/v1/chat/completions", json=task(history)).status_code == 200
    Conversation(client, "c2", size=300).turn()
    assert keeper.stop() in (0, -15)
    side_id = json.loads((stack.cache_dir / "side-states.json").read_text())["states"][0]["session_id"]
    assert keeper.row(side_id) is not None
    (stack.cache_dir / "side-states.json").unlink()  # what an earlier version left: snapshots, no file

    keeper = stack.slotkeeper(backend)
    assert keeper.row(side_id) is None  # deleted at start: nothing could match it
    client = client_for(keeper)
    again = client.post("/v1/chat/completions", json=task(history + "\nUSER: more"))
    assert again.status_code == 200 and again.headers["x-slotkeeper-cache"] != "prefix"
