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
