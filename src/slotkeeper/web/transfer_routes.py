"""Moving snapshots between slotkeepers: GET /api/sessions/{id}/export answers a bundle (a tar stream, see
cache/bundle.py), POST /api/sessions/import takes one. Only a backend with the same fingerprint (model file, slot
layout, build) accepts a bundle: a snapshot is never restored into a backend that did not make it."""

from __future__ import annotations

import urllib.parse
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from slotkeeper.cache.bundle import BundleReader, meta_of, write_bundle
from slotkeeper.cache.operations import import_snapshot
from slotkeeper.domains import checked_domain, sees
from slotkeeper.errors import BadRequest, Forbidden, NotFound
from slotkeeper.serving.identity import checked_session_id
from slotkeeper.types import SessionKey
from slotkeeper.web.admin import one_kind, scoped_key
from slotkeeper.web.openapi import answers
from slotkeeper.web.security import BUNDLE_IMPORT_PATH, caller
from slotkeeper.web.state import app_state

router = APIRouter()
BUNDLE_TYPE = "application/x-tar"


@router.get("/api/sessions/{session_id:path}/export", responses=answers(BUNDLE_TYPE))
async def export(session_id: str, request: Request) -> Response:
    state = app_state(request, request.query_params.get("model"))
    kind = one_kind(request)
    key = scoped_key(state, session_id, request)
    found = await state.snapshots.transfers.open_for_export(key, kind)
    if found is None:
        raise NotFound(f"no {kind} snapshot '{session_id}' to export")
    snapshot, chain, slot_file = found
    name = urllib.parse.quote(f"{session_id}.slotkeeper.tar", safe="")
    return StreamingResponse(iterate_in_threadpool(write_bundle(meta_of(snapshot, chain), slot_file)),
                             media_type=BUNDLE_TYPE,
                             headers={"Content-Disposition": f"attachment; filename*=UTF-8''{name}"})


@router.post(BUNDLE_IMPORT_PATH)
async def import_bundle(request: Request) -> dict[str, Any]:
    """`?as=ID` renames the session, `?replace=true` overwrites an existing snapshot of that id. The snapshot goes
    into the cache domain it was exported from, which the caller must see (domains.py); `?domain=D` puts it
    into another, for the admin only."""
    state = app_state(request, request.query_params.get("model"))
    reader = BundleReader(request.stream())
    meta = await reader.meta()
    fingerprint = state.backend.fingerprint
    if meta.fingerprint != fingerprint:
        raise BadRequest(f"the bundle's snapshot was made by another model, slot layout or build (fingerprint "
                         f"{meta.fingerprint}; this backend's is {fingerprint}), so it cannot be restored here")
    session = checked_session_id(request.query_params.get("as") or meta.session_id, "the import")
    key = SessionKey(state.backend.model_id, session, domain=_import_domain(meta.domain, request))
    replace = request.query_params.get("replace", "").lower() in ("1", "true", "yes")
    if not replace and await state.snapshots.get(key, meta.kind) is not None:
        raise BadRequest(f"a {meta.kind} snapshot '{session}' exists already; import with replace=true (the CLI's "
                         "--replace) to overwrite it, or as=ID (--as) to give it another id")
    temp, path = await state.snapshots.transfers.stage_upload(key, meta.kind)
    try:
        await reader.copy_file_to(path, meta.n_bytes)
        if await state.snapshots.transfers.checksum(path) != meta.checksum:
            raise BadRequest("the bundle's snapshot.bin does not match its checksum (damaged on the way?)")
    except BaseException:
        await state.snapshots.transfers.discard_upload(temp)
        raise
    # In order with the session's saves (one may have started during the upload), and no slot saves it after.
    snapshot = await import_snapshot(state.pool, key, temp, meta.n_tokens, meta.chain, meta.n_bytes, meta.kind,
                                     meta.n_prompt)
    return {"imported": session, "model": snapshot.model, "domain": snapshot.domain, "kind": str(snapshot.kind),
            "tokens": snapshot.n_tokens, "bytes": snapshot.n_bytes, "file": snapshot.filename}


def _import_domain(exported_from: str, request: Request) -> str:
    """The cache domain an import goes into: the bundle's own (checked: a bundle is the client's input), when the
    caller may see it; another only when the admin names it with `?domain=`."""
    who = caller(request.scope)
    source = checked_domain(exported_from)
    asked = request.query_params.get("domain")
    target = source if asked is None else checked_domain(asked)
    if target != source and not who.admin:
        raise Forbidden(f"the bundle was exported from cache domain {source!r}: only the admin key may import it "
                        "into another (?domain=)")
    if not sees(who, target):
        raise Forbidden(f"the bundle was exported from cache domain {source!r}, which this key may not write to; "
                        "import it with that domain's key, or with the admin key")
    return target
