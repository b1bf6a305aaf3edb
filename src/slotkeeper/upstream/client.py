"""HTTP client for one llama.cpp server: generation requests, props, and slot save/restore/erase.

The only place where transport errors (refused, reset, timed out) are turned into slotkeeper errors.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from slotkeeper import __version__
from slotkeeper.errors import UpstreamError, UpstreamUnavailable


@dataclass(frozen=True, slots=True)
class SlotActionResult:
    """A save/restore/erase answer: token count and bytes moved, and the server's own timing."""

    n_tokens: int
    n_bytes: int
    server_ms: float


class UpstreamClient:
    def __init__(self, base_url: str, *, read_timeout: float = 600.0, slot_op_timeout: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._slot_op_timeout = slot_op_timeout
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(connect=5.0, read=read_timeout, write=60.0, pool=None),
            # llama-server drops idle keep-alive connections after 5 s; expiring ours sooner avoids sending a request
            # on a connection the server is closing at that moment.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32, keepalive_expiry=2.0),
            headers={"user-agent": f"slotkeeper/{__version__}"},
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def get_json(self, path: str, *, timeout: float | None = 10.0) -> Any:
        response = await self._request("GET", path, timeout=timeout)
        return _json_or_raise(response)

    async def post_json(self, path: str, body: Mapping[str, Any], *, timeout: float | None = None) -> Any:
        response = await self._request("POST", path, json=dict(body), timeout=timeout)
        return _json_or_raise(response)

    async def healthy(self) -> bool:
        try:
            response = await self._http.get("/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

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
    async def stream(self, path: str, body: Mapping[str, Any]) -> AsyncIterator[httpx.Response]:
        """Open a streaming POST. A non-2xx answer is read whole and raised as UpstreamError before any byte flows."""
        request = self._http.build_request("POST", path, content=json.dumps(body).encode("utf-8"),
                                           headers={"content-type": "application/json"})
        try:
            response = await self._send_once_more_if_dropped(request)
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(_describe(exc, self.base_url)) from exc
        try:
            if response.status_code >= 400:
                try:
                    content = await response.aread()
                except httpx.HTTPError as exc:
                    raise UpstreamUnavailable(_describe(exc, self.base_url)) from exc
                raise UpstreamError(response.status_code, content)
            yield response
        finally:
            await response.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if kwargs.get("timeout", 0) is None:
            del kwargs["timeout"]  # httpx reads an explicit None as "no timeout at all"; keep the client's default
        request = self._http.build_request(method, path, **kwargs)
        try:
            response = await self._send_once_more_if_dropped(request)
            try:
                await response.aread()
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(_describe(exc, self.base_url)) from exc
        return response

    async def _send_once_more_if_dropped(self, request: httpx.Request) -> httpx.Response:
        """Send, and send again once if the server closed a reused connection before answering anything: the
        request was never read, so repeating it is safe."""
        try:
            return await self._http.send(request, stream=True)
        except httpx.RemoteProtocolError:
            return await self._http.send(request, stream=True)


def iter_errors_as_unavailable(exc: httpx.HTTPError, base_url: str) -> UpstreamUnavailable:
    """Map a transport error met while reading a stream (the backend died mid-response)."""
    return UpstreamUnavailable(_describe(exc, base_url))


def _json_or_raise(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        raise UpstreamError(response.status_code, response.content)
    try:
        return response.json()
    except ValueError as exc:
        raise UpstreamError(502, response.content) from exc


def _describe(exc: httpx.HTTPError, base_url: str) -> str:
    kind = type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return f"the backend at {base_url} did not answer in time ({kind})"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot reach the backend at {base_url} ({kind})"
    return f"the backend at {base_url} broke the connection ({kind}: {exc})"
