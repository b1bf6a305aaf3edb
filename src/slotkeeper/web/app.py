"""Wiring: build the store, backend, pool and service at start-up, save every changed slot at shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from slotkeeper import __version__
from slotkeeper.backend import discover
from slotkeeper.cache.budget import DiskBudget
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.store import SnapshotStore, make_private_dir
from slotkeeper.config import Settings
from slotkeeper.errors import SlotkeeperError
from slotkeeper.service import TurnService
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.launcher import StartedBackend, start_backend
from slotkeeper.upstream.supervisor import Supervisor
from slotkeeper.watch import BackendWatch
from slotkeeper.web import (
    activity,
    admin,
    anthropic_routes,
    dashboard,
    metrics,
    ollama_routes,
    openai_routes,
    prewarm_routes,
)
from slotkeeper.web.errors import error_response
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
        budget = settings.shutdown_budget
        try:
            started = await start_backend(settings, slot_dir)
        except BaseException:
            store.close()
            raise
        client = UpstreamClient(started.url, read_timeout=settings.upstream_read_timeout,
                                slot_op_timeout=settings.slot_op_timeout)
        try:
            backend = await discover(client, store, slot_dir, settings.model_alias or started.model_alias)
        except BaseException:
            await client.aclose()
            await started.stop(budget.stopping)
            store.close()
            raise
        pool = SlotPool(backend.n_slots, client, store, backend.fingerprint, backend.n_ctx_slot,
                        settings.save_idle_seconds, settings.min_restore_tokens, settings.max_queue,
                        settings.system_snapshots, DiskBudget(settings.disk_budget, settings.max_snapshot_age,
                                                              settings.max_system_snapshots))
        await pool.enforce_budget()
        service = TurnService(client, pool)

        def backend_changed(up: bool) -> None:
            service.backend_down = not up

        watch = BackendWatch(client, pool, backend_changed)
        supervisor = _supervisor(started, watch, pool, settings)
        app.state.slotkeeper = AppState(settings, backend, client, store, pool, service, time.time(), started.server,
                                        supervisor)
        app.state.metrics = metrics.Metrics(app.state.slotkeeper)
        log.info("serving model %r from %s: %d slot(s) of %d tokens, fingerprint %s, snapshots in %s",
                 backend.model_id, started.url, backend.n_slots, backend.n_ctx_slot, backend.fingerprint, slot_dir)
        tasks = [asyncio.create_task(watch.run()), asyncio.create_task(_keep_budget(pool))]
        if supervisor is not None:
            tasks.append(asyncio.create_task(supervisor.run()))
        try:
            yield
        finally:
            # The supervisor goes first, so that stopping the server below is not taken for a crash.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                saved = await asyncio.wait_for(pool.flush(), budget.saving)
                log.info("shutdown: saved %d changed slot(s)", saved)
            except TimeoutError:
                log.warning("shutdown: saving the changed slots took more than %.0f s (half of shutdown_timeout); "
                            "the slots not saved by then lose their latest turns", budget.saving)
            await pool.aclose()
            await client.aclose()
            await started.stop(budget.stopping)
            store.close()

    app = FastAPI(title="slotkeeper", version=__version__, lifespan=lifespan)

    @app.exception_handler(SlotkeeperError)
    async def slotkeeper_error(request: Request, exc: SlotkeeperError) -> JSONResponse:
        return error_response(request.url.path, exc)

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
    app.include_router(prewarm_routes.router)  # before the session routes' /api/sessions/{id}
    app.include_router(admin.router)
    # Before the Ollama routes, whose /api/{rest} catch-all would answer /api/requests and /api/backend.
    for router in (metrics.router, activity.router, dashboard.router):
        app.include_router(router)
    app.include_router(ollama_routes.router)
    return app


async def _keep_budget(pool: SlotPool, interval: float = 60.0) -> None:
    """Saves enforce the disk budget as they happen; this catches snapshots that age out while nothing is saved."""
    while True:
        await asyncio.sleep(interval)
        await pool.enforce_budget()


def _supervisor(started: StartedBackend, watch: BackendWatch, pool: SlotPool, settings: Settings) -> Supervisor | None:
    """A supervisor for the server slotkeeper started (none in attach mode): a crash marks the backend down and
    forgets what every slot held; the restarted server marks it up again."""
    server = started.server
    if server is None:
        return None

    def down(reason: str) -> None:
        watch.mark_down()
        pool.reset_slots(pool.generations(), reason)

    def up() -> None:
        watch.mark_up(pool.generations(), f"{server.name} was restarted")

    return Supervisor(server, ready_timeout=settings.start_timeout, on_down=down, on_up=up)
