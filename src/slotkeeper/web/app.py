"""Wiring: build the store, backend, pool and service at start-up, save every changed slot at shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from slotkeeper import __version__
from slotkeeper.config import Settings
from slotkeeper.errors import MethodNotAllowed, NotFound, SlotkeeperError
from slotkeeper.web import (
    activity,
    admin,
    anthropic_routes,
    dashboard,
    llama_routes,
    metrics,
    ollama_routes,
    openai_routes,
    prewarm_routes,
    transfer_routes,
)
from slotkeeper.web.errors import error_response
from slotkeeper.web.localmodels import LocalModels
from slotkeeper.web.openapi import SlotkeeperAPI
from slotkeeper.web.replicas import Replicas, join_replicas
from slotkeeper.web.routermode import RouterRuntime, start_runtime
from slotkeeper.web.runtime import RunningBackend, form_groups
from slotkeeper.web.security import Guard, Keys
from slotkeeper.web.state import Backends, backends

log = logging.getLogger("slotkeeper")


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        running: list[RunningBackend | RouterRuntime | LocalModels] = []
        joined: Replicas | None = None
        heartbeat: asyncio.Task[None] | None = None
        try:
            if settings.backends and settings.max_loaded > 0:  # slotkeeper's own models, taking turns
                running.append(await LocalModels.start(settings, settings.backend_settings()))
            else:
                for backend_settings in settings.backend_settings():
                    running.append(await start_runtime(backend_settings))
            turns = [r for r in running if not isinstance(r, RunningBackend)]  # models that take turns
            if turns and settings.directory is not None:
                raise SlotkeeperError("several replicas (--directory) do not work with models that take turns (a "
                                      "router, or max_loaded) yet: run one slotkeeper in front of them")
            if turns and len(running) > 1:
                raise SlotkeeperError("a llama-server router serves every model itself: give slotkeeper that one "
                                      "backend, not several [[backends]]")
            singles = [r.state for r in running if isinstance(r, RunningBackend)]
            await form_groups(singles, settings.load_factor)
            served = app.state.backends = Backends(singles + (turns[0].states if turns else []),
                                                   turns[0] if turns else None)
            if turns:
                turns[0].on_state = served.add
            if settings.directory is not None:
                joined = app.state.replicas = join_replicas(settings, app.state.backends)
                await joined.directory.beat()
                heartbeat = asyncio.create_task(joined.directory.run())
            app.state.metrics = metrics.Metrics(app.state.backends, None if joined is None else joined.directory)
            yield
        finally:
            await asyncio.gather(*(r.stop() for r in running))
            if heartbeat is not None:
                heartbeat.cancel()
                await asyncio.gather(heartbeat, return_exceptions=True)
            if joined is not None:  # after the last saves: their uploads were made under the leases
                await joined.directory.close()
                await joined.aclose()

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
        served = backends(request)
        if served.taking_turns is not None:
            return _turns_health(served)
        states = served.all
        ups = await asyncio.gather(*(s.client.healthy() for s in states))
        # A model on several backends is served while one of them is up.
        serving = {s.backend.model_id for s, ok in zip(states, ups, strict=True) if ok}
        state, up = states[0], all(s.backend.model_id in serving for s in states)
        body: dict[str, object] = {"status": "ok" if up else "backend unavailable", "model": state.backend.model_id,
                                   "backend": state.backend.url}
        if len(states) > 1:
            body["backends"] = [{"model": s.backend.model_id, "backend": s.backend.url, "up": ok}
                                for s, ok in zip(states, ups, strict=True)]
        return JSONResponse(body, status_code=200 if up else 503)

    app.add_middleware(
        Guard, bind_host=settings.host, allowed_hosts=settings.allowed_hosts,
        keys=Keys(settings.api_key, settings.admin_key, settings.api_keys, settings.user_header),
        max_body_bytes=settings.max_body_bytes,
    )
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(llama_routes.router)
    app.include_router(prewarm_routes.router)  # before the session routes' /api/sessions/{id}
    app.include_router(transfer_routes.router)
    # An unknown path or a wrong method anywhere (under /api too) is the router's 404 or 405, rendered by
    # routing_error above in the path's dialect.
    for router in (admin.router, metrics.router, activity.router, dashboard.router, ollama_routes.router):
        app.include_router(router)
    return app


def _turns_health(served: Backends) -> JSONResponse:
    """Models that take turns (a router's, or slotkeeper's own under max_loaded): up while they can be served; each
    model with whether it is loaded."""
    taking_turns = served.taking_turns
    assert taking_turns is not None
    up = taking_turns.up
    body = {"status": "ok" if up else "backend unavailable",
            "models": [{"model": m.model, "status": m.status} for m in taking_turns.status()]}
    return JSONResponse(body, status_code=200 if up else 503)


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

