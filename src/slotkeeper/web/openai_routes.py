"""OpenAI-compatible routes: chat and text completions and responses under session control, embeddings passed
through, and the model listing (shaped to satisfy both the OpenAI and the Anthropic clients)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from slotkeeper.dialects import openai
from slotkeeper.errors import NotFound
from slotkeeper.serving.identity import is_side_task, resolve_session
from slotkeeper.types import BackendInfo
from slotkeeper.web.openapi import JSON, answers, json_body
from slotkeeper.web.replicas import turns_for
from slotkeeper.web.security import domain_of
from slotkeeper.web.state import backends, turn_state
from slotkeeper.web.streaming import TurnStreamResponse

router = APIRouter()

# Bodies go to the backend as they are (less our own fields), and the backend validates them: the schemas say only
# what slotkeeper itself checks, so that a request they call invalid is one slotkeeper itself refuses.
_PASSED_ON = "Passed to the backend as it is, minus slotkeeper's own fields; the backend checks everything else."
_CHAT = {"type": "object", "required": ["messages"],
         "properties": {"messages": {"type": "array", "minItems": 1}, "stream": {}}}
_COMPLETION = {"type": "object", "required": ["prompt"], "properties": {"prompt": {}, "stream": {}}}
_RESPONSES = {"type": "object", "required": ["input"], "properties": {"input": {"anyOf": [
    {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1}]}, "stream": {}}}
_EMBEDDINGS = {"type": "object", "required": ["input"], "properties": {"input": {}}}
_STREAMED = answers(JSON, "text/event-stream")


@router.post("/v1/chat/completions", openapi_extra=json_body(_CHAT, _PASSED_ON), responses=_STREAMED)
async def chat_completions(request: Request) -> Response:
    return await _proxy(request, "/v1/chat/completions", "openai.chat", openai.check_chat_request)


@router.post("/v1/completions", openapi_extra=json_body(_COMPLETION, _PASSED_ON), responses=_STREAMED)
async def completions(request: Request) -> Response:
    return await _proxy(request, "/v1/completions", "openai.completions", openai.check_completion_request)


@router.post("/v1/responses", openapi_extra=json_body(_RESPONSES, _PASSED_ON), responses=_STREAMED)
async def responses(request: Request) -> Response:
    """Codex and other Responses clients resend the whole history every turn; the chain and the system part
    (`instructions` and the tools) are computed from the chat body it stands for, so sessions, restores, prefix reuse
    and system snapshots work as they do for chat completions."""
    return await _proxy(request, "/v1/responses", "openai.responses", openai.check_responses_request,
                        openai.responses_system_texts, openai.responses_chat_view)


@router.post("/v1/embeddings", openapi_extra=json_body(_EMBEDDINGS, _PASSED_ON))
async def embeddings(request: Request) -> Response:
    """Passed through without a slot lease: embeddings do not touch a conversation's KV state. A backend started
    without --embeddings answers 501 itself, and that answer is passed on."""
    body = openai.parse_body(await request.body())
    openai.check_embeddings_request(body)
    state = await turn_state(request, _model_of(body))
    return JSONResponse(await state.client.post_json("/v1/embeddings", openai.without_own_fields(body)))


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    entries = [_model_entry(info, started) for info, started in backends(request).listed()]
    return {"object": "list", "data": entries, "has_more": False, "first_id": entries[0]["id"] if entries else None,
            "last_id": entries[-1]["id"] if entries else None}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    for info, started in backends(request).listed():
        if model_id.removesuffix(":latest") == info.model_id:
            return _model_entry(info, started)
    raise NotFound(f"model '{model_id}' not found")


def _chat_system_texts(body: Mapping[str, Any]) -> list[str]:
    return openai.system_texts(body.get("messages"))


async def _proxy(request: Request, path: str, api: str, check: Callable[[Mapping[str, Any]], None],
                 system: Callable[[Mapping[str, Any]], list[str]] = _chat_system_texts,
                 as_chat: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None) -> Response:
    """`as_chat` turns a body that is not a chat body into the one it stands for, for the turn's chain, system part
    and side-task check; the body itself goes to the backend as it is."""
    body = openai.parse_body(await request.body())
    check(body)
    domain = domain_of(request.scope, body)  # a bad cache_salt is refused before a model is even loaded for it
    state = await turn_state(request, _model_of(body))
    chat = as_chat(body) if as_chat is not None else None
    messages = (chat if chat is not None else body).get("messages")
    key = resolve_session(state.backend.model_id, request.headers, body, system(body), state.settings.session_headers,
                          opening=openai.opening(messages), reply=openai.first_reply(messages),
                          domain=domain)

    stream = bool(body.get("stream"))
    side = is_side_task(request.headers, messages, stream)

    def build(slot_id: int) -> dict[str, Any]:
        return openai.upstream_body(body, slot_id)

    turns = await turns_for(request, state, key, side)
    if isinstance(turns, Response):
        return turns
    if stream:
        turn = await turns.open_stream(api, key, path, build, side=side, hung_up=request.is_disconnected, chat=chat)
        return TurnStreamResponse.passthrough(turn, openai.error_event)
    data, record = await turns.unary(api, key, path, build, side=side, hung_up=request.is_disconnected, chat=chat)
    return JSONResponse(data, headers=record.headers())


def _model_of(body: Mapping[str, Any]) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) else None


def _model_entry(backend: BackendInfo, started: float) -> dict[str, Any]:
    """One entry both clients parse: OpenAI's (object, created, owned_by) and Anthropic's (type, display_name,
    created_at in RFC 3339)."""
    return {
        "id": backend.model_id,
        "object": "model",
        "created": int(started),
        "owned_by": "slotkeeper",
        "type": "model",
        "display_name": backend.model_id,
        "created_at": datetime.fromtimestamp(int(started), UTC).isoformat().replace("+00:00", "Z"),
        "meta": {"n_ctx": backend.n_ctx_slot, "n_slots": backend.n_slots},
    }
