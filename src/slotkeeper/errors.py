"""slotkeeper's one error tree; each error knows its HTTP status and how it renders to a client.

    SlotkeeperError                 500  server_error
    ├── BadRequest                  400  invalid_request_error
    ├── Unauthorized                401  authentication_error   missing or wrong API/admin key
    ├── Forbidden                   403  permission_error       a Host header that is not allowed
    ├── NotFound                    404  not_found_error
    ├── MethodNotAllowed            405  invalid_request_error  a route that exists, asked with another method
    ├── PayloadTooLarge             413  request_too_large
    ├── NotSupported                501  not_supported_error    a route slotkeeper answers but cannot serve
    ├── UpstreamError               (the backend's status)   a non-2xx answer from the backend, body kept
    ├── UpstreamUnavailable         502  the backend could not be reached or broke the connection
    ├── Overloaded                  503  the queue for slots is full
    ├── SaveFailed                  500  an operator's clear could not save a slot's changed state (kept unerased)
    └── SnapshotError               (never reaches a client) a snapshot file could not be used or written

Cache problems (SnapshotError) are caught where they happen and turned into a cold prefill; they never fail a request.
"""

from __future__ import annotations

import json
from typing import Any


class SlotkeeperError(Exception):
    status_code: int = 500
    error_type: str = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "code": self.status_code}}


class BadRequest(SlotkeeperError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(SlotkeeperError):
    status_code = 401
    error_type = "authentication_error"


class Forbidden(SlotkeeperError):
    status_code = 403
    error_type = "permission_error"


class NotFound(SlotkeeperError):
    status_code = 404
    error_type = "not_found_error"


class MethodNotAllowed(SlotkeeperError):
    status_code = 405
    error_type = "invalid_request_error"


class PayloadTooLarge(SlotkeeperError):
    status_code = 413
    error_type = "request_too_large"


class NotSupported(SlotkeeperError):
    status_code = 501
    error_type = "not_supported_error"


class UpstreamUnavailable(SlotkeeperError):
    status_code = 502
    error_type = "upstream_unavailable"


class UpstreamError(SlotkeeperError):
    """The backend answered with an error status; its body is passed through unchanged when it is JSON."""

    def __init__(self, status_code: int, body: bytes) -> None:
        self.status_code = status_code
        self.body = body
        self.error_type = "upstream_error"
        super().__init__(_message_from_body(body) or f"backend answered HTTP {status_code}")

    def openai_body(self) -> dict[str, Any]:
        try:
            parsed = json.loads(self.body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and "error" in parsed:
            return parsed
        return super().openai_body()


class Overloaded(SlotkeeperError):
    """Too many requests are already waiting for a slot."""

    status_code = 503
    error_type = "overloaded_error"


class SaveFailed(SlotkeeperError):
    """A slot's changed state could not be saved, so an operator's clear left the slot as it was."""


class SnapshotError(SlotkeeperError):
    """A snapshot could not be saved, checked or restored. Handled inside the cache layer."""


class OlderVersion(SnapshotError):
    """A copy of a saved state brought in (from the shared tier, another backend, a bundle) is not newer than the
    one already here: it is refused, never applied (version.py)."""


def _message_from_body(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return text[:500] or None
    if isinstance(parsed, dict):
        err = parsed.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return None
