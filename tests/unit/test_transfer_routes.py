"""Export and import of a snapshot bundle, routed through the ASGI app in-process against a fake backend client and a
real SnapshotStore: what they answer when a save of the session lands, or the snapshot is evicted, meanwhile."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from slotkeeper.cache.bundle import BundleMeta, write_bundle
from slotkeeper.cache.operations import flush
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.errors import SlotkeeperError
from slotkeeper.types import BackendInfo, SnapshotKind
from slotkeeper.web import transfer_routes
from slotkeeper.web.errors import error_response
from slotkeeper.web.state import AppState, Backends
from tests.unit.test_pool import FP, A, FakeClient, make_pool, turn


@pytest.fixture
def client(slot_dir: Path) -> FakeClient:
    return FakeClient(slot_dir)


def app_for(pool: SlotPool, client: FakeClient, store: SnapshotStore) -> FastAPI:
    app = FastAPI()
    app.include_router(transfer_routes.router)

    @app.exception_handler(SlotkeeperError)
    async def slotkeeper_error(request: Request, exc: SlotkeeperError) -> JSONResponse:
        return error_response(request.url.path, exc)

    backend = BackendInfo("http://127.0.0.1:1", "m", "", len(pool.slots), 4096, "", FP)
    app.state.backends = Backends([AppState(None, backend, client, pool, None, 0.0)])  # type: ignore[arg-type]
    return app


def http(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app, raise_app_exceptions=False), base_url="http://t")


def bundle_file(data: bytes) -> tuple[dict[str, Any], bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        meta = tar.extractfile("snapshot.json")
        slot_file = tar.extractfile("snapshot.bin")
        assert meta is not None and slot_file is not None
        return json.loads(meta.read()), slot_file.read()


def file_checksum_of(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def commit_a_new_save(store: SnapshotStore) -> str:
    """A save of A committed by another task: a new file, the old one removed. Returns the new file's checksum."""
    temp = store.temp_name(A, FP)
    data = os.urandom(300)
    (store.slot_dir / temp).write_bytes(data)
    snapshot = store.commit(A, temp, FP, 50, (), len(data))
    return snapshot.checksum


@pytest.mark.parametrize("meanwhile", ["a-save-lands", "evicted"])
async def test_export_while_the_snapshot_changes_under_it(client: FakeClient, store: SnapshotStore,
                                                         monkeypatch: pytest.MonkeyPatch, meanwhile: str) -> None:
    """Between the export's look-up of the snapshot and the opening of its file, a save of the session commits (the
    old file is removed) or the disk budget evicts it: the export answers the new snapshot, or a 404, never a 500."""
    pool = make_pool(client, store)
    await turn(pool, A)
    await flush(pool)
    real = store.checked_snapshot
    new_sum: list[str] = []

    def looked_up_then_changed(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        if found is not None and not new_sum:
            if meanwhile == "a-save-lands":
                new_sum.append(commit_a_new_save(store))
            else:
                new_sum.append("")
                store.delete(A)
        return found

    monkeypatch.setattr(store, "checked_snapshot", looked_up_then_changed)
    async with http(app_for(pool, client, store)) as web:
        response = await web.get("/api/sessions/A/export")
    if meanwhile == "a-save-lands":
        assert response.status_code == 200, response.text
        meta, data = bundle_file(response.content)
        assert meta["checksum"] == new_sum[0] and len(data) == meta["bytes"] == 300
    else:
        assert response.status_code == 404, response.text
        assert response.json()["error"]["message"] == "no session snapshot 'A' to export"


async def test_an_idle_save_that_starts_during_an_import_does_not_land_over_it(
        slot_dir: Path, store: SnapshotStore) -> None:
    """A's changed state is in a slot; an import of A (replace=true) is uploading when A's idle save starts. The
    import is what A's snapshot is afterwards, and the slot no longer counts as A's."""
    client = FakeClient(slot_dir)
    pool = make_pool(client, store, save_idle_seconds=0.05)
    try:
        data = os.urandom(1000)
        meta = BundleMeta("m", "A", SnapshotKind.SESSION, FP, 60, len(data), file_checksum_of(data), ())
        bundle = b"".join(write_bundle(meta, io.BytesIO(data)))
        await turn(pool, A)
        client.save_delay = 0.3  # the idle save's backend write takes a while

        async def upload() -> AsyncIterator[bytes]:
            yield bundle[:1024]  # the metadata: the route looks the snapshot up, then copies the file
            for _ in range(200):
                if client.actions("save"):
                    break
                await asyncio.sleep(0.01)
            assert client.actions("save"), "the idle save never started"
            yield bundle[1024:]

        async with http(app_for(pool, client, store)) as web:
            response = await web.post("/api/sessions/import", params={"replace": "true"}, content=upload())
        assert response.status_code == 200, response.text
        assert await pool.snapshots.settle()
        snap = store.get(A)
        assert snap is not None and snap.checksum == meta.checksum and snap.n_tokens == 60
        assert pool.snapshots.saves == 1  # the idle save was committed, before the import
        assert pool.slots[0].occupant is None
    finally:
        await pool.aclose()
