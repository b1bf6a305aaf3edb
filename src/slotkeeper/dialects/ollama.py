"""The Ollama dialect: /api/chat and /api/generate translated to and from the backend's OpenAI-style API.

Pure functions: they read parsed values and return new ones; they never do I/O.
"""

from __future__ import annotations

from typing import Any

from slotkeeper.errors import SlotkeeperError


def error_body(error: SlotkeeperError) -> dict[str, Any]:
    """Ollama's error shape: a plain string under "error"."""
    return {"error": error.message}
