"""The guard in front of every route: Host check (DNS rebinding), API and admin keys, and the request-body cap.

A pure ASGI middleware, so a refused request never reaches a route; refusals are rendered in the client's dialect.
It also says who the caller is (`caller`): the cache domain of the key presented and of the user a trusted front end
forwarded, and whether it is the admin (domains.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slotkeeper.domains import Caller, checked_user, key_domain, salted
from slotkeeper.errors import Forbidden, PayloadTooLarge, SlotkeeperError, Unauthorized
from slotkeeper.loopback import LOOPBACK_NAMES, is_loopback
from slotkeeper.web.errors import error_response

# Routes that stay open: a load balancer's health check, and Ollama's "is it running" probe.
_PUBLIC_PATHS = frozenset({"/health", "/", "/api/version"})
BUNDLE_IMPORT_PATH = "/api/sessions/import"


# Where a request's Caller is kept in the ASGI scope (read with `caller`).
_CALLER = "slotkeeper.caller"


def is_admin_path(path: str) -> bool:
    return path.startswith(("/api/sessions", "/api/requests", "/api/backend", "/metrics"))


def is_operator_path(path: str) -> bool:
    """The operator's views, which hold every domain's sessions at once: the admin key's alone when domains are
    kept apart (the session API and the request journal are scoped to the caller instead)."""
    return path.startswith(("/api/backend", "/metrics", "/api/sessions/current", "/api/sessions/disk",
                            "/api/sessions/clear", "/api/sessions/prewarm"))


@dataclass(frozen=True, slots=True)
class Keys:
    """The keys the guard accepts: the API key (the domain ""), named keys (a domain each), the admin key, and the
    header a front end behind a key forwards its user in."""

    api_key: str | None = None
    admin_key: str | None = None
    named: Sequence[tuple[str, str]] = ()
    user_header: str | None = None

    @property
    def domains(self) -> bool:
        return bool(self.named) or self.user_header is not None


def domain_of(scope: Scope, body: Mapping[str, object]) -> str:
    """The cache domain of a model request: its caller's, narrowed by the body's `cache_salt` (checked: a bad one is
    a 400, raised before the request reaches the planner)."""
    return salted(caller(scope).domain, body)


def caller(scope: Scope) -> Caller:
    """Who sent the request, as the guard found (the one domain, not admin, for a request it did not see)."""
    found = scope.get(_CALLER)
    return found if isinstance(found, Caller) else Caller()


def host_name(header: str) -> str:
    """The name part of a Host header: `[::1]:11434` -> `::1`, `example:80` -> `example`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    def __init__(self, app: ASGIApp, *, bind_host: str, allowed_hosts: Iterable[str] = (), keys: Keys = Keys(),
                 max_body_bytes: int = 0) -> None:
        self.app = app
        self.keys = keys
        self.api_key = keys.api_key or None
        self.admin_key = keys.admin_key or None
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
        found = self._refusal(path, headers)
        if isinstance(found, SlotkeeperError):
            await error_response(path, found)(scope, receive, send)
            return
        scope[_CALLER] = found
        # A snapshot bundle is as big as a slot file (gigabytes); it is streamed to disk, never held in memory.
        if self.max_body_bytes and path != BUNDLE_IMPORT_PATH:
            declared = headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                await error_response(path, self._too_large())(scope, receive, send)
                return
            receive = self._capped(receive)
        await self.app(scope, receive, send)

    def _refusal(self, path: str, headers: Headers) -> SlotkeeperError | Caller:
        """The refusal of the request, or who its caller is."""
        host = headers.get("host")
        if self.allowed_hosts is not None and host and host_name(host) not in self.allowed_hosts:
            return Forbidden(_host_refused(host_name(host)))
        if path in _PUBLIC_PATHS or path.startswith("/dashboard"):
            return Caller()  # the dashboard's page holds no data; the API calls it makes carry the key
        if self.keys.domains:
            return self._domain_caller(path, headers)
        required = (self.admin_key or self.api_key) if is_admin_path(path) else self.api_key
        if required is None:
            return Caller(admin=True)  # nothing is kept apart: whoever reaches the port manages it all
        offered = _offered_key(headers)
        accepted = [k for k in (required, self.admin_key) if k]
        if offered is None or not any(_same(offered, k) for k in accepted):
            which = "admin key" if is_admin_path(path) and self.admin_key else "API key"
            return Unauthorized(f"missing or wrong {which} (send it as 'Authorization: Bearer KEY' or 'x-api-key')")
        return Caller(admin=self.admin_key is None or _same(offered, self.admin_key))

    def _domain_caller(self, path: str, headers: Headers) -> SlotkeeperError | Caller:
        """With domains kept apart every route but the public ones needs a key: the admin key anywhere, a user's
        (the API key or a named one) on the model routes and the session API, which shows it its own domain."""
        offered = _offered_key(headers)
        if offered is not None and self.admin_key is not None and _same(offered, self.admin_key):
            return Caller(admin=True)
        if is_operator_path(path):
            return Unauthorized("missing or wrong admin key: with cache domains kept apart, this view of every "
                                "domain is the admin key's (send it as 'Authorization: Bearer KEY' or 'x-api-key')")
        name = self._key_name(offered)
        if name is None:
            return Unauthorized("missing or wrong API key (send it as 'Authorization: Bearer KEY' or 'x-api-key')")
        user = headers.get(self.keys.user_header) if self.keys.user_header is not None else None
        try:
            return Caller(key_domain(name, checked_user(user, self.keys.user_header or "") if user else None))
        except SlotkeeperError as exc:
            return exc

    def _key_name(self, offered: str | None) -> str | None:
        """The name of the key offered: "" for the API key, a named key's name, None for none of them."""
        if offered is None:
            return None
        found = None
        for name, key in self.keys.named:
            if _same(offered, key):
                found = name
        if found is None and self.api_key is not None and _same(offered, self.api_key):
            found = ""
        return found

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


def _same(offered: str, key: str) -> bool:
    """A constant-time comparison of a key offered with one of ours (as bytes: a header may hold any character)."""
    return hmac.compare_digest(offered.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))


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
