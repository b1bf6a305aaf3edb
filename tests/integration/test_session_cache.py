"""Session KV-cache behaviour through slotkeeper against real llama.cpp servers (the binary and the embedded one).

Assertions are on token counts (timings.cache_n, prompt_n), index rows, files and status codes, never on text.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.conftest import Stack
from tests.support import ANSWER_SLACK, Conversation, chat, saved_state_bytes, timings, wait_until, words

pytestmark = pytest.mark.backend


def test_turn_two_reuses_turn_one(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend())
    conv = Conversation(client_for(keeper), "alice")
    first = conv.turn()
    assert first.headers["x-slotkeeper-session"] == "alice"
    assert first.headers["x-slotkeeper-cache"] == "cold"
    turn1_prompt = timings(first)["prompt_n"]
    second = conv.turn()
    assert second.headers["x-slotkeeper-cache"] == "hot"
    t2 = timings(second)
    assert t2["cache_n"] >= turn1_prompt, t2
    assert t2["prompt_n"] < 80, t2  # only the new messages are prefilled


def test_switching_sessions_restores_from_disk(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    client = client_for(keeper)
    a = Conversation(client, "session-a", size=800, seed=1)
    b = Conversation(client, "session-b", size=800, seed=2)
    a.turn()
    b.turn()  # switching to B saves A first
    row_a = keeper.row("session-a")
    assert row_a is not None and row_a["n_tokens"] > 0
    a_file_bytes = saved_state_bytes(stack.slot_dir, row_a)

    again = a.turn()  # switching back saves B, then restores A
    assert again.headers["x-slotkeeper-cache"] == "restored"
    assert timings(again)["cache_n"] >= row_a["n_tokens"] - ANSWER_SLACK, (timings(again), row_a)

    row_b = keeper.row("session-b")
    assert row_b is not None and row_b["filename"] != row_a["filename"]
    assert row_b["n_tokens"] > 0
    # B's traffic never touched A's snapshot.
    assert saved_state_bytes(stack.slot_dir, row_a) == a_file_bytes
    assert keeper.row("session-a")["checksum"] == row_a["checksum"]  # type: ignore[index]


def test_what_a_restore_and_a_prefill_cost_is_measured_as_it_runs(stack: Stack, client_for) -> None:
    """Two conversations taking turns on one slot: from their restores and prefills slotkeeper measures what each
    costs on this backend (cache/costs.py), and shows it; every restore it made paid by that measure."""
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    client = client_for(keeper)
    a = Conversation(client, "cost-a", size=800, seed=5)
    b = Conversation(client, "cost-b", size=800, seed=6)
    answers = [a.turn(), b.turn()]
    # No restore yet: the backend's save of a (on the switch) stands in for what a restore costs.
    costs = client.get("/api/backend").json()["restore_costs"]
    assert costs["restore"] == {} and costs["saves_stand_in"]["ms_per_mib"] + costs["saves_stand_in"]["fixed_ms"] > 0
    answers += [conv.turn() for _ in range(2) for conv in (a, b)]
    assert [r.headers["x-slotkeeper-cache"] for r in answers[2:]] == ["restored"] * 4
    costs = client.get("/api/backend").json()["restore_costs"]
    assert costs["saves_stand_in"] is None
    assert costs["prefill_ms_per_token"] > 0
    [(tier, fit)] = costs["restore"].items()  # one tier measured: the slot dir (no RAM dir here)
    assert tier == "disk" and fit["fixed_ms"] >= 0 and fit["ms_per_mib"] >= 0
    assert costs["trusted"] == []  # 4 restores: too few for a large restore to be skipped on their measure
    row = keeper.row("cost-a")
    assert row is not None
    assert costs["bytes_per_token"] == pytest.approx(row["n_bytes"] / row["n_tokens"], rel=0.2)
    restore_ms = fit["fixed_ms"] + fit["ms_per_mib"] * row["n_bytes"] / 2**20
    assert restore_ms < costs["prefill_ms_per_token"] * row["n_tokens"]  # a whole conversation's restore pays
    assert 1 <= costs["floor_tokens"] < row["n_tokens"]


def test_restart_of_backend_and_slotkeeper_resumes_from_disk(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    conv = Conversation(client_for(keeper), "persistent", size=900)
    first = conv.turn()
    turn1_total = timings(first)["prompt_n"] + timings(first)["predicted_n"]
    assert keeper.stop() in (0, -15)  # SIGTERM: every changed slot is saved, then uvicorn re-raises the signal
    assert "shutdown: saved 1 changed slot" in keeper.log_text()
    row = keeper.row("persistent")
    assert row is not None and row["n_tokens"] >= turn1_total - 1
    backend.stop()

    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    conv.client = client_for(keeper)
    resumed = conv.turn()
    assert resumed.headers["x-slotkeeper-cache"] == "restored"
    assert timings(resumed)["cache_n"] >= row["n_tokens"] - ANSWER_SLACK


def test_empty_save_never_replaces_a_good_snapshot(stack: Stack, client_for) -> None:
    """The backend restarts underneath slotkeeper (slot emptied); the next switch saves 0 tokens for the old
    occupant, and the good snapshot on disk must survive."""
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    client = client_for(keeper)
    a = Conversation(client, "keep-me", size=500)
    a.turn()
    Conversation(client, "other", size=300, seed=5).turn()  # saves keep-me
    good = keeper.row("keep-me")
    assert good is not None and good["n_tokens"] > 0
    a.turn()  # keep-me is hot again (restored) and dirty
    port = backend.port
    backend.stop()
    backend.port = port
    backend.start()  # same address, empty slot
    Conversation(client, "third", size=300, seed=9).turn()  # switching away saves keep-me: n_saved == 0
    after = keeper.row("keep-me")
    assert after is not None
    assert after["checksum"] == good["checksum"] and after["n_tokens"] == good["n_tokens"]
    assert len(saved_state_bytes(stack.slot_dir, after)) == after["n_bytes"]
    # Either the backend watch noticed the restart first and nothing was saved, or the save came back empty and
    # was refused; the good snapshot survives both ways.
    log = keeper.log_text()
    assert "saved 0 tokens" in log or "no longer holds tiny/keep-me" in log


def test_two_streams_share_one_slot(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1))
    results: dict[str, tuple[int, bool, str]] = {}

    def stream(session: str, seed: int) -> None:
        with httpx.Client(base_url=keeper.url, timeout=120) as client:
            body = {"messages": [{"role": "user", "content": f"stream {session} " * 40}], "max_tokens": 200,
                    "stream": True, "ignore_eos": True}
            with client.stream("POST", "/v1/chat/completions", json=body,
                               headers={"X-Session-Id": session}) as response:
                text = "".join(response.iter_text())
                results[session] = (response.status_code, "data: [DONE]" in text, response.headers.get(
                    "x-slotkeeper-cache", ""))

    threads = [threading.Thread(target=stream, args=(f"s{i}", i)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {"s0": (200, True, results["s0"][2]), "s1": (200, True, results["s1"][2])}


def test_client_hangup_cancels_upstream_and_frees_the_slot(stack: Stack, client_for) -> None:
    backend = stack.backend(parallel=1)
    keeper = stack.slotkeeper(backend)
    body = {"messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    # X-Conversation-Id would make llama-server keep generating after a hang-up if it were forwarded.
    with httpx.Client(base_url=keeper.url, timeout=60) as client, client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Conversation-Id": "hangup"}
    ) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        for _ in range(5):
            next(chunks)
        hung_up = time.monotonic()
    with httpx.Client(base_url=backend.url, timeout=5) as direct:
        idle = wait_until(lambda: not any(s["is_processing"] for s in direct.get("/slots").json()), timeout=1.0)
    assert idle, "the backend kept generating after the client hung up"
    nxt = chat(client_for(keeper), [{"role": "user", "content": "next"}], "next-one", max_tokens=2)
    assert nxt.status_code == 200
    assert time.monotonic() - hung_up < 3.0


IDENTITY_CASES = [
    ({"X-Session-Id": "h1", "X-Conversation-Id": "h2"}, {}, "h1"),
    ({"X-Conversation-Id": "h2", "Session-Id": "h3"}, {}, "h2"),
    ({"Session-Id": "h3", "Conversation-Id": "h4"}, {}, "h3"),
    ({"Conversation-Id": "h4", "X-OpenWebUI-Chat-Id": "h5"}, {"session_id": "b1"}, "h4"),
    ({"X-OpenWebUI-Chat-Id": "h5"}, {"session_id": "b1"}, "h5"),
    ({}, {"session_id": "b1", "conversation_id": "b2"}, "b1"),
    ({}, {"conversation_id": "b2", "chat_id": "b3"}, "b2"),
    ({}, {"chat_id": "b3", "id": "b4"}, "b3"),
    ({}, {"id": "b4"}, "b4"),
    ({}, {"id": "chatcmpl-123"}, "sys-"),
    ({}, {}, "sys-"),
]


def test_identity_rules_through_a_real_backend(stack: Stack, client_for) -> None:
    client = client_for(stack.slotkeeper(stack.backend()))
    messages = [{"role": "system", "content": "shared system prompt"}, {"role": "user", "content": "hi"}]
    for headers, fields, expected in IDENTITY_CASES:
        response = client.post("/v1/chat/completions", headers=headers,
                               json={"messages": messages, "max_tokens": 1, **fields})
        assert response.status_code == 200, response.text
        assert response.headers["x-slotkeeper-session"].startswith(expected), (headers, fields)
    no_system = client.post("/v1/chat/completions", json={"messages": messages[1:], "max_tokens": 1})
    assert no_system.headers["x-slotkeeper-session"].startswith("chat-")  # named by its first message
    raw = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert raw.headers["x-slotkeeper-session"] == "default"  # no messages, no id


def test_text_completions_stream_and_not(stack: Stack, client_for) -> None:
    client = client_for(stack.slotkeeper(stack.backend()))
    prompt = "Once upon a time " * 20
    first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "session_id": "raw"})
    assert first.status_code == 200 and first.json()["choices"][0]["text"] is not None
    assert first.headers["x-slotkeeper-session"] == "raw"
    with client.stream("POST", "/v1/completions", json={"prompt": prompt + "and", "max_tokens": 4, "stream": True,
                                                         "session_id": "raw"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-slotkeeper-cache"] == "hot"
        body = response.read().decode()
    assert body.rstrip().endswith("data: [DONE]")


def test_backend_errors_pass_through_with_status_and_shape(stack: Stack, client_for) -> None:
    client = client_for(stack.slotkeeper(stack.backend(ctx_per_slot=2048)))
    too_long = [{"role": "user", "content": "x " * 3000}]
    for stream in (False, True):
        response = client.post("/v1/chat/completions", headers={"X-Session-Id": "big"},
                               json={"messages": too_long, "max_tokens": 2, "stream": stream})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 2048
    # The slot is free again and the session's next (small) turn works.
    assert chat(client, [{"role": "user", "content": "small"}], "big").status_code == 200


def test_health_and_models_do_not_wait_for_a_busy_slot(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1))
    body = {"messages": [{"role": "user", "content": "busy"}], "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=keeper.url, timeout=60) as client, client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "busy"}
    ) as response:
        chunks = response.iter_raw()  # keep the iterator: a collected one closes the stream
        next(chunks)
        with httpx.Client(base_url=keeper.url, timeout=5) as other:
            started = time.monotonic()
            assert other.get("/health").status_code == 200
            assert other.get("/v1/models").status_code == 200
            assert other.get("/api/sessions/current").json()["slots"][0]["busy"] is True
            elapsed = time.monotonic() - started
    assert elapsed < 2.0, elapsed


def test_a_finished_turn_reaches_disk_when_idle(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(), "--save-idle-seconds", "0.3")
    first = Conversation(client_for(keeper), "idle", size=300).turn()
    assert wait_until(lambda: keeper.row("idle") is not None, timeout=10)
    row = keeper.row("idle")
    assert row is not None
    assert row["n_tokens"] == timings(first)["prompt_n"] + timings(first)["predicted_n"] - 1


def test_a_state_that_saves_quickly_is_on_disk_before_the_next_conversation(stack: Stack, client_for) -> None:
    """--save-idle-seconds is the longest a changed slot idles unsaved: a state the backend writes in milliseconds
    is saved after twice that, at least 0.25 s. With the limit at 120 s, B's state reaches disk long before it, and
    the switch back to A finds B saved and waits for no save."""
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0), "--save-idle-seconds", "120")
    client = client_for(keeper)
    a = Conversation(client, "quick-a", size=600, seed=1)
    b = Conversation(client, "quick-b", size=600, seed=2)
    a.turn()
    b.turn()  # the switch saves A: from then on the backend's write rate is known
    assert keeper.row("quick-a") is not None
    started = time.monotonic()
    assert wait_until(lambda: keeper.row("quick-b") is not None, timeout=60, interval=0.2)
    assert time.monotonic() - started < 60  # the idle save, not the 120 s limit
    again = a.turn()
    assert again.headers["x-slotkeeper-cache"] == "restored"
    rows = httpx.get(f"{keeper.url}/api/requests/recent", params={"limit": 5}).json()["requests"]
    newest = next(r for r in rows if r["session"] == "quick-a")
    assert newest["save_ms"] == 0 and newest["restore_ms"] > 0, newest


@pytest.mark.parametrize("marker", ["shape", "header"])
def test_side_task_does_not_become_the_session(stack: Stack, client_for, marker: str) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    client = client_for(keeper)
    conv = Conversation(client, "chat-7", size=700)
    first = conv.turn()
    task = "### Task:\nGenerate a concise, 3-5 word title for the chat history.\n" + words(300, 42)
    headers = {"X-OpenWebUI-Chat-Id": "chat-7"}
    if marker == "header":
        headers["X-OpenWebUI-Task"] = "title_generation"
    response = client.post("/v1/chat/completions", headers=headers, json={
        "messages": [{"role": "user", "content": task}], "max_tokens": 4, "stream": False})
    assert response.status_code == 200 and response.headers["x-slotkeeper-request"] == "side"
    saved = keeper.row("chat-7")  # the conversation was saved before the task ran
    assert saved is not None and saved["n_tokens"] >= timings(first)["prompt_n"]
    second = conv.turn()
    assert second.headers["x-slotkeeper-cache"] == "restored"
    assert timings(second)["cache_n"] >= timings(first)["prompt_n"]
    keeper.stop()
    assert keeper.row("chat-7")["n_tokens"] > saved["n_tokens"]  # type: ignore[index]
