"""POST /api/sessions/prewarm: evaluate a system prompt (and tools) once and keep it as a system snapshot, so the
first conversation on it starts warm. With "stream": true the answer is NDJSON progress lines, then the result."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slotkeeper.cache.systemprompt import system_prompt_of
from slotkeeper.dialects import openai
from slotkeeper.dialects.prewarm import parse_prewarm_request, upstream_chat_body
from slotkeeper.domains import checked_domain
from slotkeeper.errors import BadRequest, SlotkeeperError
from slotkeeper.serving.service import Prewarm
from slotkeeper.web.state import turn_state

router = APIRouter()
# Pre-warms whose client hung up: they run to the end (the backend cannot stop a prefill) and are kept referenced.
_detached: set[asyncio.Task[Prewarm]] = set()


@router.post("/api/sessions/prewarm")
async def prewarm(request: Request) -> Response:
    body = parse_prewarm_request(openai.parse_body(await request.body()))
    state = await turn_state(request, body.model)
    model = state.backend.model_id
    system = system_prompt_of(upstream_chat_body(body, model))
    if system is None:
        raise BadRequest("nothing to pre-warm: give a system prompt (\"system\" or system messages) or tools")
    domain = checked_domain(body.domain)
    if not body.stream:
        result = await state.turns.prewarm(model, system, pin=body.pin, domain=domain)
        return JSONResponse(_result_json(model, result))

    progress: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def report(processed: int, total: int) -> None:
        await progress.put({"status": "prefill", "processed": processed, "total": total})

    task = asyncio.create_task(state.turns.prewarm(model, system, report, pin=body.pin, domain=domain))

    async def lines() -> AsyncIterator[bytes]:
        yield _line({"status": "started", "system": system.digest, "model": model})
        try:
            while not task.done() or not progress.empty():
                getter = asyncio.ensure_future(progress.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield _line(getter.result())
                else:
                    getter.cancel()
            try:
                yield _line(_result_json(model, task.result()))
            except SlotkeeperError as exc:
                yield _line({"status": "failed", "error": exc.message})
        finally:
            if not task.done():
                _detached.add(task)
                task.add_done_callback(_forget)

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _result_json(model: str, result: Prewarm) -> dict[str, Any]:
    return {"model": model, "system": result.digest, "status": result.status, "tokens": result.n_tokens,
            "bytes": result.n_bytes, "pinned": result.pinned, "ms": round(result.ms, 1)}


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"



def _forget(task: asyncio.Task[Prewarm]) -> None:
    _detached.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved (the service logged it): asyncio would otherwise complain at exit
