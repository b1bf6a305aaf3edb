"""HTTP client for one llama.cpp server: generation requests, props, and slot save/restore/erase.

The only place where transport errors (refused, reset, timed out) are turned into slotkeeper errors.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from slotkeeper import __version__
from slotkeeper.errors import UpstreamError, UpstreamUnavailable
from slotkeeper.upstream.health import Probe
from slotkeeper.upstream.wire import ConnectFailed, TimedOut, TransportError, WireClient, WireResponse


@dataclass(frozen=True, slots=True)
class SlotActionResult:
    """A save/restore/erase answer: token count and bytes moved, and the server's own timing."""

    n_tokens: int
    n_bytes: int
    server_ms: float


class UpstreamClient:
    """The client of one server, or of one `model` of a llama-server in router mode: then every request names it (in
    the query of a GET, in the JSON body of a POST, where the router reads it). None is sent while `admitted` is
    False: the model is unloaded (a request naming it would load it), or its server stopped on purpose."""

    def __init__(self, base_url: str, *, read_timeout: float = 600.0, slot_op_timeout: float = 120.0,
                 model: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.admitted = True
        self._slot_op_timeout = slot_op_timeout
        self._wire = WireClient(self.base_url, connect_timeout=5.0, read_timeout=read_timeout, write_timeout=60.0,
                                headers={"User-Agent": f"slotkeeper/{__version__}"})

    async def aclose(self) -> None:
        await self._wire.aclose()

    async def get_json(self, path: str, *, timeout: float | None = 10.0) -> Any:
        status, content = await self._request("GET", path, None, timeout)
        return _json_or_raise(status, content)

    async def post_json(self, path: str, body: Mapping[str, Any], *, timeout: float | None = None) -> Any:
        status, content = await self._request("POST", path, body, timeout)
        return _json_or_raise(status, content)

    async def healthy(self) -> bool:
        return await self.probe() is Probe.OK

    async def probe(self, timeout: float = 2.0) -> Probe:
        """GET /health once, and say how it went (see BackendHealth for what counts as down)."""
        try:
            status, _ = await self._request("GET", "/health", None, timeout)
        except UpstreamUnavailable as exc:
            return Probe.REFUSED if isinstance(exc.__cause__, ConnectFailed) else Probe.NO_ANSWER
        return Probe.OK if status == 200 else Probe.NOT_READY

    async def slot_action(self, slot_id: int, action: str, filename: str | None = None) -> SlotActionResult:
        """POST /slots/{id}?action=save|restore|erase. Raises UpstreamError on a non-2xx answer."""
        body: dict[str, Any] = {} if filename is None else {"filename": filename}
        data = await self.post_json(f"/slots/{slot_id}?action={action}", body, timeout=self._slot_op_timeout)
        timings = data.get("timings") or {}
        if action == "save":
            return SlotActionResult(int(data["n_saved"]), int(data["n_written"]), float(timings.get("save_ms", 0.0)))
        if action == "restore":
            return SlotActionResult(int(data["n_restored"]), int(data["n_read"]), float(timings.get("restore_ms", 0.0)))
        return SlotActionResult(int(data.get("n_erased", 0)), 0, 0.0)

    @asynccontextmanager
    async def stream(self, path: str, body: Mapping[str, Any]) -> AsyncIterator[WireResponse]:
        """Open a streaming POST. A non-2xx answer is read whole and raised as UpstreamError before any byte flows.
        Reading the body raises TransportError when the connection breaks (see iter_errors_as_unavailable)."""
        path, scoped = self._scoped("POST", path, body)
        try:
            response = await self._wire.request("POST", path, body=_encode(scoped or {}), headers=_JSON)
        except TransportError as exc:
            raise UpstreamUnavailable(_describe(exc, self.base_url)) from exc
        try:
            if response.status_code >= 400:
                try:
                    content = await response.aread()
                except TransportError as exc:
                    raise UpstreamUnavailable(_describe(exc, self.base_url)) from exc
                raise UpstreamError(response.status_code, content)
            yield response
        finally:
            await response.aclose()

    async def _request(self, method: str, path: str, body: Mapping[str, Any] | None,
                       timeout: float | None) -> tuple[int, bytes]:
        """One request read whole; `timeout` None is the client's read timeout."""
        path, body = self._scoped(method, path, body)
        try:
            response = await self._wire.request(method, path, body=None if body is None else _encode(body),
                                                headers=_JSON if body is not None else None, timeout=timeout)
            try:
                content = await response.aread()
            finally:
                await response.aclose()
        except TransportError as exc:
            raise UpstreamUnavailable(_describe(exc, self.base_url)) from exc
        return response.status_code, content


    def _scoped(self, method: str, path: str,
                body: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any] | None]:
        """The request as sent: naming this client's model of a router (not its own /health, which loads none)."""
        if path == "/health":
            return path, body
        if not self.admitted:
            what = f"the model {self.model!r}" if self.model else "this backend's model"
            raise UpstreamUnavailable(f"{what} is not loaded at {self.base_url}: nothing is sent to it until a turn "
                                      "loads it")
        if self.model is None:
            return path, body
        if body is not None:
            return path, {**body, "model": self.model}
        if method == "GET":
            path += ("&" if "?" in path else "?") + "model=" + urllib.parse.quote(self.model, safe="")
        return path, body


_JSON = {"Content-Type": "application/json"}


def _encode(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body).encode("utf-8")


def iter_errors_as_unavailable(exc: TransportError, base_url: str) -> UpstreamUnavailable:
    """Map a transport error met while reading a stream (the backend died mid-response)."""
    return UpstreamUnavailable(_describe(exc, base_url))


def _json_or_raise(status: int, content: bytes) -> Any:
    if status >= 400:
        raise UpstreamError(status, content)
    try:
        return json.loads(content)
    except ValueError as exc:
        raise UpstreamError(502, content) from exc


def _describe(exc: TransportError, base_url: str) -> str:
    if isinstance(exc, TimedOut) and exc.kind != "ConnectTimeout":
        return f"the backend at {base_url} did not answer in time ({exc.kind})"
    if isinstance(exc, ConnectFailed | TimedOut):
        return f"cannot reach the backend at {base_url} ({exc.kind}: {exc.detail})"
    return f"the backend at {base_url} broke the connection ({exc.kind}: {exc.detail})"
