"""The pre-warm request (`POST /api/sessions/prewarm`): a system prompt and tools, in one of the client dialects.

Its system part must hash exactly as the real requests of that dialect will, so it is translated by the same code
that translates them, into the backend's chat body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from slotkeeper.dialects import anthropic, ollama, openai
from slotkeeper.errors import BadRequest

Api = Literal["openai", "anthropic", "ollama"]
# Stands in for the conversation when the body names none: only the part before it is warmed up.
_PLACEHOLDER_USER = {"role": "user", "content": "."}


class PrewarmRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    system: str | list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    # How to read system, messages and tools; by default Anthropic's when the tools are Anthropic's (input_schema).
    api: Api | None = None
    model: str | None = None
    stream: bool = False
    # Never evicted by the disk budget.
    pin: bool = False
    # The cache domain to keep it in (domains.py): a prompt shared on purpose is pre-warmed into each.
    domain: str = ""


def parse_prewarm_request(body: Mapping[str, Any]) -> PrewarmRequest:
    try:
        return PrewarmRequest.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise BadRequest(f"invalid pre-warm request: {problems}") from None


def api_of(request: PrewarmRequest) -> Api:
    if request.api is not None:
        return request.api
    if any(isinstance(t, Mapping) and "input_schema" in t for t in request.tools or []):
        return "anthropic"
    return "openai"


def upstream_chat_body(request: PrewarmRequest, model: str) -> dict[str, Any]:
    """The backend chat body that a request of the pre-warm's dialect, with its system part, would produce."""
    api = api_of(request)
    messages = list(request.messages or [])
    if api == "anthropic":
        raw: dict[str, Any] = {"model": model, "max_tokens": 1, "messages": messages or [_PLACEHOLDER_USER]}
        if request.system is not None:
            raw["system"] = request.system
        if request.tools:
            raw["tools"] = request.tools
        return anthropic.chat_body(anthropic.parse_messages_request(raw), raw)
    if isinstance(request.system, list):
        raise BadRequest(f"a system prompt given as blocks needs \"api\": \"anthropic\" (this one is read as {api})")
    if request.system is not None:
        messages = [{"role": "system", "content": request.system}, *messages]
    messages = messages or [_PLACEHOLDER_USER]
    if api == "ollama":
        chat = ollama.parse(ollama.ChatRequest, {"model": model, "messages": messages, "tools": request.tools})
        return ollama.chat_body(chat, ollama.sampling(chat))
    body: dict[str, Any] = {"model": model, "messages": messages}
    if request.tools:
        body["tools"] = request.tools
    openai.check_chat_request(body)
    return openai.without_own_fields(body)
