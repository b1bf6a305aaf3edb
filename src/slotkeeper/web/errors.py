"""Which client dialect a path speaks, and an error rendered in that dialect's own shape."""

from __future__ import annotations

import enum
from typing import Any

from fastapi.responses import JSONResponse

from slotkeeper.dialects import anthropic, llama, ollama
from slotkeeper.errors import SlotkeeperError


class Dialect(enum.Enum):
    OPENAI = "openai"
    OLLAMA = "ollama"
    ANTHROPIC = "anthropic"
    LLAMA = "llama"  # llama-server's own routes (/infill, /completion, /props, /slots...)
    OURS = "slotkeeper"


# llama-server's own routes that slotkeeper serves (web/llama_routes.py); /slots/{id} (the slot actions) too, refused.
LLAMA_PATHS = frozenset({
    "/infill", "/completion", "/completions", "/tokenize", "/detokenize", "/apply-template", "/embedding",
    "/embeddings", "/rerank", "/v1/rerank", "/props", "/slots",
})


def dialect_of(path: str) -> Dialect:
    if path in LLAMA_PATHS or path.startswith("/slots/"):
        return Dialect.LLAMA
    if path.startswith("/api/sessions"):
        return Dialect.OURS
    if path.startswith("/api/") or path in ("/", "/api"):
        return Dialect.OLLAMA
    if path.startswith("/v1/messages"):
        return Dialect.ANTHROPIC
    return Dialect.OPENAI


def error_body(dialect: Dialect, error: SlotkeeperError) -> dict[str, Any]:
    if dialect is Dialect.OLLAMA:
        return ollama.error_body(error)
    if dialect is Dialect.ANTHROPIC:
        return anthropic.error_body(error)
    if dialect is Dialect.LLAMA:
        return llama.error_body(error)
    return error.openai_body()


def error_response(path: str, error: SlotkeeperError) -> JSONResponse:
    return JSONResponse(error_body(dialect_of(path), error), status_code=error.status_code)
