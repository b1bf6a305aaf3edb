"""llama-server's own routes, for the tools that speak them (llama.vim and llama.vscode autocomplete, Maki's
llama.cpp provider): /infill and /completion under session and slot control, /tokenize, /detokenize,
/apply-template, /embedding(s) and /rerank passed through without a slot, and read-only views of /props and /slots.

The slot actions (`POST /slots/{id}?action=...`) and `POST /props` stay unreachable: no route serves them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from slotkeeper.cache.chain import infill_chain
from slotkeeper.dialects import llama, openai
from slotkeeper.domains import sees
from slotkeeper.errors import Overloaded, SlotkeeperError
from slotkeeper.serving.identity import is_side_task, resolve_session
from slotkeeper.types import IdSource
from slotkeeper.web.openapi import JSON, answers, json_body
from slotkeeper.web.replicas import turns_for
from slotkeeper.web.security import caller, domain_of
from slotkeeper.web.state import app_state, turn_state
from slotkeeper.web.streaming import TurnStreamResponse

router = APIRouter()

# The session of /infill requests that name none: autocomplete sends the same file again and again, so its state
# is kept hot, and saved and restored like a conversation's (the default session never is).
INFILL_SESSION = "infill"

_PASSED_ON = "Passed to the backend as it is, minus slotkeeper's own fields; the backend checks everything else."
_STRING = {"type": "string"}
_INFILL = {"type": "object", "required": ["input_prefix", "input_suffix"], "properties": {
    "input_prefix": _STRING, "input_suffix": _STRING, "prompt": _STRING,
    "input_extra": {"type": "array", "items": {"type": "object", "required": ["text"],
                                               "properties": {"text": _STRING, "filename": _STRING}}},
    "stream": {}}}
_COMPLETION = {"type": "object", "required": ["prompt"], "properties": {"prompt": {}, "stream": {}}}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_STREAMED = answers(JSON, "text/event-stream")


@router.post("/infill", openapi_extra=json_body(_INFILL, _PASSED_ON), responses=_STREAMED)
async def infill(request: Request) -> Response:
    return await _turn(request, "/infill", "llama.infill", llama.check_infill_request, infill=True)


@router.post("/completion", openapi_extra=json_body(_COMPLETION, _PASSED_ON), responses=_STREAMED)
async def completion(request: Request) -> Response:
    return await _turn(request, "/completion", "llama.completion", llama.check_completion_request)


@router.post("/completions", openapi_extra=json_body(_COMPLETION, _PASSED_ON), responses=_STREAMED)
async def completions(request: Request) -> Response:
    return await _turn(request, "/completions", "llama.completion", llama.check_completion_request)


def _passed_through(path: str) -> Callable[[Request], Any]:
    async def route(request: Request) -> Response:
        """Passed through without a slot lease: it does not touch a conversation's KV state. The backend's own
        answer, an error included (a backend without --embeddings or --reranking answers 501), is passed on."""
        body = openai.parse_body(await request.body())
        state = await turn_state(request, _model_of(body))
        forwarded = {k: v for k, v in openai.without_own_fields(body).items() if k not in ("id_slot", "cache_prompt")}
        return JSONResponse(await state.client.post_json(path, forwarded))

    route.__name__ = "llama_" + path.strip("/").replace("/", "_").replace("-", "_")
    return route


for _path in ("/tokenize", "/detokenize", "/apply-template", "/embedding", "/embeddings", "/rerank", "/v1/rerank"):
    router.add_api_route(_path, _passed_through(_path), methods=["POST"],
                         openapi_extra=json_body(_ANY_OBJECT, _PASSED_ON))


@router.get("/props")
async def props(request: Request) -> JSONResponse:
    """The backend's /props as a read-only view (dialects/llama.py: props_view). `?model=NAME` picks the backend;
    `?autoload=false` (Maki's probe of a router) changes nothing here: the model is loaded."""
    state = app_state(request, request.query_params.get("model"))
    try:
        current = await state.client.get_json("/props")
    except SlotkeeperError:
        current = state.backend.props  # what it said at start, while it cannot say more
    if not isinstance(current, Mapping):
        current = state.backend.props
    return JSONResponse(llama.props_view(current, state.backend.n_ctx_slot))


@router.get("/slots")
async def slots(request: Request) -> JSONResponse:
    """slotkeeper's own view of the slots (never the backend's /slots, which holds their prompts). With
    `?fail_on_no_slot=1`, a 503 when every slot is busy, as llama-server answers."""
    state = app_state(request, request.query_params.get("model"))
    pool = state.pool.slots
    if request.query_params.get("fail_on_no_slot") and all(s.busy for s in pool):
        raise Overloaded("no slot available")
    # How much a slot holds is shown only to whoever may see its cache domain (docs/domains.md).
    who = caller(request.scope)
    return JSONResponse(llama.slots_view(
        ((s.slot_id, s.busy, s.n_tokens if s.domain is not None and sees(who, s.domain) else 0) for s in pool),
        state.backend.n_ctx_slot))


async def _turn(request: Request, path: str, api: str, check: Callable[[Mapping[str, Any]], None],
                infill: bool = False) -> Response:
    body = openai.parse_body(await request.body())
    check(body)
    domain = domain_of(request.scope, body)  # a bad cache_salt is refused before a model is even loaded for it
    state = await turn_state(request, _model_of(body))
    model = state.backend.model_id
    key = resolve_session(model, request.headers, body, [], state.settings.session_headers, domain=domain)
    if infill and key.is_default:
        key = key.within(INFILL_SESSION, IdSource.ROUTE)
    stream = bool(body.get("stream"))
    side = is_side_task(request.headers, None, stream)
    # response_fields is applied here, not by the backend, so the turn's timings are seen (the cache's record of it)
    fields = llama.response_fields(body)
    chain = infill_chain(body) if infill else None

    def build(slot_id: int) -> dict[str, Any]:
        forwarded = openai.upstream_body(body, slot_id)
        forwarded.pop("response_fields", None)
        return forwarded

    turns = await turns_for(request, state, key, side)
    if isinstance(turns, Response):
        return turns
    if stream:
        turn = await turns.open_stream(api, key, path, build, side=side, hung_up=request.is_disconnected,
                                       chain=chain)
        chunks = turn.chunks(llama.error_event)
        return TurnStreamResponse(turn, chunks if fields is None else _filtered(chunks, fields))
    data, record = await turns.unary(api, key, path, build, side=side, hung_up=request.is_disconnected,
                                     chain=chain)
    return JSONResponse(llama.select_fields(data, fields), headers=record.headers())


async def _filtered(chunks: AsyncIterator[bytes], fields: Sequence[str]) -> AsyncIterator[bytes]:
    final = llama.FinalEventFilter(fields)
    async for chunk in chunks:
        out = final.feed(chunk)
        if out:
            yield out
    rest = final.finish()
    if rest:
        yield rest


def _model_of(body: Mapping[str, Any]) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) else None
