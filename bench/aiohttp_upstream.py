"""slotkeeper with aiohttp's client in place of its own (`upstream/wire.py`), for the `overhead` benchmark's third
target: `python -m bench.aiohttp_upstream serve ...` takes slotkeeper's own arguments.

`AiohttpWire` has the interface `upstream/client.py` uses of `WireClient` (request, then the response's status,
headers, body parts, close) and raises the same transport errors, so everything above the connection is the same
code. aiohttp parses responses with llhttp too (its C extension); what differs is the client around the parser:
its connection pool, its stream reader and its timeouts. Settings as close to `WireClient`'s as aiohttp has them:
keep-alive connections for 2 s, one connection per request in flight, no limit on their number, the same
timeouts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Mapping

import aiohttp

from slotkeeper.upstream import client as upstream_client
from slotkeeper.upstream.wire import ConnectFailed, Origin, TimedOut, TransportError


class AiohttpResponse:
    def __init__(self, response: aiohttp.ClientResponse, timeout: float | None) -> None:
        self._response = response
        self._timeout = timeout
        self.status_code = response.status
        self.headers: Mapping[str, str] = response.headers
        self.content = b""

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (whatever the reader holds when it wakes, like WireClient's parts)."""
        try:
            while True:
                part = await asyncio.wait_for(self._response.content.readany(), self._timeout)
                if not part:
                    return
                yield part
        except TimeoutError as exc:
            raise TimedOut("no body part in time", "ReadTimeout") from exc
        except aiohttp.ClientError as exc:
            raise TransportError(str(exc) or type(exc).__name__, "ReadError") from exc

    async def aread(self) -> bytes:
        self.content = b"".join([part async for part in self.aiter_raw()])
        return self.content

    async def aclose(self) -> None:
        self._response.release()


class AiohttpWire:
    """What UpstreamClient needs of WireClient, over one aiohttp.ClientSession (made on first use, inside the
    running loop)."""

    def __init__(self, base_url: str, *, connect_timeout: float = 5.0, read_timeout: float | None = 600.0,
                 write_timeout: float = 60.0, headers: Mapping[str, str] | None = None, **_: object) -> None:
        self.origin = Origin.parse(base_url)
        self._base = base_url.rstrip("/")
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                                  auto_decompress=False, skip_auto_headers=("Accept-Encoding",))
        return self._session

    async def request(self, method: str, path: str, *, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None, timeout: float | None = None) -> AiohttpResponse:
        read_timeout = self._read_timeout if timeout is None else timeout
        connect = self._connect_timeout if timeout is None else min(self._connect_timeout, timeout)
        limits = aiohttp.ClientTimeout(total=None, connect=connect, sock_read=read_timeout)
        try:
            response = await self._open().request(method, self._base + path, data=body, headers=headers,
                                                  timeout=limits)
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(str(exc), "ConnectError") from exc
        except TimeoutError as exc:
            raise TimedOut("no answer in time", "ReadTimeout") from exc
        except aiohttp.ClientError as exc:
            raise TransportError(str(exc) or type(exc).__name__, "RemoteProtocolError") from exc
        return AiohttpResponse(response, read_timeout)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def main() -> int:
    upstream_client.WireClient = AiohttpWire  # type: ignore[misc,assignment]
    from slotkeeper.cli import main as slotkeeper_main

    return slotkeeper_main()


if __name__ == "__main__":
    sys.exit(main())
