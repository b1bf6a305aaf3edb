"""Operator views: the recent requests with their cache path, and a backend's settings as slotkeeper read them.

The dashboard polls these; `slotkeeper doctor` reads `/api/backend` to check the backend's settings. In launch and
embedded modes `/api/backend` also names the server process slotkeeper runs (pid, restarts, log file).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from slotkeeper import __version__
from slotkeeper.cache.pool import SlotPool
from slotkeeper.dialects.openai import parse_body
from slotkeeper.domains import checked_domain, sees
from slotkeeper.errors import BadRequest, NotFound
from slotkeeper.journal import RECENT_REQUESTS, RequestEntry
from slotkeeper.serving.swaps import ModelStatus
from slotkeeper.web.openapi import json_body
from slotkeeper.web.security import caller
from slotkeeper.web.state import AppState, app_state, backends

router = APIRouter(prefix="/api")
_DRAIN = {"type": "object", "required": ["backend"],
          "properties": {"backend": {"type": "string"}, "draining": {"type": "boolean"}}}


@router.get("/requests/recent")
async def recent_requests(request: Request) -> dict[str, Any]:
    """The recent requests of one backend (`?model=NAME`) or, without it, of every backend, newest first;
    `?session=ID`: that session's latest requests only. A caller sees its own cache domain's (and the domains
    below it: domains.py), the admin every domain's; `?domain=D` names a session's domain."""
    model = request.query_params.get("model")
    states = backends(request).members_of(model)
    try:
        limit = max(0, min(RECENT_REQUESTS, int(request.query_params.get("limit", RECENT_REQUESTS))))
    except ValueError:
        limit = RECENT_REQUESTS
    journals = [state.service.journal for state in states]
    who = caller(request.scope)
    session = request.query_params.get("session")
    if session is not None:  # one session's latest requests (kept apart from the ring of all requests)
        domain = checked_domain(request.query_params.get("domain", who.domain))
        found: Iterable[RequestEntry] = (e for state in states
                                         for e in state.service.journal.of_session(state.backend.model_id, session,
                                                                                   domain))
    else:
        found = (e for j in journals for e in j.recent(RECENT_REQUESTS))
    entries = sorted((e for e in found if sees(who, e.domain)), key=lambda e: e.time, reverse=True)[:limit]
    totals = [item for j in journals for item in j.totals().items() if sees(who, item[0][2])]
    return {
        "requests": [entry.to_json() for entry in entries],
        "session_totals": [
            {"model": name, "session": session, "domain": domain, "requests": t.requests, "hits": t.hits,
             "tokens_reused": t.tokens_reused, "tokens_prefilled": t.tokens_prefilled,
             "seconds_saved": round(t.seconds_saved, 3), "last_request": t.last_request}
            for (name, session, domain), t in totals
        ],
        "ms_per_token": journals[0].ms_per_token if journals else None,
    }


@router.get("/backend")
async def backend_info(request: Request) -> dict[str, Any]:
    """One backend (`?model=NAME`, default the first) and, in `models`, the names of all of them."""
    state = app_state(request, request.query_params.get("model"))
    backend, settings = state.backend, state.settings
    props = backend.props
    generation = props.get("default_generation_settings")
    return {
        "version": __version__,
        "url": backend.url,
        "up": await state.client.healthy(),
        # What slotkeeper goes by (BackendHealth): False while it counts the backend as down and requests wait.
        "serving": state.service.health.up,
        "outages": state.service.health.outages,
        "mode": settings.mode,
        "server": _server_info(state),
        "model": backend.model_id,
        "models": [s.backend.model_id for s in backends(request).models],
        "model_path": backend.model_path,
        "slots": backend.n_slots,
        "ctx_per_slot": backend.n_ctx_slot,
        "build": backend.build_info,
        "fingerprint": backend.fingerprint,
        # A model on several backends: each of them, up or not, draining or not, with its active sessions.
        "backends": state.group.status() if state.group is not None else None,
        # Several replicas (--directory): the directory, whether it answers, the other replicas, leases held here.
        "directory": replicas.directory.status() if (replicas := getattr(request.app.state, "replicas", None))
        else None,
        "slot_dir": str(state.snapshots.slot_dir),
        "slot_dir_free_bytes": await asyncio.to_thread(_free_bytes, state.snapshots.slot_dir),
        "started": state.started,
        "settings": {
            "save_idle_seconds": settings.save_idle_seconds,
            "min_restore_tokens": settings.min_restore_tokens,
            "max_queue": settings.max_queue,
        },
        # When a restore pays on this backend (cache/costs.py): measured as it runs, or the fixed floor.
        "restore_costs": _costs(state.pool),
        "props": {
            "total_slots": props.get("total_slots"),
            "n_ctx": generation.get("n_ctx") if isinstance(generation, dict) else None,
            "is_sleeping": props.get("is_sleeping"),
        },
    }


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    """Each model served: loaded or not (in front of a router, where models take turns), its running turns, its loads
    and unloads, the conversations its last unload saved first, and when its keep_alive runs out."""
    served = backends(request)
    if served.taking_turns is not None:
        listed = served.taking_turns.status()
    else:
        listed = [ModelStatus(s.backend.model_id, "loaded", sum(1 for slot in s.pool.slots if slot.busy), 1, 0, [],
                              None, None) for s in served.models]
    return {"take_turns": served.taking_turns is not None, "models": [dataclasses.asdict(m) for m in listed]}


@router.post("/backend/drain", openapi_extra=json_body(_DRAIN, "A backend of a model that runs on several."))
async def drain(request: Request) -> dict[str, Any]:
    """Take one backend of a model on several out of service (`"draining": true`): it gets no new session, and each
    of its sessions moves to another backend, with its snapshot, at its next turn; `false` puts it back."""
    body = parse_body(await request.body())
    url, draining = body.get("backend"), body.get("draining", True)
    if not isinstance(url, str) or not isinstance(draining, bool):
        raise BadRequest('give {"backend": URL, "draining": true or false}')
    for state in backends(request).models:
        group = state.group
        if group is not None and any(m.backend.url == url.rstrip("/") for m in group.members):
            group.drain(url.rstrip("/"), draining)
            return {"model": state.backend.model_id, "backends": group.status()}
    raise NotFound(f"no backend {url} of a model that runs on several backends")


def _server_info(state: AppState) -> dict[str, Any] | None:
    """The server process slotkeeper runs (launch and embedded modes): its pid, restarts and log file."""
    server, supervisor = state.server, state.supervisor
    if server is None:
        return None
    return {
        "name": server.name,
        "pid": server.pid,
        "running": server.running,
        "restarts": supervisor.restarts if supervisor is not None else 0,
        "last_exit": supervisor.last_exit if supervisor is not None else None,
        "log": str(server.log_path),
    }


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _costs(pool: SlotPool) -> dict[str, Any]:
    costs = pool.costs.now()
    return {
        "prefill_ms_per_token": costs.prefill_ms_per_token,
        "restore": {tier.name.lower(): {"fixed_ms": fit.fixed_ms, "ms_per_mib": fit.ms_per_byte * 2**20}
                    for tier, fit in costs.restore},
        "bytes_per_token": costs.bytes_per_token,
        # until the first restore: the backend's saves, fitted the same way, stand in for a restore's cost
        "saves_stand_in": None if costs.stand_in is None else {
            "fixed_ms": costs.stand_in.fixed_ms, "ms_per_mib": costs.stand_in.ms_per_byte * 2**20},
        "floor_tokens": pool.floor(),
        # the tiers measured often enough that a large restore from them is skipped when it clearly loses
        "trusted": [tier.name.lower() for tier in costs.trusted],
    }
