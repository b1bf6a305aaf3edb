"""The guard in front of every route: Host check (DNS rebinding), API and admin keys, and the request-body cap.

A pure ASGI middleware, so a refused request never reaches a route; refusals are rendered in the client's dialect.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slotkeeper.errors import Forbidden, PayloadTooLarge, SlotkeeperError, Unauthorized
from slotkeeper.loopback import LOOPBACK_NAMES, is_loopback
from slotkeeper.web.errors import error_response

# Routes that stay open: a load balancer's health check, and Ollama's "is it running" probe.
_PUBLIC_PATHS = frozenset({"/health", "/", "/api/version"})
BUNDLE_IMPORT_PATH = "/api/sessions/import"


def is_admin_path(path: str) -> bool:
    return path.startswith(("/api/sessions", "/api/requests", "/api/backend", "/metrics"))


def host_name(header: str) -> str:
    """The name part of a Host header: `[::1]:11434` -> `::1`, `example:80` -> `example`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    def __init__(self, app: ASGIApp, *, bind_host: str, allowed_hosts: Iterable[str] = (), api_key: str | None = None,
                 admin_key: str | None = None, max_body_bytes: int = 0) -> None:
        self.app = app
        self.api_key = api_key or None
        self.admin_key = admin_key or None
        self.max_body_bytes = max_body_bytes
        allowed = {h.strip().lower() for h in allowed_hosts if h.strip()}
        # Bound to loopback, only loopback names are valid: a browser page on another origin that resolves its own
        # name to 127.0.0.1 (DNS rebinding) still sends its own name as Host.
        self.allowed_hosts: frozenset[str] | None = (
            frozenset(allowed | LOOPBACK_NAMES) if allowed or is_loopback(bind_host) else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = Headers(scope=scope)
        error = self._refusal(path, headers)
        if error is not None:
            await error_response(path, error)(scope, receive, send)
            return
        # A snapshot bundle is as big as a slot file (gigabytes); it is streamed to disk, never held in memory.
        if self.max_body_bytes and path != BUNDLE_IMPORT_PATH:
            declared = headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                await error_response(path, self._too_large())(scope, receive, send)
                return
            receive = self._capped(receive)
        await self.app(scope, receive, send)

    def _refusal(self, path: str, headers: Headers) -> SlotkeeperError | None:
        host = headers.get("host")
        if self.allowed_hosts is not None and host and host_name(host) not in self.allowed_hosts:
            return Forbidden(_host_refused(host_name(host)))
        if path in _PUBLIC_PATHS or path.startswith("/dashboard"):
            return None  # the dashboard's page holds no data; the API calls it makes carry the key
        required = (self.admin_key or self.api_key) if is_admin_path(path) else self.api_key
        if required is None:
            return None
        offered = _offered_key(headers)
        accepted = [k for k in (required, self.admin_key) if k]
        if offered is None or not any(hmac.compare_digest(offered, k) for k in accepted):
            which = "admin key" if is_admin_path(path) and self.admin_key else "API key"
            return Unauthorized(f"missing or wrong {which} (send it as 'Authorization: Bearer KEY' or 'x-api-key')")
        return None

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"the request body is larger than {self.max_body_bytes} bytes (--max-body-bytes)")

    def _capped(self, receive: Receive) -> Receive:
        seen = 0

        async def capped_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise self._too_large()
            return message

        return capped_receive


def _offered_key(headers: Headers) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key")


def _host_refused(name: str) -> str:
    """Why a Host was refused, and the one setting that lets it in (a name a container reaches the host by, too)."""
    hint = (" (OpenWebUI or another client in Docker reaching the host: see docs/ollama.md, \"OpenWebUI in Docker\")"
            if name in ("host.docker.internal", "host.containers.internal", "gateway.docker.internal") else "")
    return (f"host {name!r} is not allowed: slotkeeper listens on loopback and answers only loopback names there "
            f"(a guard against DNS rebinding); to let this name in, start it with --allowed-hosts {name} "
            f"(or SLOTKEEPER_ALLOWED_HOSTS={name}, or allowed_hosts = [\"{name}\"] in the config file){hint}")
