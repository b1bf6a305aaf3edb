"""The Anthropic dialect: /v1/messages translated to and from the backend's /v1/chat/completions.

Pure functions: they read parsed values and return new ones; they never do I/O.
"""

from __future__ import annotations

from typing import Any

from slotkeeper.errors import SlotkeeperError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_body(error: SlotkeeperError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status_code, "api_error"),
                                       "message": error.message}}
