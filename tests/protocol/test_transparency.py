"""Invariant 1 (transparency): the backend receives the client's body unchanged, minus our own fields, plus only
`id_slot` and `cache_prompt`; client headers are never forwarded (llama-server treats X-Conversation-Id specially)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.protocol.fake_upstream import FakeUpstream
from tests.support import Slotkeeper


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[FakeUpstream, Slotkeeper]]:
    upstream = FakeUpstream(tmp_path / "slots").start()
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log")
    keeper.extra_args = ("--upstream", upstream.url, "--slot-dir", str(upstream.slot_dir))
    keeper.start()
    try:
        yield upstream, keeper
    finally:
        keeper.stop()
        upstream.stop()


CLIENT_HEADERS = {
    "X-Conversation-Id": "conv-1",
    "X-Session-Id": "sess-1",
    "Authorization": "Bearer secret",
    "Cookie": "a=b",
    "X-OpenWebUI-Chat-Id": "chat-9",
    "User-Agent": "test-client/1.0",
}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_body_forwarded_unchanged_except_our_fields(fake: tuple[FakeUpstream, Slotkeeper], stream: bool) -> None:
    upstream, keeper = fake
    body = {
        "model": "whatever", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
        "temperature": 0.3, "max_tokens": 7, "stream": stream, "stream_options": {"include_usage": True},
        "thinking_budget_tokens": 0, "chat_template_kwargs": {"enable_thinking": False}, "custom": [1, {"x": 2}],
        "session_id": "body-session", "conversation_id": "c", "chat_id": "d", "id": "e",
        "id_slot": 5, "cache_prompt": False,
    }
    with httpx.Client(base_url=keeper.url, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=body, headers=CLIENT_HEADERS)
    assert response.status_code == 200
    assert response.headers["x-slotkeeper-session"] == "sess-1"
    sent = upstream.requests[-1]
    expected = {k: v for k, v in body.items()
                if k not in ("session_id", "conversation_id", "chat_id", "id", "id_slot", "cache_prompt")}
    assert sent.body == {**expected, "id_slot": 0, "cache_prompt": True}
    assert sent.headers["user-agent"].startswith("slotkeeper/")
    forwarded = {k.lower() for k in sent.headers}
    for name in CLIENT_HEADERS:
        if name != "User-Agent":
            assert name.lower() not in forwarded, name


def test_upstream_error_passes_through_with_status_and_shape(fake: tuple[FakeUpstream, Slotkeeper]) -> None:
    _, keeper = fake
    with httpx.Client(base_url=keeper.url, timeout=30) as client:
        response = client.post("/v1/chat/completions", json={"messages": "fail", "stream": True})
    # A string `messages` is rejected by slotkeeper itself before reaching the backend.
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_upstream_breaking_mid_stream_ends_with_one_error_event(fake: tuple[FakeUpstream, Slotkeeper]) -> None:
    upstream, keeper = fake
    upstream.break_stream_after = 2
    with httpx.Client(base_url=keeper.url, timeout=30) as client:
        response = client.post("/v1/chat/completions", headers={"X-Session-Id": "s"},
                               json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert response.status_code == 200
    events = [e for e in response.text.split("\n\n") if e]
    assert events[:2] == ['data: {"choices":[{"delta":{"content":"t0"}}]}',
                          'data: {"choices":[{"delta":{"content":"t1"}}]}']
    assert events[-1].startswith('data: {"error"') and "[DONE]" not in response.text


@pytest.mark.parametrize("raw, fragment", [
    (b"", "empty"), (b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"),
    (b'{"messages": []}', "non-empty array"), (b'{"model": "x"}', "'messages'"),
])
def test_bad_request_bodies_get_a_clear_400(fake: tuple[FakeUpstream, Slotkeeper], raw: bytes, fragment: str) -> None:
    upstream, keeper = fake
    count = len(upstream.requests)
    with httpx.Client(base_url=keeper.url, timeout=30) as client:
        response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert len(upstream.requests) == count  # never reached the backend
