"""Replicas trust only each other (peers.py, web/replicas.py): a forwarded request counts only when its signature
checks; a client's forwarding headers change nothing and are never passed on; replicas off the allow-list are never
contacted; and a relayed answer's connection is closed however the relay ends."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest
from starlette.requests import ClientDisconnect, Request

from slotkeeper.fleet.peers import FORWARDED, HEADERS, HOPS, SENT_AT, SIGNATURE, SKEW_SECONDS, Peers, is_base_url
from slotkeeper.web.replicas import Replicas, _forward, _Relayed, hops_of

SECRET = "the-replicas-shared-secret"
ONE, TWO = "http://gpu-1:11434", "http://gpu-2:11434"
NOW = 1_800_000_000.0


def headers_of(pairs: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in pairs}


def test_a_signed_forward_counts_and_anything_else_does_not() -> None:
    one, two = Peers(SECRET, ONE, [TWO]), Peers(SECRET, TWO, [ONE])
    signed = headers_of(one.signed("POST", "/v1/chat/completions", 1, now=NOW))
    got = two.forwarding("POST", "/v1/chat/completions", signed, now=NOW + 1)
    assert got is not None and (got.sender, got.hops) == (ONE, 1)
    tampered = [
        ("another target", "POST", "/api/chat", signed),
        ("another method", "GET", "/v1/chat/completions", signed),
        ("more hops", "POST", "/v1/chat/completions", {**signed, HOPS: "2"}),
        ("another time", "POST", "/v1/chat/completions", {**signed, SENT_AT: str(int(NOW) + 1)}),
        ("another sender", "POST", "/v1/chat/completions", {**signed, FORWARDED: "http://gpu-3:11434"}),
        ("a superscript two", "POST", "/v1/chat/completions", {**signed, HOPS: "\u00b2"}),
        ("a sign", "POST", "/v1/chat/completions", {**signed, HOPS: "+1"}),
        ("no signature", "POST", "/v1/chat/completions", {k: v for k, v in signed.items() if k != SIGNATURE}),
        ("a forged signature", "POST", "/v1/chat/completions", {**signed, SIGNATURE: "0" * 64}),
    ]
    for why, method, target, headers in tampered:
        assert two.forwarding(method, target, headers, now=NOW + 1) is None, why
    assert two.forwarding("POST", "/v1/chat/completions", signed, now=NOW + SKEW_SECONDS + 1) is None  # too old
    other_set = Peers("another set's secret!", TWO, [ONE])
    assert other_set.forwarding("POST", "/v1/chat/completions", signed, now=NOW) is None
    not_listed = Peers(SECRET, TWO, [])
    assert not_listed.forwarding("POST", "/v1/chat/completions", signed, now=NOW) is None


def test_a_forwards_signature_covers_its_body() -> None:
    """Likely at 99614b5: the signature covered method, target, hops, time and sender, so a captured forward's
    headers made any other body count as forwarded within 30 s. Now another body does not check."""
    one, two = Peers(SECRET, ONE, [TWO]), Peers(SECRET, TWO, [ONE])
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    signed = headers_of(one.signed("POST", "/v1/chat/completions", 1, now=NOW, body=body))
    assert two.forwarding("POST", "/v1/chat/completions", signed, now=NOW + 1, body=body) is not None
    assert two.forwarding("POST", "/v1/chat/completions", signed, now=NOW + 1, body=body + b" ") is None
    assert two.forwarding("POST", "/v1/chat/completions", signed, now=NOW + 1) is None


def test_the_allow_list_takes_base_urls_only() -> None:
    peers = Peers(SECRET, ONE, ["http://gpu-2:11434", "http://10.0.0.*:11434"])
    assert peers.allows(ONE) and peers.allows("http://GPU-2:11434") and peers.allows("http://10.0.0.7:11434")
    for url in ("http://gpu-3:11434", "http://10.0.0.7:8080", "https://gpu-2:11434", "http://gpu-2:11434/v1",
                "http://user:pw@gpu-2:11434", "http://gpu-2:11434?x", "gpu-2:11434", "file:///etc/passwd",
                "http://10.0.0.7:11434@evil:1", "http://gpu-2:11434#", ""):
        assert not peers.allows(url), url
    assert is_base_url("http://[::1]:11434") and not is_base_url("http://[::1]:11434/")


def request_with(headers: list[tuple[bytes, bytes]], path: str = "/v1/chat/completions",
                 body: bytes = b'{"model": "m"}') -> Request:
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers, "scheme": "http", "server": ("127.0.0.1", 11434), "client": ("10.0.0.9", 1),
             "root_path": "", "http_version": "1.1"}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


FORGED = [(FORWARDED.encode(), ONE.encode()), (HOPS.encode(), b"2"), (SENT_AT.encode(), b"1800000000"),
          (SIGNATURE.encode(), b"ab" * 32), (b"x-slotkeeper-anything", b"1")]


def test_a_clients_forwarding_headers_count_as_none() -> None:
    peers = Peers(SECRET, TWO, [ONE])
    assert hops_of(request_with(FORGED), peers) == 0 == hops_of(request_with([]), peers)
    assert hops_of(request_with([(HOPS.encode(), b"\xb2")]), peers) == 0
    one = Peers(SECRET, ONE, [TWO])
    assert hops_of(request_with(one.signed("POST", "/v1/chat/completions", 1)), peers) == 1


class Directory:
    """What _forward asks of the directory."""

    replica = TWO
    forwarded = 0

    def shun(self, replica: str) -> None:
        raise AssertionError("nothing refused here")


async def test_a_forward_is_signed_and_passes_on_none_of_the_clients_forwarding_headers() -> None:
    sent: list[httpx.Request] = []

    def replica_one(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, content=b"ok")

    replicas = Replicas(Directory(), 5.0, Peers(SECRET, TWO, [ONE]))  # type: ignore[arg-type]
    await replicas.http.aclose()
    replicas.http = httpx.AsyncClient(transport=httpx.MockTransport(replica_one))
    try:
        answer = await _forward(request_with([(b"authorization", b"Bearer k"), *FORGED]), replicas, ONE, 0)
        assert answer is not None and len(sent) == 1
        headers = sent[0].headers
        assert headers["authorization"] == "Bearer k" and "x-slotkeeper-anything" in headers
        got = Peers(SECRET, ONE, [TWO]).forwarding("POST", "/v1/chat/completions", dict(headers),
                                                   body=sent[0].content)
        assert got is not None and (got.sender, got.hops) == (TWO, 1)  # this replica's signature, not the client's
        assert [v for k, v in headers.multi_items() if k in HEADERS and k != SIGNATURE] == [TWO, "1", headers[SENT_AT]]
        # A replica the allow-list does not name (a URL someone wrote into Redis) gets nothing: the client's
        # credentials stay here, and the request runs here.
        assert await _forward(request_with([(b"authorization", b"Bearer k")]), replicas, "http://evil:80", 0) is None
        assert len(sent) == 1
    finally:
        await replicas.aclose()


@pytest.mark.parametrize("spec", ["2.0", "2.4"])
async def test_a_relayed_answer_is_closed_when_the_client_left_before_its_first_byte(spec: str) -> None:
    closed = asyncio.Event()

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            yield b"never read"

        async def aclose(self) -> None:
            closed.set()

    answer = httpx.Response(200, stream=Stream())
    relayed = _Relayed(answer, ONE)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if spec == "2.4":
            raise OSError("the client is gone")
        await asyncio.sleep(3600)  # a client that reads nothing: the disconnect ends the relay

    with contextlib.suppress(ClientDisconnect):
        await asyncio.wait_for(relayed({"type": "http", "asgi": {"spec_version": spec}}, receive, send), 10)
    assert closed.is_set()


@pytest.mark.parametrize("dies", [httpx.ConnectError("refused"), httpx.RemoteProtocolError("closed, no answer"),
                                  httpx.ReadError("reset")])
async def test_a_replica_that_dies_with_a_forwarded_request_leaves_it_to_run_here(dies: Exception) -> None:
    shunned: list[str] = []

    class Shunning(Directory):
        def shun(self, replica: str) -> None:
            shunned.append(replica)

    def dead_replica(request: httpx.Request) -> httpx.Response:
        raise dies

    replicas = Replicas(Shunning(), 5.0, Peers(SECRET, TWO, [ONE]))  # type: ignore[arg-type]
    await replicas.http.aclose()
    replicas.http = httpx.AsyncClient(transport=httpx.MockTransport(dead_replica))
    try:
        assert await _forward(request_with([]), replicas, ONE, 0) is None
        assert shunned == [ONE]
    finally:
        await replicas.aclose()
