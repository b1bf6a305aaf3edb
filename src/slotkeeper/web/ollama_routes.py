"""Ollama-compatible routes (/, /api/version, /api/tags, /api/show, /api/ps, /api/chat, /api/generate, ...).

HTTP wiring only: requests are validated and translated by dialects/ollama/ and run through the TurnService.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from slotkeeper import __version__
from slotkeeper.dialects import ollama, openai
from slotkeeper.dialects.ollama import AnswerShape, ChatRequest, GenerateRequest, ModelRequest, Sampling
from slotkeeper.dialects.ollama.requests import Generation
from slotkeeper.errors import BadRequest, NotSupported, SlotkeeperError
from slotkeeper.serving.identity import is_side_task, resolve_session
from slotkeeper.serving.service import StreamTurn, TurnRecord, header_safe
from slotkeeper.types import BackendInfo, SessionKey
from slotkeeper.web.openapi import JSON as JSON_TYPE
from slotkeeper.web.openapi import answers, json_body
from slotkeeper.web.replicas import turns_for
from slotkeeper.web.security import domain_of
from slotkeeper.web.state import AppState, Backends, backends
from slotkeeper.web.streaming import TurnStreamResponse

log = logging.getLogger("slotkeeper.ollama")
router = APIRouter()

# The Ollama API level these routes follow. Clients compare it with feature minimums, so it is Ollama's numbering
# (dotted integers, as OpenWebUI parses it), not slotkeeper's own version (which goes alongside).
OLLAMA_API_VERSION = "0.32.0"
NDJSON = "application/x-ndjson"
JSON = "application/json; charset=utf-8"
_reported_options: set[str] = set()


@router.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse)
async def root() -> Response:
    return PlainTextResponse("Ollama is running")


@router.api_route("/api/version", methods=["GET", "HEAD"])
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION, "slotkeeper": __version__}


@router.api_route("/api/tags", methods=["GET", "HEAD"])
async def tags(request: Request) -> dict[str, Any]:
    listed = backends(request).listed()
    return {"models": [ollama.tags_entry(await _facts_of(info, started)) for info, started in listed]}


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    # llama-server keeps its model loaded for as long as it runs: "expires" a century from now.
    expires = _timestamp(datetime.now(UTC) + timedelta(days=36500))
    served = backends(request)
    if served.taking_turns is not None:  # the models loaded now, each with when its keep_alive runs out
        entries = []
        for state in served.models:
            if state.client.admitted:
                until = served.taking_turns.expires(state.backend.model_id)
                at = expires if until is None else _timestamp(datetime.fromtimestamp(until, UTC))
                entries.append(ollama.ps_entry(await _facts(state), at))
        return {"models": entries}
    return {"models": [ollama.ps_entry(await _facts(state), expires) for state in served.models]}


@router.post("/api/show", openapi_extra=json_body(ModelRequest))
async def show(request: Request) -> dict[str, Any]:
    req = ollama.parse(ModelRequest, await _body(request))
    if not req.model_name:
        raise BadRequest("'model' is required")
    for info, started in backends(request).listed():  # a router's model is described without loading it
        if ollama.is_served(req.model_name, info.model_id):
            return ollama.show_answer(await _facts_of(info, started))
    raise ollama.model_not_found(req.model_name)


@router.post("/api/chat", openapi_extra=json_body(ChatRequest), responses=answers(JSON_TYPE, NDJSON))
async def chat(request: Request) -> Response:
    started = time.perf_counter_ns()
    body = await _body(request)
    req = ollama.parse(ChatRequest, body)
    if not req.messages:
        return await _load_or_unload(request, "chat", req)
    domain = domain_of(request.scope, body)  # a bad cache_salt is refused before a model is even loaded for it
    state = await _served_by(request, req.model)
    _keep(request, state, req)
    ollama.check_images(ollama.all_images(req), _vision(state))
    opts = _sampling(req, state)
    upstream = ollama.chat_body(req, opts)
    key = _session(request, state, body, upstream["messages"], domain)
    side = is_side_task(request.headers, body.get("messages"), req.stream)
    shape = AnswerShape("chat", req.model)
    return await _run(request, state, "ollama.chat", key, "/v1/chat/completions", upstream, shape, req.stream, side,
                      opts, started)


@router.post("/api/generate", openapi_extra=json_body(GenerateRequest), responses=answers(JSON_TYPE, NDJSON))
async def generate(request: Request) -> Response:
    started = time.perf_counter_ns()
    body = await _body(request)
    req = ollama.parse(GenerateRequest, body)
    ollama.check_generate(req)
    if not req.prompt and not req.images:
        return await _load_or_unload(request, "generate", req)
    domain = domain_of(request.scope, body)  # a bad cache_salt is refused before a model is even loaded for it
    state = await _served_by(request, req.model)
    _keep(request, state, req)
    ollama.check_images(ollama.all_images(req), _vision(state))
    opts = _sampling(req, state)
    path, upstream = ollama.generate_body(req, opts)
    messages = upstream.get("messages") or [{"role": "user", "content": req.prompt}]
    key = _session(request, state, body, messages, domain)
    side = is_side_task(request.headers, messages, req.stream)
    shape = AnswerShape("generate", req.model)
    return await _run(request, state, "ollama.generate", key, path, upstream, shape, req.stream, side, opts,
                      started)


@router.post("/api/embed", openapi_extra=json_body(ollama.EmbedRequest))
async def embed(request: Request) -> dict[str, Any]:
    started = time.perf_counter_ns()
    req = ollama.parse(ollama.EmbedRequest, await _body(request))
    state = await _served_by(request, req.model)
    # Embeddings need a backend started with --embeddings, which then serves nothing else: no session can be on
    # it, so the request goes straight to the backend without a slot lease. Without the flag its 501 is passed on.
    data = await state.client.post_json("/v1/embeddings", ollama.embed_body(req))
    return ollama.embed_answer(req.model, data, time.perf_counter_ns() - started)


@router.post("/api/embeddings", openapi_extra=json_body(ollama.EmbeddingsRequest))
async def embeddings(request: Request) -> dict[str, Any]:
    req = ollama.parse(ollama.EmbeddingsRequest, await _body(request))
    state = await _served_by(request, req.model)
    data = await state.client.post_json("/v1/embeddings", {"input": [req.prompt]})
    return ollama.embeddings_answer(data)


@router.post("/api/pull", openapi_extra=json_body(ModelRequest), responses=answers(JSON_TYPE, NDJSON))
async def pull(request: Request) -> Response:
    req = ollama.parse(ModelRequest, await _body(request))
    listed = [info.model_id for info, _ in backends(request).listed()]
    served = [ollama.advertised_name(name) for name in listed]
    if not any(ollama.is_served(req.model_name, name) for name in listed):
        raise ollama.model_not_found(req.model_name, "', '".join(served))
    if not req.stream:
        return JSONResponse({"status": "success"}, media_type=JSON)
    lines = [ollama.ndjson({"status": "pulling manifest"}), ollama.ndjson({"status": "success"})]
    return StreamingResponse(_iterate(lines), media_type=NDJSON)


@router.post("/api/push")
@router.post("/api/create")
@router.post("/api/copy")
@router.delete("/api/delete")
@router.post("/api/blobs/{digest}", openapi_extra={"parameters": [
    {"name": "digest", "in": "path", "required": True, "schema": {"type": "string"}}]})
async def model_store(request: Request) -> Response:
    raise NotSupported(
        f"{request.url.path} is not supported: slotkeeper serves the one model its llama-server was started with "
        "and keeps no model store"
    )


@router.head("/api/blobs/{digest}", responses={404: {"description": "always: slotkeeper keeps no blobs"}})
async def blob_exists(digest: str) -> Response:
    return Response(status_code=404)


# -- running a turn ---------------------------------------------------------------------------------------------------


async def _run(request: Request, state: AppState, api: str, key: SessionKey, path: str, upstream: Mapping[str, Any],
               shape: AnswerShape, stream: bool, side: bool, opts: Sampling, started: int) -> Response:
    def build(slot_id: int) -> dict[str, Any]:
        return openai.upstream_body(upstream, slot_id)

    # Option names are the client's own strings: percent-encoded unless plain printable ASCII (a header is latin-1,
    # and a CR or LF in one would split it).
    noted = {"X-Slotkeeper-Ignored-Options": ",".join(map(header_safe, opts.ignored))} if opts.ignored else {}
    turns = await turns_for(request, state, key, side)
    if isinstance(turns, Response):
        return turns
    if not stream:
        data, record = await turns.unary(api, key, path, build, side=side, hung_up=request.is_disconnected)
        answer = ollama.unary_answer(shape, data, _now(), time.perf_counter_ns() - started, _load_ns(record))
        return JSONResponse(answer, headers={**record.headers(), **noted}, media_type=JSON)
    turn = await turns.open_stream(api, key, path, build, side=side, hung_up=request.is_disconnected)
    return TurnStreamResponse(turn, _ndjson(turn, shape, started), media_type=NDJSON, headers=noted)


async def _ndjson(turn: StreamTurn, shape: AnswerShape, started: int) -> AsyncIterator[bytes]:
    """The backend's events as Ollama lines; a connection that breaks mid-answer ends with one error line."""
    encoder = ollama.StreamEncoder(shape)
    try:
        async for event in turn.events():
            for line in encoder.feed(event, _now()):
                yield ollama.ndjson(line)
    except SlotkeeperError as exc:
        yield ollama.error_line(exc)
        return
    for line in encoder.finish(_now(), time.perf_counter_ns() - started, _load_ns(turn.record)):
        yield ollama.ndjson(line)


def _load_ns(record: TurnRecord) -> int:
    # Ollama's "load" is getting the model ready; ours is getting the session's state into a slot.
    return round((record.lease.cache.save_ms + record.lease.cache.restore_ms) * 1e6)


def _session(request: Request, state: AppState, body: Mapping[str, Any], messages: Any, domain: str) -> SessionKey:
    return resolve_session(state.backend.model_id, request.headers, body, openai.system_texts(messages),
                           state.settings.session_headers, opening=openai.opening(messages),
                           reply=openai.first_reply(messages), domain=domain)


def _sampling(req: ChatRequest | GenerateRequest, state: AppState) -> Sampling:
    opts = ollama.sampling(req)
    for name in opts.ignored:
        if name in _reported_options:
            continue
        _reported_options.add(name)  # once per process: these come with every request of a configured client
        if name in ollama.LAUNCH_TIME_OPTIONS:
            log.warning("option %r is fixed when the backend starts and is ignored per request (the backend has "
                        "%d tokens of context per slot)", name, state.backend.n_ctx_slot)
        else:
            log.info("option %r is not a llama-server sampling option and is ignored", name)
    return opts


# -- helpers ----------------------------------------------------------------------------------------------------------


async def _body(request: Request) -> dict[str, Any]:
    return openai.parse_body(await request.body())


async def _served_by(request: Request, requested: str) -> AppState:
    """The backend serving the requested model (Ollama's names: `name` and `name:latest` are the same); a router's
    model is loaded the first time, while the client waits."""
    if not requested:
        raise BadRequest("'model' is required")
    served = backends(request)
    if served.taking_turns is not None:
        return await served.ready(_turns_model(served, requested), request.is_disconnected)
    for state in served.models:
        if ollama.is_served(requested, state.backend.model_id):
            return state
    raise ollama.model_not_found(requested)


def _turns_model(served: Backends, requested: str) -> str:
    """The name of a requested model that takes turns (Ollama's names: `name` and `name:latest` are the same)."""
    assert served.taking_turns is not None
    for name in served.taking_turns.names():
        if ollama.is_served(requested, name):
            return name
    raise ollama.model_not_found(requested)


async def _load_or_unload(request: Request, kind: Literal["chat", "generate"], req: Generation) -> Response:
    """An empty chat or prompt: Ollama's way to load a model, or with keep_alive 0 to unload it. In front of a router
    that is done where models take turns (an unload saves the model's changed slots first); a single backend stays
    loaded."""
    served = backends(request)
    unload = ollama.unloads(req)
    if served.taking_turns is not None and unload:
        if not req.model:
            raise BadRequest("'model' is required")
        await served.taking_turns.unload(_turns_model(served, req.model), "a client asked: keep_alive 0")
    else:
        state = await _served_by(request, req.model)
        _keep(request, state, req)
    return JSONResponse(ollama.load_answer(kind, req.model, _now(), unload), media_type=JSON)


def _keep(request: Request, state: AppState, req: Generation) -> None:
    """Where models take turns: the request's keep_alive (or the default) for its model, from the end of its turn."""
    taking_turns = backends(request).taking_turns
    if taking_turns is not None:
        taking_turns.keep(state.backend.model_id, ollama.keep_alive_seconds(req.keep_alive))


def _vision(state: AppState) -> bool:
    return bool((state.backend.props.get("modalities") or {}).get("vision"))


_architectures: dict[str, str | None] = {}


async def _facts(state: AppState) -> ollama.ModelFacts:
    return await _facts_of(state.backend, state.started)


async def _facts_of(backend: BackendInfo, started: float) -> ollama.ModelFacts:
    path = Path(backend.model_path)
    if backend.model_path not in _architectures:
        _architectures[backend.model_path] = await asyncio.to_thread(_gguf_architecture, path)
    try:
        modified = (await asyncio.to_thread(path.stat)).st_mtime
    except OSError:
        modified = started  # the model file is on another machine
    modified_at = _timestamp(datetime.fromtimestamp(modified, UTC))
    return ollama.model_facts(backend, _architectures[backend.model_path], modified_at)


def _gguf_architecture(path: Path) -> str | None:
    """`general.architecture` from the GGUF header, when the model file is readable from here."""
    try:
        import gguf

        field = gguf.GGUFReader(path).get_field("general.architecture")
        return str(field.contents()) if field is not None else None
    except Exception as exc:  # any unreadable or foreign file: the listing says "unknown" instead of failing
        log.info("cannot read the model's architecture from %s: %s", path, exc)
        return None


def _now() -> str:
    return _timestamp(datetime.now(UTC))


def _timestamp(moment: datetime) -> str:
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


async def _iterate(items: Iterable[bytes]) -> AsyncIterator[bytes]:
    for item in items:
        yield item
