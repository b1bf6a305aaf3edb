"""The session API (/api/sessions...): what is hot in which slot, what is saved on disk, and clearing or deleting it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request

from slotkeeper.cache.operations import clear, clear_slot
from slotkeeper.domains import checked_domain, sees
from slotkeeper.errors import BadRequest, NotFound
from slotkeeper.serving.identity import session_group
from slotkeeper.types import IdSource, SessionKey, Snapshot, SnapshotKind
from slotkeeper.web.security import caller
from slotkeeper.web.state import AppState, app_state, backends, caught_up

router = APIRouter(prefix="/api/sessions")


@router.get("")
async def list_sessions(request: Request) -> dict[str, Any]:
    """Saved sessions; `?kind=system` lists system-prompt snapshots instead, `?kind=all` both; `?group=sys-<hash>`
    only the conversations without an id of their own on that system prompt."""
    kind = _kind_filter(request)
    model = request.query_params.get("model")
    group = request.query_params.get("group")
    served = backends(request)
    states = served.members_of(model)
    who = caller(request.scope)  # each caller lists its own cache domain's (the admin every domain's)
    sessions = []
    for state in states:
        # A router's models share one store: each lists its own.
        own = state.backend.model_id if served.taking_turns is not None else None
        snapshots = await state.snapshots.list(own, kind)
        sessions += [_snapshot_json(s, _hot_slot(state, s.key)) for s in snapshots
                     if (group is None or session_group(s.session_id) == group) and sees(who, s.domain)]
    sessions.sort(key=lambda s: s["last_used"], reverse=True)
    # A router's models before the first is loaded: its slot dir.
    slot_dir = states[0].snapshots.slot_dir if states or served.taking_turns is None else served.taking_turns.slot_dir
    return {"slot_dir": str(slot_dir), "sessions": sessions}


@router.get("/current")
async def current_session(request: Request) -> dict[str, Any]:
    state = app_state(request, request.query_params.get("model"))
    await caught_up([state])  # so the counters include the saves still being committed
    slots = [
        {
            "id": slot.slot_id,
            "session": slot.occupant.session_id if slot.occupant else None,
            "model": slot.occupant.model if slot.occupant else None,
            "dirty": slot.dirty,
            "busy": slot.busy,
            "n_tokens": slot.n_tokens,
        }
        for slot in state.pool.slots
    ]
    first = state.pool.slots[0].occupant
    snapshot = await state.snapshots.get(first) if first is not None else None
    pool, snapshots = state.pool, state.snapshots
    policy = pool.policy
    return {
        "model": state.backend.model_id,
        "session": first.session_id if first is not None else None,
        "snapshot": _snapshot_json(snapshot, 0) if snapshot is not None else None,
        "slots": slots,
        "queue": pool.queue_length,
        "saves": snapshots.saves,
        "failed_saves": snapshots.failed_saves,
        "restores": pool.restorer.restores,
        "warm_ups": pool.warmups.warm_ups,
        "failed_warm_ups": pool.warmups.failed_warm_ups,
        "evictions": snapshots.evictions,
        "restore_effective": policy.effective_now,
        "restores_effective": policy.effective,
        "restores_ineffective": policy.ineffective,
        "restoring": {
            "strategy": str(policy.strategy),
            "architecture": policy.capability.arch or None,
            "kind": str(policy.capability.kind),
            "checkpoints_in_file": policy.capability.checkpoints_in_file,
            "build": state.backend.build_info,
            "reason": policy.reason(),
            "prompt_end_steps": pool.saver.prompt_end_steps,
            "prompt_end_tokens": pool.saver.prompt_end_tokens,
            "prompt_end_ms": round(pool.saver.prompt_end_ms, 1),
        },
    }


@router.get("/disk")
async def disk(request: Request) -> dict[str, Any]:
    """What the snapshots take, the budget they are kept under, and how much the budget evicted."""
    state = app_state(request, request.query_params.get("model"))
    usage = await state.snapshots.usage()
    disk = await state.snapshots.disk()
    budget = state.snapshots.budget
    return {
        "slot_dir": disk["slot_dir"],
        "ram": disk["ram"],
        "bytes": sum(u["bytes"] for u in usage.values()),
        # What they take on disk: whole files, tails, and each KV block once however many states share it.
        "stored_bytes": disk["stored_bytes"],
        "blocks": disk["blocks"],
        "snapshots": usage,
        "budget": {"max_bytes": budget.max_bytes, "max_age_seconds": budget.max_age_seconds,
                   "max_system_snapshots": budget.max_system_snapshots},
        "evictions": state.snapshots.evictions,
        "disk_free_bytes": disk["free_bytes"],
    }


@router.post("/{session_id:path}/pin")
async def pin(session_id: str, request: Request) -> dict[str, Any]:
    return await _set_pinned(session_id, request, True)


@router.post("/{session_id:path}/unpin")
async def unpin(session_id: str, request: Request) -> dict[str, Any]:
    return await _set_pinned(session_id, request, False)


async def _set_pinned(session_id: str, request: Request, pinned: bool) -> dict[str, Any]:
    """Pin (never evicted by the disk budget) or unpin a snapshot; `?kind=system` for a system prompt's."""
    state = app_state(request, request.query_params.get("model"))
    key = scoped_key(state, session_id, request)
    kind = one_kind(request)
    snapshot = await state.snapshots.set_pinned(key, pinned, kind)
    if snapshot is None:
        raise NotFound(f"no {kind} snapshot '{session_id}'")
    return _snapshot_json(snapshot, _hot_slot(state, key))


@router.post("/clear")
async def clear_slots(request: Request) -> dict[str, Any]:
    """Save changed slots, then erase them: every slot, or with `?slot=N` that one only."""
    state = app_state(request, request.query_params.get("model"))
    slot = request.query_params.get("slot")
    if slot is None:
        erased = await clear(state.pool)
        return {"erased_slots": erased, "session": "default"}
    slot_id = _slot_number(slot)
    held = await clear_slot(state.pool, slot_id)
    return {"erased_slots": [slot_id], "session": "default", "held": held.session_id if held is not None else None}


@router.get("/{session_id:path}")
async def get_session(session_id: str, request: Request) -> dict[str, Any]:
    state = app_state(request, request.query_params.get("model"))
    key = scoped_key(state, session_id, request)
    kind = one_kind(request)
    snapshot = await state.snapshots.get(key, kind)
    if kind is SnapshotKind.SYSTEM:
        if snapshot is None:
            raise NotFound(f"no {kind} snapshot '{session_id}'")
        return _snapshot_json(snapshot, None)
    hot = _hot_slot(state, key)
    if snapshot is None and hot is None:
        raise NotFound(f"session '{session_id}' not found")
    if snapshot is None:
        return {"session": key.session_id, "model": key.model, "domain": key.domain, "hot_in_slot": hot,
                "file": None}
    return _snapshot_json(snapshot, hot)


@router.delete("/{session_id:path}")
async def delete_session(session_id: str, request: Request) -> dict[str, Any]:
    """Delete a session's snapshot (and stop saving it from a slot); `?kind=system` a system prompt's."""
    state = app_state(request, request.query_params.get("model"))
    key = scoped_key(state, session_id, request)
    kind = one_kind(request)
    if kind is SnapshotKind.SESSION:
        state.pool.forget(key)
    removed = await state.snapshots.delete(key, kind)
    if removed is None:
        raise NotFound(f"session '{session_id}' not found" if kind is SnapshotKind.SESSION
                       else f"no {kind} snapshot '{session_id}'")
    return {"deleted": key.session_id, "model": key.model, "kind": str(kind), "file": removed.filename,
            "bytes": removed.n_bytes}


def scoped_key(state: AppState, session_id: str, request: Request) -> SessionKey:
    """The session a route of the session API names: in the caller's cache domain, or with `?domain=D` in D when
    the caller may see it (the admin any; anyone else one below their own). A domain the caller may not see is
    answered as a session that does not exist."""
    model = request.query_params.get("model") or state.backend.model_id
    who = caller(request.scope)
    asked = request.query_params.get("domain")
    domain = who.domain if asked is None else checked_domain(asked)
    if not sees(who, domain):
        raise NotFound(f"session '{session_id}' not found")
    return SessionKey(model, session_id, IdSource.HEADER, domain)


def _kind_filter(request: Request) -> SnapshotKind | None:
    value = request.query_params.get("kind", "session")
    if value == "all":
        return None
    try:
        return SnapshotKind(value)
    except ValueError:
        raise BadRequest(f"kind must be session, system or all, not {value!r}") from None


def one_kind(request: Request) -> SnapshotKind:
    """The snapshot kind a route acts on: `?kind=session` (the default) or `?kind=system`."""
    value = request.query_params.get("kind", "session")
    try:
        return SnapshotKind(value)
    except ValueError:
        raise BadRequest(f"kind must be session or system, not {value!r}") from None


def _slot_number(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"slot must be a slot number (0, 1, ...), not {value!r}") from None


def _hot_slot(state: AppState, key: SessionKey) -> int | None:
    for slot in state.pool.slots:
        if slot.occupant == key:
            return slot.slot_id
    return None


def _snapshot_json(snapshot: Snapshot, hot_slot: int | None) -> dict[str, Any]:
    return {
        "session": snapshot.session_id,
        # The system prompt group of a conversation known by its messages (sys-<hash>), else null.
        "group": session_group(snapshot.session_id) if snapshot.kind is SnapshotKind.SESSION else None,
        "model": snapshot.model,
        # The cache domain it belongs to ("": the one domain of requests nothing keeps apart).
        "domain": snapshot.domain,
        "file": snapshot.filename,
        "bytes": snapshot.n_bytes,
        # "blocks": kept as KV blocks shared with other states and a tail of `tail_bytes` (cache/blockstore.py).
        "stored_as": "blocks" if snapshot.tail_bytes else "file",
        "tail_bytes": snapshot.tail_bytes,
        "tokens": snapshot.n_tokens,
        "fingerprint": snapshot.fingerprint,
        "created": _iso(snapshot.created),
        "last_used": _iso(snapshot.last_used),
        "hits": snapshot.hits,
        "kind": str(snapshot.kind),
        "pinned": snapshot.pinned,
        "hot_in_slot": hot_slot,
    }


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")
