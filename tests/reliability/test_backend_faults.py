"""Backend faults: restarted underneath slotkeeper (no stale "hot" state is trusted), hung (requests time out with a
clean error, the queue drains, health says so), and back again."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Stack
from tests.support import ANSWER_SLACK, Conversation, chat, timings, wait_until

pytestmark = pytest.mark.backend


def test_backend_restarted_underneath_is_detected(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend, "--save-idle-seconds", "0.2")
    client = client_for(keeper)
    conv = Conversation(client, "survivor", size=600)
    conv.turn()
    assert wait_until(lambda: keeper.row("survivor") is not None)
    saved = keeper.row("survivor")
    port = backend.port
    backend.stop()
    backend.port = port
    backend.start()  # same address, fresh process: its slot holds nothing
    assert wait_until(lambda: client.get("/api/sessions/current").json()["slots"][0]["session"] is None, 10)
    resumed = conv.turn()
    # Without the detection this turn would be called "hot" and prefill everything (cache_n 0).
    assert resumed.headers["x-slotkeeper-cache"] == "restored"
    assert timings(resumed)["cache_n"] >= saved["n_tokens"] - ANSWER_SLACK  # type: ignore[index]
    assert "no longer holds tiny/survivor" in keeper.log_text()


def test_hung_backend_times_out_and_the_queue_drains(stack: Stack, client_for, tmp_path: Path) -> None:
    backend = stack.backend()
    keeper = stack.slotkeeper(backend, "--upstream-read-timeout", "2", "--slot-op-timeout", "2")
    client = client_for(keeper)
    assert chat(client, [{"role": "user", "content": "warm"}], "w").status_code == 200
    assert backend.process is not None
    backend.process.send_signal(signal.SIGSTOP)
    try:
        results: list[tuple[int, dict]] = []

        def call(i: int) -> None:
            with httpx.Client(base_url=keeper.url, timeout=60) as c:
                r = chat(c, [{"role": "user", "content": f"stuck {i}"}], f"s{i}")
                results.append((r.status_code, r.json()))

        started = time.monotonic()
        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        elapsed = time.monotonic() - started
        assert [status for status, _ in results] == [502, 502, 502]
        assert all(body["error"]["type"] == "upstream_unavailable" for _, body in results)
        assert elapsed < 20, elapsed  # a few 2 s timeouts, then fast failures once the watch sees it: no hang
        assert client.get("/health").status_code == 503
    finally:
        backend.process.send_signal(signal.SIGCONT)
    assert wait_until(lambda: client.get("/health").status_code == 200, 10)
    # Once the watch has seen the backend again (about a second), turns succeed again.
    assert wait_until(lambda: chat(client, [{"role": "user", "content": "alive"}], "w").status_code == 200, 30, 0.5)


def _outage_seen(keeper) -> bool:
    """slotkeeper counts the backend as down (any of the ways it says so)."""
    text = keeper.log_text()
    return ": it counts as down" in text or "is not answering /health" in text


def test_a_request_while_the_backend_restarts_waits_for_it(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)  # the default --backend-wait-seconds: 30
    client = client_for(keeper)
    conv = Conversation(client, "patient", size=300)
    conv.turn()
    port = backend.port
    backend.stop()
    assert wait_until(lambda: _outage_seen(keeper), 10)
    results: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: results.append(chat(client, conv.messages, "patient")))
    waiting.start()
    waiting.join(2)
    assert waiting.is_alive(), results[0].text if results else ""  # it waits instead of failing at once
    backend.port = port
    backend.start()
    waiting.join(60)
    assert [r.status_code for r in results] == [200], results[0].text
    # The new process held nothing: the turn did not count on the old slot (it was never saved: cold).
    assert results[0].headers["x-slotkeeper-cache"] != "hot"
    assert "the backend is back (the backend" in keeper.log_text()


def test_when_the_wait_runs_out_the_client_gets_its_dialects_error(stack: Stack, client_for) -> None:
    backend = stack.backend()
    keeper = stack.slotkeeper(backend, "--backend-wait-seconds", "1.5")
    client = client_for(keeper)
    assert chat(client, [{"role": "user", "content": "before"}], "w").status_code == 200
    backend.stop()
    assert wait_until(lambda: _outage_seen(keeper), 10)
    started = time.monotonic()
    openai = chat(client, [{"role": "user", "content": "while away"}], "w")
    waited = time.monotonic() - started
    assert openai.status_code == 502 and openai.json()["error"]["type"] == "upstream_unavailable"
    assert "did not come back within 1.5 s" in openai.json()["error"]["message"]
    assert 1.4 <= waited < 10, waited
    anthropic = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    body = anthropic.json()
    assert anthropic.status_code == 502 and body["type"] == "error" and body["error"]["type"] == "api_error"
    assert "did not come back" in body["error"]["message"]
    ollama = client.post("/api/chat", json={"model": "tiny", "stream": False,
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert ollama.status_code == 502 and "did not come back" in ollama.json()["error"]


def test_a_slow_backend_keeps_its_slots_and_their_unsaved_turns(stack: Stack, client_for) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)  # no idle saves: the turn stays unsaved in its slot
    client = client_for(keeper)
    conv = Conversation(client, "slow", size=400)
    first = conv.turn()
    assert backend.process is not None
    backend.process.send_signal(signal.SIGSTOP)  # alive, not answering: probes time out
    try:
        assert wait_until(lambda: _outage_seen(keeper), 30, 0.2)
    finally:
        backend.process.send_signal(signal.SIGCONT)
    assert wait_until(lambda: "the backend is back" in keeper.log_text(), 15, 0.2)
    slots = client.get("/api/sessions/current").json()["slots"]
    assert slots[0]["session"] == "slow"  # same process: the slot still holds it
    again = conv.turn()
    assert again.headers["x-slotkeeper-cache"] == "hot"
    assert timings(again)["cache_n"] >= timings(first)["prompt_n"] - ANSWER_SLACK
    assert keeper.row("slow") is None
    keeper.stop()  # the shutdown flush saves the slot that stayed changed through the outage
    saved = keeper.row("slow")
    assert saved is not None and saved["n_tokens"] > 0
