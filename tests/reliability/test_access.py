"""Access: keys on model and admin routes, the DNS-rebinding Host check, the body cap, private directories, and the
backend's own /slots never reachable through slotkeeper. Each refusal comes in the client's own dialect."""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from slotkeeper.config import Settings
from tests.protocol.fake_upstream import FakeUpstream
from tests.support import Slotkeeper

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
Start = Callable[..., tuple[Slotkeeper, FakeUpstream]]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    running: list[tuple[Slotkeeper, FakeUpstream]] = []

    def _start(*args: str) -> tuple[Slotkeeper, FakeUpstream]:
        upstream = FakeUpstream(tmp_path / f"slots{len(running)}").start()
        keeper = Slotkeeper(tmp_path / f"cache{len(running)}", tmp_path / "slotkeeper.log")
        keeper.extra_args = ("--upstream", upstream.url, "--slot-dir", str(upstream.slot_dir), *args)
        running.append((keeper.start(), upstream))
        return keeper, upstream

    yield _start
    for keeper, upstream in running:
        keeper.stop()
        upstream.stop()


def test_without_keys_everything_is_open(start: Start) -> None:
    keeper, _ = start()
    with httpx.Client(base_url=keeper.url) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert c.get("/api/sessions").status_code == 200


def test_api_key_guards_model_and_admin_routes(start: Start) -> None:
    keeper, upstream = start("--api-key", "k1")
    at_start = len(upstream.requests)  # discovery's own (the KV probe's prefill)
    with httpx.Client(base_url=keeper.url) as c:
        refused = c.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k1"}).status_code == 200
        assert c.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "k1"}).status_code == 200
        assert c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k2"}).status_code == 401
        assert c.get("/api/sessions").status_code == 401
        assert c.get("/api/sessions", headers={"x-api-key": "k1"}).status_code == 200
        assert c.get("/health").status_code == 200
    assert len(upstream.requests) - at_start == 2  # refused requests never reached the backend


def test_admin_key_is_separate(start: Start) -> None:
    keeper, _ = start("--api-key", "user", "--admin-key", "root")
    with httpx.Client(base_url=keeper.url) as c:
        assert c.get("/api/sessions", headers={"x-api-key": "user"}).status_code == 401
        assert c.get("/api/sessions", headers={"x-api-key": "root"}).status_code == 200
        for admin_only in ("/api/backend", "/api/requests/recent", "/metrics"):
            assert c.get(admin_only, headers={"x-api-key": "user"}).status_code == 401, admin_only
            assert c.get(admin_only, headers={"x-api-key": "root"}).status_code == 200, admin_only
        assert c.post("/api/sessions/clear", headers={"x-api-key": "user"}).status_code == 401
        assert c.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "root"}).status_code == 200


@pytest.mark.parametrize(("path", "body", "shape"), [
    ("/v1/chat/completions", CHAT, lambda j: j["error"]["type"] == "authentication_error"),
    ("/api/chat", {"model": "fake", "messages": []}, lambda j: isinstance(j["error"], str)),
    ("/v1/messages", {"model": "fake", "max_tokens": 1, "messages": []},
     lambda j: j["type"] == "error" and j["error"]["type"] == "authentication_error"),
], ids=["openai", "ollama", "anthropic"])
def test_refusals_speak_the_clients_dialect(start: Start, path: str, body: dict, shape: Callable) -> None:
    keeper, _ = start("--api-key", "k")
    with httpx.Client(base_url=keeper.url) as c:
        response = c.post(path, json=body)
    assert response.status_code == 401 and shape(response.json()), response.text


@pytest.mark.parametrize(("host", "extra", "allowed"), [
    ("localhost:11434", (), True),
    ("127.0.0.1", (), True),
    ("[::1]:11434", (), True),
    ("attacker.example", (), False),
    ("attacker.example:11434", (), False),
    ("box.lan:11434", ("--allowed-hosts", "box.lan"), True),
    ("other.lan", ("--allowed-hosts", "box.lan"), False),
], ids=["localhost", "ipv4-loopback", "ipv6-loopback", "rebinding", "rebinding-port", "allowed", "not-listed"])
def test_host_header_check_stops_dns_rebinding(start: Start, host: str, extra: tuple[str, ...],
                                              allowed: bool) -> None:
    keeper, _ = start(*extra)
    with httpx.Client(base_url=keeper.url) as c:
        response = c.post("/v1/chat/completions", json=CHAT, headers={"Host": host})
    assert (response.status_code == 200) is allowed, response.text
    if not allowed:
        assert response.status_code == 403 and response.json()["error"]["type"] == "permission_error"


def test_openwebui_in_docker_is_told_which_setting_lets_it_in(start: Start) -> None:
    """OpenWebUI in Docker (Docker Desktop) reaches slotkeeper on the host's loopback as host.docker.internal: the
    refusal names the setting, in the client's own API shape, and that setting lets it in."""
    keeper, _ = start()
    with httpx.Client(base_url=keeper.url) as c:
        refused = c.post("/api/chat", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                            "stream": False}, headers={"Host": "host.docker.internal:11434"})
    assert refused.status_code == 403, refused.text
    message = refused.json()["error"]
    assert "--allowed-hosts host.docker.internal" in message and "SLOTKEEPER_ALLOWED_HOSTS" in message
    assert "OpenWebUI in Docker" in message
    keeper, _ = start("--allowed-hosts", "host.docker.internal")
    with httpx.Client(base_url=keeper.url) as c:
        let_in = c.post("/v1/chat/completions", json=CHAT, headers={"Host": "host.docker.internal:11434"})
    assert let_in.status_code == 200, let_in.text


def test_huge_bodies_get_413_declared_or_chunked(start: Start) -> None:
    keeper, upstream = start("--max-body-bytes", "2000")
    at_start = len(upstream.requests)  # discovery's own (the KV probe's prefill)
    big = {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 1}
    with httpx.Client(base_url=keeper.url) as c:
        declared = c.post("/v1/chat/completions", json=big)
        assert declared.status_code == 413 and declared.json()["error"]["type"] == "request_too_large"

        def chunks() -> Iterator[bytes]:
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'

        chunked = c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413, chunked.text
        ollama = c.post("/api/chat", json={"model": "fake", **big})
        assert ollama.status_code == 413 and isinstance(ollama.json()["error"], str)
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert len(upstream.requests) - at_start == 1


def test_the_backends_slot_actions_are_not_reachable(start: Start) -> None:
    keeper, upstream = start()
    before = sorted(p.name for p in upstream.slot_dir.iterdir())
    with httpx.Client(base_url=keeper.url) as c:
        # GET /slots is slotkeeper's own view (ids, busy, context, token counts), never the backend's list, which
        # shows each slot's prompt.
        slots = c.get("/slots")
        assert slots.status_code == 200
        assert slots.json() == [{"id": 0, "n_ctx": 4096, "is_processing": False, "n_tokens": 0}]
        for action in ("save", "restore", "erase"):
            response = c.post(f"/slots/0?action={action}", json={"filename": "../../evil.bin"})
            assert response.status_code in (404, 405)
            assert response.json()["error"]["code"] == response.status_code  # llama-server's error shape
        assert c.post("/props", json={"n_ctx": 1}).status_code == 405
    assert sorted(p.name for p in upstream.slot_dir.iterdir()) == before


def test_directories_are_private_and_binding_is_loopback(start: Start) -> None:
    keeper, _ = start()
    mode = stat.S_IMODE(keeper.cache_dir.stat().st_mode)
    assert mode == 0o700, oct(mode)
    assert Settings().host == "127.0.0.1"
