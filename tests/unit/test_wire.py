"""The upstream HTTP/1.1 client against small raw asyncio servers: framing, connection reuse, the spare connection,
and every way a connection can fail."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from slotkeeper.upstream.wire import ConnectFailed, TimedOut, TransportError, WireClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """Counts accepted connections and the requests read on them; `handler` answers each request."""

    def __init__(self, handler: Callable[[RawServer, bytes, asyncio.StreamWriter], Awaitable[bool]]) -> None:
        self.handler = handler
        self.accepted = 0
        self.requests: list[bytes] = []
        self.open_connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open_connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length) if length else b""
                self.requests.append(head + body)
                if not await self.handler(self, head + body, writer):
                    return
        finally:
            self.open_connections -= 1
            writer.close()


@asynccontextmanager
async def raw_server(handler: Callable[[RawServer, bytes, asyncio.StreamWriter], Awaitable[bool]]
                     ) -> AsyncIterator[tuple[RawServer, str]]:
    state = RawServer(handler)
    server = await asyncio.start_server(state.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        server.close()


def fixed(status: int, body: bytes, close: bool = False) -> Callable[[RawServer, bytes, asyncio.StreamWriter],
                                                                   Awaitable[bool]]:
    async def handler(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        extra = b"Connection: close\r\n" if close else b""
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
                     % (status, len(body), extra, body))
        await writer.drain()
        return not close
    return handler


async def read_all(client: WireClient, path: str = "/x", **kwargs: object) -> tuple[int, bytes]:
    response = await client.request("GET", path, **kwargs)  # type: ignore[arg-type]
    try:
        return response.status_code, await response.aread()
    finally:
        await response.aclose()


async def test_content_length_answer_and_request_framing() -> None:
    async with raw_server(fixed(200, b'{"ok": true}')) as (server, url):
        client = WireClient(url + "/prefix/", headers={"User-Agent": "test"})
        response = await client.request("POST", "/v1/x?a=1", body=b'{"q": 1}',
                                        headers={"Content-Type": "application/json"})
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert await response.aread() == b'{"ok": true}'
        await response.aclose()
        await client.aclose()
    request = server.requests[0]
    assert request.startswith(b"POST /prefix/v1/x?a=1 HTTP/1.1\r\n")
    assert b"\r\nContent-Length: 8\r\n" in request and b"\r\nUser-Agent: test\r\n" in request
    assert request.endswith(b'\r\n\r\n{"q": 1}')
    assert f"Host: 127.0.0.1:{url.rsplit(':', 1)[1]}".encode() in request


async def test_chunked_stream_comes_in_parts_that_arrived_together() -> None:
    release = asyncio.Event()

    async def handler(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"6\r\ndata 1\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\ndata 2\r\n6\r\ndata 3\r\n0\r\n\r\n")  # two chunks in one write
        await writer.drain()
        return True

    async with raw_server(handler) as (server, url):
        client = WireClient(url)
        response = await client.request("POST", "/s", body=b"{}")
        parts = []
        async for part in response.aiter_raw():
            parts.append(part)
            release.set()
        await response.aclose()
        assert parts[0] == b"data 1"
        assert b"".join(parts) == b"data 1data 2data 3"
        assert len(parts) == 2  # the two chunks that came in one read are handed on as one part
        # The connection went back to the client: the next request reuses it.
        assert (await read_all(client))[0] == 200
        assert server.accepted <= 2 and len(server.requests) == 2
        await client.aclose()


async def test_keep_alive_connection_is_reused_without_a_spare() -> None:
    async with raw_server(fixed(200, b"{}")) as (server, url):
        client = WireClient(url, spare=False)
        for _ in range(5):
            assert await read_all(client) == (200, b"{}")
        assert server.accepted == 1 and len(server.requests) == 5
        await client.aclose()


async def test_spare_connection_is_open_before_the_next_request() -> None:
    """llama-server closes the connection after each streamed answer; the next request finds one opened ahead."""
    async with raw_server(fixed(200, b"{}", close=True)) as (server, url):
        client = WireClient(url)
        assert await read_all(client) == (200, b"{}")
        for _ in range(50):  # the spare is opened in the background
            if client._idle is not None:
                break
            await asyncio.sleep(0.01)
        assert client._idle is not None and not client._idle.closed
        assert server.accepted == 2
        assert await read_all(client) == (200, b"{}")
        assert len(server.requests) == 2
        await asyncio.sleep(0.05)
        # Never more than one connection waits idle: the one in use was closed, a new spare is open.
        assert server.open_connections <= 1
        await client.aclose()


async def test_idle_connection_closed_by_the_server_is_retried_on_a_new_one() -> None:
    async def handler(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        body = b"{}"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n" + body)
        await writer.drain()
        return False  # close right after answering, without saying so (a keep-alive timeout)

    async with raw_server(handler) as (server, url):
        client = WireClient(url, spare=False)
        assert await read_all(client) == (200, b"{}")
        await asyncio.sleep(0.05)
        assert await read_all(client) == (200, b"{}")
        assert server.accepted == 2
        await client.aclose()


async def test_connection_refused_is_connect_failed() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    client = WireClient(f"http://127.0.0.1:{port}")
    with pytest.raises(ConnectFailed) as caught:
        await client.request("GET", "/health")
    assert caught.value.kind == "ConnectError"
    await client.aclose()


async def test_no_answer_is_a_read_timeout() -> None:
    async def silent(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async with raw_server(silent) as (_server, url):
        client = WireClient(url, spare=False)
        with pytest.raises(TimedOut) as caught:
            await client.request("GET", "/slow", timeout=0.2)
        assert caught.value.kind == "ReadTimeout"
        await client.aclose()


async def test_stalled_body_is_a_read_timeout() -> None:
    async def stall(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await asyncio.sleep(5)
        return False

    async with raw_server(stall) as (_server, url):
        client = WireClient(url, spare=False, read_timeout=0.2)
        response = await client.request("GET", "/s")
        with pytest.raises(TimedOut):
            async for _ in response.aiter_raw():
                pass
        await response.aclose()
        await client.aclose()


async def test_connection_dropped_mid_body_is_a_read_error() -> None:
    async def drop(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        return False

    async with raw_server(drop) as (_server, url):
        client = WireClient(url, spare=False)
        response = await client.request("GET", "/s")
        received = b""
        with pytest.raises(TransportError) as caught:
            async for part in response.aiter_raw():
                received += part
        assert received == b"hello" and caught.value.kind == "ReadError"
        await response.aclose()
        await client.aclose()


async def test_closed_without_an_answer_on_a_new_connection_is_an_error() -> None:
    async def hang_up(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        return False

    async with raw_server(hang_up) as (server, url):
        client = WireClient(url, spare=False)
        with pytest.raises(TransportError) as caught:
            await client.request("GET", "/x")
        assert caught.value.kind == "RemoteProtocolError"
        assert server.accepted == 1  # a new connection is not retried: the server may have acted on the request
        await client.aclose()


async def test_malformed_answer_is_a_protocol_error() -> None:
    async def garbage(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SPDY/9 what\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)
        return False

    async with raw_server(garbage) as (_server, url):
        client = WireClient(url, spare=False)
        with pytest.raises(TransportError) as caught:
            await client.request("GET", "/x")
        assert caught.value.kind == "RemoteProtocolError"
        await client.aclose()


async def test_body_until_close_and_large_body_with_a_slow_reader() -> None:
    big = bytes(range(256)) * (3 * 4096 + 7)  # over 3 MiB: reading pauses and resumes

    async def until_close(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + big)
        await writer.drain()
        return False

    async with raw_server(until_close) as (_server, url):
        client = WireClient(url, spare=False)
        response = await client.request("GET", "/big")
        received = bytearray()
        async for part in response.aiter_raw():
            received += part
            await asyncio.sleep(0.001)
        assert bytes(received) == big
        await response.aclose()
        await client.aclose()


async def test_response_closed_early_closes_its_connection() -> None:
    async def endless(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"1\r\nx\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            return False

    async with raw_server(endless) as (server, url):
        client = WireClient(url, spare=False)
        response = await client.request("GET", "/s")
        async for _ in response.aiter_raw():
            break
        await response.aclose()
        for _ in range(100):
            if server.open_connections == 0:
                break
            await asyncio.sleep(0.01)
        assert server.open_connections == 0
        assert client._idle is None
        await client.aclose()


async def test_idle_connection_is_closed_after_idle_expiry() -> None:
    """An idle connection holds one of llama-server's few HTTP threads: it is given back soon."""
    async with raw_server(fixed(200, b"{}")) as (server, url):
        client = WireClient(url, idle_expiry=0.1)
        assert await read_all(client) == (200, b"{}")
        assert server.open_connections == 1
        for _ in range(100):
            if server.open_connections == 0:
                break
            await asyncio.sleep(0.01)
        assert server.open_connections == 0 and client._idle is None
        assert await read_all(client) == (200, b"{}")  # and the next request connects anew
        assert server.accepted == 2
        await client.aclose()


async def test_a_timeout_on_a_kept_connection_is_not_sent_again() -> None:
    """Only a connection closed before any answer is the server's keep-alive timeout; a server that is slow to
    answer may be working on the request, so it is never sent twice."""
    async def first_fast_then_silent(server: RawServer, request: bytes, writer: asyncio.StreamWriter) -> bool:
        if len(server.requests) == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            return True
        await asyncio.sleep(5)
        return False

    async with raw_server(first_fast_then_silent) as (server, url):
        client = WireClient(url, spare=False)
        assert await read_all(client) == (200, b"{}")
        with pytest.raises(TimedOut):
            await client.request("POST", "/slow", body=b"{}", timeout=0.2)
        assert len(server.requests) == 2 and server.accepted == 1
        await client.aclose()


async def test_a_request_cancelled_while_it_waits_for_the_spare_sends_nothing() -> None:
    """A caller cancelled while its request waits for the spare connection being opened (a shutdown flush given
    up) is cancelled: the request is not sent on a new connection after all. The spare is kept for the next one."""
    async with raw_server(fixed(200, b"{}")) as (server, url):
        client = WireClient(url)
        go = asyncio.Event()

        async def slow_spare() -> object:
            await go.wait()
            return await client._connect(None)

        client._opening = asyncio.create_task(slow_spare())  # type: ignore[assignment]
        client._opening.add_done_callback(client._spare_opened)  # type: ignore[arg-type]
        request = asyncio.create_task(read_all(client))
        await asyncio.sleep(0.05)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        go.set()
        await asyncio.sleep(0.1)
        assert server.requests == []
        assert client._idle is not None and not client._idle.closed  # the spare, opened after all
        assert await read_all(client) == (200, b"{}")
        assert server.accepted == 1 and len(server.requests) == 1
        await client.aclose()
