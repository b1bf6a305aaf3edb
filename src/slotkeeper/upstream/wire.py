"""A small HTTP/1.1 client for talking to one llama.cpp server: asyncio transports, responses parsed by llhttp
(the `httptools` package uvicorn already brings).

Why not a general client: every streamed token passes through here, and a pure-Python HTTP parser costs more CPU per
token than the rest of the proxy together. Body bytes that arrived together are handed on together. And llama-server
closes the connection after every streamed answer, so a spare connection is opened in the background for the next
request instead of on its path.

llama-server serves each open connection with a thread of a small pool (`--threads-http`, by default the slot count
plus two), and an idle keep-alive connection holds its thread until the server's 5 s keep-alive timeout: so at most
one idle connection is kept, and for at most `idle_expiry` seconds.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

# Body bytes buffered before reading from the socket pauses (a client that reads slower than the backend writes).
_HIGH_WATER = 1 << 20


class TransportError(Exception):
    """The connection failed: `kind` names how (ConnectError, ConnectTimeout, ReadTimeout, WriteTimeout, ReadError,
    RemoteProtocolError)."""

    def __init__(self, detail: str, kind: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class ConnectFailed(TransportError):
    pass


class TimedOut(TransportError):
    pass


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the server is: scheme, host, port, and a path prefix every request path is appended to."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, base_url: str) -> Origin:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the backend URL must look like http://HOST:PORT, not {base_url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


class _Connection(asyncio.Protocol):
    """One TCP connection; carries one request at a time. The parser callbacks fill the response state."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        self._parser: Any = None
        self._wakeup: asyncio.Future[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._last_activity = 0.0
        self._timeout = 0.0
        self._timed_out = False
        self._writable: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.keep_alive = False
        self.complete = False
        self.received_any = False
        self.error: TransportError | None = None
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self.complete:
            self.close()  # bytes nobody asked for: the connection cannot be trusted with another request
            return
        self.received_any = True
        if self._wakeup is not None:
            self._last_activity = self._wakeup.get_loop().time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(TransportError(f"the backend sent malformed HTTP ({exc})", "RemoteProtocolError"))
            self.close()
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._parser is not None and not self.complete and self.error is None:
            if self.head_done and self._ends_at_close():
                self.complete = True
            elif self.received_any:
                self._fail(TransportError("the backend closed the connection in the middle of a response",
                                          "ReadError"))
            else:
                self._fail(TransportError("the backend closed the connection without answering",
                                          "RemoteProtocolError"))
        self._wake()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # -- httptools callbacks -----------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = bool(self._parser.should_keep_alive())  # asked here: llhttp resets it at the message end
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # -- used by the client ------------------------------------------------------------------------------------

    def start(self, request: bytes) -> None:
        assert self.transport is not None
        self._reset()
        self._parser = httptools.HttpResponseParser(self)
        self.transport.write(request)

    async def drain(self, timeout: float | None) -> None:
        if self._writable is not None and not self._writable.done():
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self._writable)
            except TimeoutError as exc:
                raise TimedOut("the backend did not take the request in time", "WriteTimeout") from exc

    async def head(self, timeout: float | None) -> None:
        while not self.head_done and self.error is None:
            await self._wait(timeout)
        if self.error is not None:
            raise self.error

    async def body_part(self, timeout: float | None) -> bytes | None:
        """Everything received since the last call, waiting for something; None once the body is complete."""
        while not self._body and not self.complete and self.error is None:
            await self._wait(timeout)
        if self._body:
            data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            self._body.clear()
            self._buffered = 0
            if self._paused and self.transport is not None and not self.closed:
                self._paused = False
                self.transport.resume_reading()
            return data
        if self.error is not None:
            raise self.error
        return None

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def finished(self) -> None:
        self._stop_watch()
        self._parser = None
        self.idle_since = time.monotonic()

    def close(self) -> None:
        self.closed = True
        self._stop_watch()
        if self.transport is not None:
            self.transport.close()

    def _ends_at_close(self) -> bool:
        """A body with neither a length nor chunked encoding runs until the server closes the connection."""
        return ("content-length" not in self.headers and "chunked" not in self.headers.get("transfer-encoding", "")
                and self.status not in (204, 304) and self.status >= 200)

    def _fail(self, error: TransportError) -> None:
        if self.error is None:
            self.error = error

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _wait(self, timeout: float | None) -> None:
        """Wait for the next event on the connection. The read timeout is kept by one timer per wait that is only
        re-armed when it fires early (something arrived meanwhile), not by a new timer for every part."""
        loop = asyncio.get_running_loop()
        self._wakeup = loop.create_future()
        self._last_activity = loop.time()
        if timeout is not None:
            self._timeout = timeout
            if self._watchdog is None:
                self._watchdog = loop.call_at(self._last_activity + timeout, self._watch)
        try:
            await self._wakeup
        finally:
            self._wakeup = None
        if self._timed_out:
            self._timed_out = False
            raise TimedOut(f"no answer from the backend within {self._timeout:g} s", "ReadTimeout")

    def _watch(self) -> None:
        self._watchdog = None
        if self._wakeup is None or self._wakeup.done():
            return  # nobody is waiting: the next wait arms a new timer
        loop = asyncio.get_running_loop()
        due = self._last_activity + self._timeout
        if loop.time() >= due:
            self._timed_out = True
            self._wakeup.set_result(None)
        else:
            self._watchdog = loop.call_at(due, self._watch)

    def _stop_watch(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None


class WireResponse:
    """A response whose head has arrived; read the body with `aiter_raw()` or `aread()`, then `aclose()`."""

    def __init__(self, client: WireClient, conn: _Connection, timeout: float | None) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self._timeout = timeout
        self.status_code = conn.status
        self.headers: Mapping[str, str] = conn.headers
        self.content = b""

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each part is everything that came in since the previous one (chunked framing
        removed)."""
        conn = self._conn
        if conn is None:
            return
        while (part := await conn.body_part(self._timeout)) is not None:
            yield part
        self._release()

    async def aread(self) -> bytes:
        parts = [part async for part in self.aiter_raw()]
        self.content = b"".join(parts)
        return self.content

    async def aclose(self) -> None:
        """Give the connection back when the body was read to its end; close it otherwise."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client.release(conn)


class WireClient:
    """Requests to one server over HTTP/1.1 connections: one per request in flight, plus at most one idle. With
    `spare`, a connection the server closed after answering is replaced in the background by a new idle one, so
    the client holds no more connections than before and the next request does not wait for a connect."""

    def __init__(self, base_url: str, *, connect_timeout: float = 5.0, read_timeout: float | None = 600.0,
                 write_timeout: float = 60.0, idle_expiry: float = 2.0, spare: bool = True,
                 headers: Mapping[str, str] | None = None) -> None:
        self.origin = Origin.parse(base_url)
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._write_timeout = write_timeout
        self._idle_expiry = idle_expiry
        self._spare = spare
        self._headers = dict(headers or {})
        self._idle: _Connection | None = None
        self._opening: asyncio.Task[_Connection] | None = None
        self._ssl = ssl.create_default_context() if self.origin.scheme == "https" else None
        self._closed = False

    async def request(self, method: str, path: str, *, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None, timeout: float | None = None) -> WireResponse:
        """Send a request and wait for the response's head. `timeout` replaces the read timeout (the longest wait
        for the head and for each part of the body) and caps the connect timeout.

        A connection that was kept open and turns out to be closed before anything of the answer arrived is the
        server's keep-alive timeout, not an answer: the request is sent once more on a new connection.
        """
        data = self._encode(method, path, body, headers)
        read_timeout = self._read_timeout if timeout is None else timeout
        conn, reused = await self._take(timeout)
        try:
            return await self._send(conn, data, read_timeout)
        except TimedOut:
            raise  # the server may be working on it: never sent twice
        except TransportError:
            if not reused or conn.received_any:
                raise
        conn, _ = await self._take(timeout)
        return await self._send(conn, data, read_timeout)

    async def _send(self, conn: _Connection, data: bytes, read_timeout: float | None) -> WireResponse:
        """Write the request on `conn` and wait for the head of the answer; a failed connection is closed."""
        try:
            if conn.closed:
                raise TransportError("the backend closed the connection without answering", "RemoteProtocolError")
            conn.start(data)
            await conn.drain(self._write_timeout)
            await conn.head(read_timeout)
        except BaseException:
            conn.close()
            raise
        return WireResponse(self, conn, read_timeout)

    def release(self, conn: _Connection) -> None:
        """A response was read to its end: keep its connection as the idle one if it may be reused; when the server
        closed it (llama-server does after every streamed answer), open a spare in its place."""
        if self._closed:
            conn.close()
            return
        if not conn.reusable:
            conn.close()
            self._open_spare()
            return
        if self._idle is not None and not self._idle.closed:
            conn.close()
            return
        self._keep_idle(conn)

    def _keep_idle(self, conn: _Connection) -> None:
        """Hold `conn` as the idle connection for at most `idle_expiry` seconds: an idle connection holds one of
        the server's few HTTP threads."""
        conn.finished()
        self._idle = conn
        loop = asyncio.get_running_loop()
        loop.call_later(self._idle_expiry, self._expire, conn)

    def _expire(self, conn: _Connection) -> None:
        if self._idle is conn and time.monotonic() - conn.idle_since >= self._idle_expiry * 0.99:
            self._idle = None
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        if self._opening is not None:
            self._opening.cancel()
            self._opening = None
        if self._idle is not None:
            self._idle.close()
            self._idle = None

    async def _take(self, timeout: float | None) -> tuple[_Connection, bool]:
        idle, self._idle = self._idle, None
        if idle is not None and not idle.closed and time.monotonic() - idle.idle_since <= self._idle_expiry:
            return idle, True
        if idle is not None:
            idle.close()
        opening, self._opening = self._opening, None
        if opening is not None:
            try:
                # Not `await opening`: that would cancel the spare with the caller, and leave no way to tell the
                # caller's cancellation (which must go on up) from the spare's (aclose), which is not an answer.
                await asyncio.wait({opening})
            except asyncio.CancelledError:
                self._keep_spare(opening)
                raise
            if not opening.cancelled() and opening.exception() is None:
                conn = opening.result()
                if not conn.closed:
                    return conn, True
        return await self._connect(timeout), False

    def _keep_spare(self, task: asyncio.Task[_Connection]) -> None:
        """The request that took the spare being opened was cancelled while it waited: keep the spare for the next
        request (once it is open), or close it."""
        if self._opening is None and not self._closed:
            self._opening = task
            if task.done():
                self._spare_opened(task)
        else:
            task.cancel()
            task.add_done_callback(_close_opened)

    def _open_spare(self) -> None:
        if not self._spare or self._closed or self._opening is not None or self._idle is not None:
            return
        task = asyncio.get_running_loop().create_task(self._connect(None))
        task.add_done_callback(self._spare_opened)
        self._opening = task

    def _spare_opened(self, task: asyncio.Task[_Connection]) -> None:
        if task.cancelled() or task.exception() is not None:
            if self._opening is task:
                self._opening = None
            return
        if self._opening is not task:
            return  # a request took it while it was being opened
        self._opening = None
        conn = task.result()
        if self._idle is None and not self._closed:
            self._keep_idle(conn)
        else:
            conn.close()

    async def _connect(self, timeout: float | None) -> _Connection:
        limit = self._connect_timeout if timeout is None else min(timeout, self._connect_timeout)
        loop = asyncio.get_running_loop()
        where = f"{self.origin.host}:{self.origin.port}"
        try:
            async with asyncio.timeout(limit):
                _, protocol = await loop.create_connection(_Connection, self.origin.host, self.origin.port,
                                                           ssl=self._ssl)
        except TimeoutError as exc:
            raise TimedOut(f"connecting to {where} took longer than {limit:g} s", "ConnectTimeout") from exc
        except OSError as exc:
            raise ConnectFailed(f"{where}: {exc.strerror or exc}", "ConnectError") from exc
        return protocol

    def _encode(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str] | None) -> bytes:
        lines = [f"{method} {self.origin.prefix}{path} HTTP/1.1", f"Host: {self.origin.host_header}",
                 "Accept: */*", *(f"{k}: {v}" for k, v in {**self._headers, **(headers or {})}.items())]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head + body if body else head


def _close_opened(task: asyncio.Task[_Connection]) -> None:
    """Close the connection of a spare nobody takes any more, should it have opened before it could be cancelled."""
    if not task.cancelled() and task.exception() is None:
        task.result().close()
