"""Wiring: build the store, backend, pool and service at start-up, save every changed slot at shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from slotkeeper import __version__
from slotkeeper.backend import discover
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.store import SnapshotStore, make_private_dir
from slotkeeper.config import Settings
from slotkeeper.errors import MethodNotAllowed, NotFound, SlotkeeperError
from slotkeeper.service import TurnService
from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.launcher import EmbeddedBackend
from slotkeeper.watch import BackendWatch
from slotkeeper.web import activity, admin, anthropic_routes, dashboard, metrics, ollama_routes, openai_routes
from slotkeeper.web.errors import error_response
from slotkeeper.web.openapi import SlotkeeperAPI
from slotkeeper.web.security import Guard
from slotkeeper.web.state import AppState, app_state

log = logging.getLogger("slotkeeper")


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        make_private_dir(settings.cache_dir)
        slot_dir = settings.effective_slot_dir()
        store = SnapshotStore(slot_dir, settings.index_path)
        await asyncio.to_thread(store.reconcile)
        embedded: EmbeddedBackend | None = None
        if settings.embedded:
            model = settings.model if settings.model is not None else await asyncio.to_thread(
                _tiny_model, settings.cache_dir
            )
            embedded = EmbeddedBackend(
                model, slot_dir, ctx_size=settings.ctx_size, parallel=settings.parallel,
                cache_ram_mib=settings.cache_ram_mib, alias=settings.model_alias,
                log_path=settings.cache_dir / "embedded-server.log",
            )
            await asyncio.to_thread(embedded.start)
            url = embedded.url
        else:
            assert settings.upstream is not None
            url = settings.upstream
        client = UpstreamClient(url, read_timeout=settings.upstream_read_timeout,
                                slot_op_timeout=settings.slot_op_timeout)
        try:
            backend = await discover(client, store, slot_dir, settings.model_alias)
        except BaseException:
            await client.aclose()
            if embedded is not None:
                embedded.stop()
            store.close()
            raise
        pool = SlotPool(backend.n_slots, client, store, backend.fingerprint, backend.n_ctx_slot,
                        settings.save_idle_seconds, settings.min_restore_tokens, settings.max_queue)
        app.state.slotkeeper = AppState(settings, backend, client, store, pool, TurnService(client, pool), time.time())
        app.state.metrics = metrics.Metrics(app.state.slotkeeper)
        log.info("serving model %r from %s: %d slot(s) of %d tokens, fingerprint %s, snapshots in %s",
                 backend.model_id, url, backend.n_slots, backend.n_ctx_slot, backend.fingerprint, slot_dir)
        service = app.state.slotkeeper.service

        def backend_changed(up: bool) -> None:
            service.backend_down = not up

        watch = BackendWatch(client, pool, backend_changed)
        watch_task = asyncio.create_task(watch.run())
        try:
            yield
        finally:
            watch_task.cancel()
            saved = await pool.flush()
            log.info("shutdown: saved %d changed slot(s)", saved)
            await pool.aclose()
            await client.aclose()
            if embedded is not None:
                await asyncio.to_thread(embedded.stop)
            store.close()

    app = SlotkeeperAPI(title="slotkeeper", version=__version__, lifespan=lifespan)

    @app.exception_handler(SlotkeeperError)
    async def slotkeeper_error(request: Request, exc: SlotkeeperError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
        # The router's own refusals (no route matches the path; a route does, for other methods) in the path's
        # dialect instead of FastAPI's {"detail": ...}, the 405 with an Allow header.
        response = error_response(request.url.path, _routing_error(request, exc))
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            response.headers["Allow"] = ", ".join(_allowed_methods(request))
        return response

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error: %s", exc)
        return error_response(request.url.path, SlotkeeperError(f"internal error: {type(exc).__name__}"))

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        state = app_state(request)
        up = await state.client.healthy()
        body = {"status": "ok" if up else "backend unavailable", "model": state.backend.model_id,
                "backend": state.backend.url}
        return JSONResponse(body, status_code=200 if up else 503)

    app.add_middleware(
        Guard, bind_host=settings.host, allowed_hosts=settings.allowed_hosts, api_key=settings.api_key,
        admin_key=settings.admin_key, max_body_bytes=settings.max_body_bytes,
    )
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    # An unknown path or a wrong method anywhere (under /api too) is the router's 404 or 405, rendered by
    # routing_error above in the path's dialect.
    for router in (admin.router, metrics.router, activity.router, dashboard.router, ollama_routes.router):
        app.include_router(router)
    return app


def _routing_error(request: Request, exc: HTTPException) -> SlotkeeperError:
    if exc.status_code == 404:
        return NotFound(f"no such route: {request.url.path}")
    if exc.status_code == 405:
        return MethodNotAllowed(f"method {request.method} not allowed for {request.url.path}")
    error = SlotkeeperError(str(exc.detail))
    error.status_code = exc.status_code
    return error


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route takes at this path: Starlette's own Allow names only the first route that matched,
    and /api/sessions/{id} is two routes (GET and DELETE)."""
    allowed = []
    for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] is Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return allowed


def _tiny_model(cache_dir: Path) -> Path:
    spec = TinyModelSpec()
    path = cache_dir / "models" / f"{spec.name}-{spec.seed}.gguf"
    if not path.exists():
        make_private_dir(path.parent)
        write_tiny_model(path, spec)
    log.info("no model given: using the generated tiny random-weight test model %s (its output is gibberish; "
             "pass --model PATH.gguf for a real one)", path)
    return path
