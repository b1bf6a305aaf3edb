"""Anthropic-compatible routes: /v1/messages (under session and slot control) and /v1/messages/count_tokens.

HTTP wiring only: the translation lives in dialects/anthropic/; errors render in Anthropic's shape (web/errors.py).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from slotkeeper.dialects import anthropic, openai
from slotkeeper.errors import NotFound, SlotkeeperError, UpstreamError
from slotkeeper.serving.identity import is_side_task, resolve_session
from slotkeeper.serving.service import StreamTurn
from slotkeeper.web.openapi import JSON, answers, json_body
from slotkeeper.web.replicas import turns_for
from slotkeeper.web.security import domain_of
from slotkeeper.web.state import turn_state
from slotkeeper.web.streaming import TurnStreamResponse

router = APIRouter()


@router.post("/v1/messages", openapi_extra=json_body(anthropic.MessagesRequest),
             responses=answers(JSON, "text/event-stream"))
async def create_message(request: Request) -> Response:
    raw = openai.parse_body(await request.body())
    message = anthropic.parse_messages_request(raw)
    domain = domain_of(request.scope, raw)  # a bad cache_salt is refused before a model is even loaded for it
    state = await turn_state(request, message.model)
    if not state.settings.keep_attribution_block:
        message, _ = anthropic.without_attribution(message)  # before hashing and before forwarding
    chat = anthropic.chat_body(message, raw)
    key = resolve_session(
        state.backend.model_id, request.headers, raw, anthropic.system_texts(message),
        state.settings.session_headers, hint=anthropic.session_from_user_id(anthropic.metadata_user_id(message)),
        opening=openai.opening(chat.get("messages")), reply=openai.first_reply(chat.get("messages")),
        domain=domain,
    )
    side = (is_side_task(request.headers, raw.get("messages"), message.stream)
            or anthropic.is_side_request(request.headers, message))

    def build(slot_id: int) -> dict[str, Any]:
        return openai.upstream_body(chat, slot_id)

    turns = await turns_for(request, state, key, side)
    if isinstance(turns, Response):
        return turns
    message_id = "msg_" + secrets.token_hex(12)
    stop_sequences = message.stop_sequences or []
    if message.stream:
        turn = await turns.open_stream("anthropic.messages", key, "/v1/chat/completions", build, side=side,
                                       hung_up=request.is_disconnected)
        encoder = anthropic.MessageStreamEncoder(message_id, message.model, stop_sequences)
        return TurnStreamResponse(turn, _encode(turn, encoder), media_type="text/event-stream")
    data, record = await turns.unary("anthropic.messages", key, "/v1/chat/completions", build, side=side,
                                     hung_up=request.is_disconnected)
    body = anthropic.to_message(data, message_id=message_id, model=message.model, stop_sequences=stop_sequences)
    return JSONResponse(body, headers=record.headers())


@router.post("/v1/messages/count_tokens", openapi_extra=json_body(anthropic.CountTokensRequest))
async def count_tokens(request: Request) -> dict[str, int]:
    """Counted by the backend's own template and tokenizer; takes no slot, so it never waits for a turn."""
    counted = anthropic.parse_count_tokens_request(openai.parse_body(await request.body()))
    state = await turn_state(request, counted.model)
    body = anthropic.count_tokens_body(counted)
    try:
        data = await state.client.post_json("/v1/chat/completions/input_tokens", body)
        return {"input_tokens": int(data["input_tokens"])}
    except UpstreamError as exc:
        if exc.status_code != 404:
            raise
    # Older servers have no counting route: render the prompt, then tokenize it.
    rendered = await state.client.post_json("/apply-template", body)
    tokens = await state.client.post_json("/tokenize", {"content": rendered["prompt"], "add_special": True,
                                                        "parse_special": True})
    return {"input_tokens": len(tokens["tokens"])}


@router.api_route("/v1/messages/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def unknown_messages_route(rest: str) -> Response:
    """Batches and other Messages sub-resources are not served; say so in Anthropic's shape, not FastAPI's."""
    raise NotFound(f"/v1/messages/{rest} is not served by slotkeeper")


async def _encode(turn: StreamTurn, encoder: anthropic.MessageStreamEncoder) -> AsyncIterator[bytes]:
    try:
        async for event in turn.events():
            chunk = encoder.feed(event)
            if chunk:
                yield chunk
    except SlotkeeperError as exc:
        yield encoder.fail(exc)
        return
    yield encoder.finish()
