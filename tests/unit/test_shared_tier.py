"""The shared tier's rules against an in-memory object store that can fail on purpose: uploads after commit, one
file per session, conditional manifest writes racing another host, a store that is down, damaged downloads.
(tests/integration/test_shared_store.py runs the same against a real S3 server with real llama.cpp servers.)"""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from slotkeeper.cache.operations import flush, import_snapshot
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.slots import TurnEnd
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.fleet.shared import Manifest, SharedTier
from slotkeeper.types import SnapshotKind
from tests.unit.test_pool import FP, A, B, C, FakeClient, chain_of, make_pool, turn


class MemoryStore:
    """Objects in a dict, ETags a counter; `down` makes every call fail, `before_put` runs before a manifest write
    (another host's write landing first)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.etags: dict[str, str] = {}
        self.down = False
        self.before_put: Any = None
        self.calls: list[str] = []
        self._n = 0

    def _check(self, call: str) -> None:
        self.calls.append(call)
        if self.down:
            raise ConnectionError("the object store is down")

    def _put(self, key: str, data: bytes) -> None:
        self._n += 1
        self.objects[key] = data
        self.etags[key] = f'"{self._n}"'

    def get_json(self, key: str) -> tuple[dict[str, Any], str] | None:
        self._check("get_json")
        if key not in self.objects:
            return None
        return json.loads(self.objects[key]), self.etags[key]

    def put_json(self, key: str, data: dict[str, Any], etag: str | None) -> bool:
        self._check("put_json")
        if self.before_put is not None:
            hook, self.before_put = self.before_put, None
            hook()
        if (etag is None and key in self.objects) or (etag is not None and self.etags.get(key) != etag):
            return False
        self._put(key, json.dumps(data).encode())
        return True

    def exists(self, key: str) -> bool:
        self._check("exists")
        return key in self.objects

    def put_file(self, key: str, handle: BinaryIO, n_bytes: int) -> None:
        self._check("put_file")
        self._put(key, handle.read())

    def get_file(self, key: str, path: Path) -> int:
        self._check("get_file")
        path.write_bytes(self.objects[key])
        return len(self.objects[key])

    def delete(self, key: str) -> None:
        self._check("delete")
        self.objects.pop(key, None)

    def listing(self, prefix: str) -> list[tuple[str, int, float]]:
        self._check("listing")
        # Written "long ago", in the order written (the etag counts writes).
        return [(k, len(v), float(self.etags[k].strip('"'))) for k, v in sorted(self.objects.items())
                if k.startswith(prefix)]

    def blobs(self) -> list[str]:
        return sorted(k for k in self.objects if k.startswith("blobs/"))


def tier_of(pool: SlotPool, memory: MemoryStore) -> SharedTier:
    tier = SharedTier(memory, pool.snapshots, FP, "host-a", functools.partial(import_snapshot, pool))
    pool.snapshots.on_commit = tier.committed
    return tier


async def upload_all(tier: SharedTier) -> None:
    uploader = asyncio.create_task(tier.run())
    await asyncio.sleep(0)
    assert await tier.drain(10)
    uploader.cancel()
    await asyncio.gather(uploader, return_exceptions=True)


async def uploaded_by_a(slot_dir: Path, store: SnapshotStore, memory: MemoryStore) -> tuple[SlotPool, SharedTier]:
    """Host A, one turn of A saved and uploaded to `memory`."""
    pool_a = make_pool(FakeClient(slot_dir), store)
    tier_a = tier_of(pool_a, memory)
    await turn(pool_a, A)
    await flush(pool_a)
    await upload_all(tier_a)
    return pool_a, tier_a


def host_b(tmp_path: Path, memory: MemoryStore) -> tuple[SnapshotStore, SlotPool, SharedTier]:
    """A second host on the same object store, with a slot dir and index of its own (the caller closes its store)."""
    store_b = SnapshotStore(tmp_path / "b-slots", tmp_path / "b-index" / "index.db")
    pool_b = make_pool(FakeClient(tmp_path / "b-slots"), store_b)
    return store_b, pool_b, tier_of(pool_b, memory)


@pytest.fixture
def pool(slot_dir: Path, store: SnapshotStore) -> SlotPool:
    return make_pool(FakeClient(slot_dir), store)


async def test_a_commit_is_uploaded_and_a_new_version_replaces_the_old_file(pool: SlotPool) -> None:
    memory = MemoryStore()
    tier = tier_of(pool, memory)
    await turn(pool, A)
    await flush(pool)
    await upload_all(tier)
    [first] = memory.blobs()
    manifest = Manifest.from_json(json.loads(memory.objects[tier.manifest_key(A, SnapshotKind.SESSION)]))
    first_local = await pool.snapshots.get(A)
    assert first_local is not None and manifest.version == first_local.version
    assert manifest.origin == "host-a" and first == tier.blob_key(manifest.meta.checksum)
    await turn(pool, A, n_tokens=20)
    await flush(pool)
    await upload_all(tier)
    # The replaced version's file is not deleted with the manifest (another manifest may name it): a sweep marks
    # it, and a later sweep past the grace period removes it.
    assert first in memory.blobs() and len(memory.blobs()) == 2
    assert tier.collect_garbage() == 0 and f"gc/{first}" in memory.objects
    assert tier.collect_garbage() == 1
    [second] = memory.blobs()
    assert second != first and not [k for k in memory.objects if k.startswith("gc/")]
    again = Manifest.from_json(json.loads(memory.objects[tier.manifest_key(A, SnapshotKind.SESSION)]))
    local = await pool.snapshots.get(A)
    assert local is not None
    assert again.version == local.version and again.version > manifest.version
    assert again.meta.checksum == local.checksum != manifest.meta.checksum
    assert tier.uploads == 2


async def test_a_manifest_written_by_another_host_meanwhile_is_read_again_not_overwritten_blindly(
        pool: SlotPool) -> None:
    memory = MemoryStore()
    tier = tier_of(pool, memory)
    await turn(pool, A)
    await flush(pool)
    key = tier.manifest_key(A, SnapshotKind.SESSION)

    def other_host_writes() -> None:  # an older version lands between this host's read and its conditional write
        memory._put(key, json.dumps({**json.loads(memory.objects.get(key, b"{}") or b"{}"), "format":
                                     "slotkeeper-snapshot", "version": 1, "model": "m", "session": "A",
                                     "kind": "session", "fingerprint": FP, "tokens": 5, "bytes": 1,
                                     "checksum": "other", "chain": [], "state_version": [0, 7]}).encode())

    memory.before_put = other_host_writes
    await upload_all(tier)
    manifest = Manifest.from_json(json.loads(memory.objects[key]))
    local = await pool.snapshots.get(A)
    assert local is not None and manifest.version == local.version  # read again, and newer: written on top of it
    assert manifest.origin == "host-a"
    assert memory.calls.count("put_json") == 2


async def test_a_store_that_is_down_fails_no_turn_and_the_next_save_uploads(pool: SlotPool) -> None:
    memory = MemoryStore()
    tier = tier_of(pool, memory)
    memory.down = True
    await turn(pool, A)
    await flush(pool)
    await upload_all(tier)
    assert tier.failed_uploads == 1 and tier.uploads == 0
    assert await tier.bring(A, SnapshotKind.SESSION) is None  # a look-up that fails brings nothing, raises nothing
    memory.down = False
    await turn(pool, A, n_tokens=30)
    await flush(pool)
    await upload_all(tier)
    assert tier.uploads == 1 and len(memory.blobs()) == 1


async def test_a_local_copy_newer_than_the_store_is_kept(pool: SlotPool) -> None:
    """A commit not uploaded yet (or whose upload failed) is this host's newest: no look-up replaces it."""
    memory = MemoryStore()
    tier = tier_of(pool, memory)
    await turn(pool, A)
    await flush(pool)
    assert await tier.bring(A, SnapshotKind.SESSION) is None
    assert "get_file" not in memory.calls
    # An older version of it in the store (another host's, from before this host's save) is not brought in either.
    local = await pool.snapshots.get(A)
    assert local is not None
    await upload_all(tier)
    key = tier.manifest_key(A, SnapshotKind.SESSION)
    older = json.loads(memory.objects[key])
    older["state_version"] = [local.version.fence, local.version.stamp - 1]
    older["checksum"] = "an older one"
    memory._put(key, json.dumps(older).encode())
    assert await tier.bring(A, SnapshotKind.SESSION) is None
    assert "get_file" not in memory.calls


async def test_a_newer_version_this_host_already_extends_is_not_brought(slot_dir: Path, store: SnapshotStore,
                                                                        tmp_path: Path) -> None:
    """Redis away (seed 1323334352, embedded): replica A, holding the lease (token 1), saved a session's first turn;
    replica B ran its second turn without a lease (token 0) from the whole history, then its third turn brought A's
    first-turn version, newer by its token, over its own and restored 233 tokens of the 272 it had. A version whose
    messages and tokens this host's copy already holds is not brought; one with other messages is."""
    memory = MemoryStore()
    client_a = FakeClient(slot_dir)
    pool_a = make_pool(client_a, store)
    tier_a = tier_of(pool_a, memory)
    b_slots = tmp_path / "b-slots"
    store_b = SnapshotStore(b_slots, tmp_path / "b-index" / "index.db")
    try:
        client_b = FakeClient(b_slots)
        pool_b = make_pool(client_b, store_b)
        tier_b = tier_of(pool_b, memory)
        pool_a.snapshots.fence = lambda key: 1
        pool_b.snapshots.fence = lambda key: 0
        client_a.save_tokens, client_b.save_tokens = 14, 30
        lease = await pool_a.acquire(A, chain_of("u1"))
        lease.release(TurnEnd.COMPLETED, 14)
        await flush(pool_a)
        await upload_all(tier_a)
        lease = await pool_b.acquire(A, chain_of("u1", "a1", "u2"))
        lease.release(TurnEnd.COMPLETED, 30)
        await flush(pool_b)
        mine = await pool_b.snapshots.get(A)
        assert mine is not None and mine.version.fence == 0
        assert await tier_b.bring(A, SnapshotKind.SESSION) is None
        assert "get_file" not in memory.calls and await pool_b.snapshots.get(A) == mine
        # A's next save has messages B's copy lacks (or other ones): it is brought.
        client_a.save_tokens = 40
        lease = await pool_a.acquire(A, chain_of("u1", "a1", "u2", "a2", "u3"))
        lease.release(TurnEnd.COMPLETED, 40)
        await flush(pool_a)
        await upload_all(tier_a)
        brought = await tier_b.bring(A, SnapshotKind.SESSION)
        assert brought is not None and brought.n_tokens == 40 and brought.version.fence == 1
    finally:
        store_b.close()


async def test_a_damaged_download_is_fetched_again_then_removed(slot_dir: Path, store: SnapshotStore,
                                                                tmp_path: Path) -> None:
    """Host A uploads; host B's downloads of a damaged object are refused twice, then it is removed and its manifest
    withdrawn (a conditional write on the manifest read)."""
    memory = MemoryStore()
    pool_a, tier_a = await uploaded_by_a(slot_dir, store, memory)
    store_b, pool_b, tier_b = host_b(tmp_path, memory)
    try:
        [blob] = memory.blobs()
        good = memory.objects[blob]
        memory.objects[blob] = bytes(b ^ 0xFF for b in good)
        assert await tier_b.bring(A, SnapshotKind.SESSION) is None
        assert tier_b.refused_downloads == 2 and memory.calls.count("get_file") == 2
        manifest_key = tier_a.manifest_key(A, SnapshotKind.SESSION)
        assert memory.blobs() == [] and Manifest.from_json(json.loads(memory.objects[manifest_key])).withdrawn
        assert await pool_b.snapshots.get(A) is None  # nothing damaged reached B's index
        # The owner's next save uploads it again, and B then brings it in.
        await turn(pool_a, A, n_tokens=12)
        await flush(pool_a)
        await upload_all(tier_a)
        brought = await tier_b.bring(A, SnapshotKind.SESSION)
        on_a = await pool_a.snapshots.get(A)
        assert brought is not None and on_a is not None and tier_b.downloads == 1
        assert (brought.checksum, brought.n_tokens) == (on_a.checksum, on_a.n_tokens)
        assert await tier_b.bring(A, SnapshotKind.SESSION) is None  # the same version: nothing to do
    finally:
        store_b.close()


async def test_a_store_that_does_not_answer_holds_a_turn_back_once_then_is_skipped(
        pool: SlotPool, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from slotkeeper.fleet import shared

    monkeypatch.setattr(shared, "LOOKUP_TIMEOUT_SECONDS", 0.2)
    memory = MemoryStore()
    tier = tier_of(pool, memory)
    memory.get_json = lambda key: time.sleep(2)  # type: ignore[assignment,method-assign,return-value]
    started = time.monotonic()
    assert await tier.bring(A, SnapshotKind.SESSION) is None
    assert time.monotonic() - started < 1.5
    started = time.monotonic()
    assert await tier.bring(A, SnapshotKind.SESSION) is None  # paused: no second wait
    assert time.monotonic() - started < 0.05


async def test_a_store_back_after_an_outage_is_read_again_at_the_probes_first_answer_not_after_the_pause(
        slot_dir: Path, store: SnapshotStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault-run seed 920808289 (CI, embedded): the store stalled for 3 s, and 10 s after it answered again a session
    moved to the other replica, which was still skipping look-ups (30 s after its one that failed) and prefilled it.
    Now a probe beside the turns ends the pause at the store's first answer within the look-up timeout: one that
    fails or comes late keeps it."""
    import time

    from slotkeeper.fleet import shared

    monkeypatch.setattr(shared, "LOOKUP_TIMEOUT_SECONDS", 0.2)
    monkeypatch.setattr(shared, "PROBE_SECONDS", 0.05)
    memory = MemoryStore()
    await uploaded_by_a(slot_dir, store, memory)
    store_b, _, tier_b = host_b(tmp_path, memory)
    try:
        uploader = asyncio.create_task(tier_b.run())  # owns the probe: cancelling it stops the probe
        answer, slow = memory.get_json, [True]

        def late_then_on_time(key: str) -> tuple[dict[str, Any], str] | None:
            if slow[0]:  # the first read after the outage is answered, but later than a turn would wait
                slow[0] = False
                time.sleep(0.4)
            return answer(key)

        memory.down = True
        assert await tier_b.bring(A, SnapshotKind.SESSION) is None  # fails: the pause begins
        await asyncio.sleep(0.3)  # the probe's reads fail meanwhile
        probes = memory.calls.count("get_json")
        assert probes >= 3
        assert await tier_b.bring(A, SnapshotKind.SESSION) is None  # still paused: not read, nothing waited for
        assert memory.calls.count("get_json") - probes <= 1  # at most a probe's read, none of the turn's
        memory.get_json = late_then_on_time  # type: ignore[method-assign]
        memory.down = False
        await asyncio.sleep(0.6)  # the late answer does not end the pause; the next one, on time, does
        assert not slow[0]
        brought = await tier_b.bring(A, SnapshotKind.SESSION)
        assert brought is not None and tier_b.downloads == 1  # well within the 30 s pause
        uploader.cancel()
        await asyncio.gather(uploader, return_exceptions=True)
    finally:
        store_b.close()


async def test_the_budget_removes_the_least_recently_saved_and_files_no_manifest_names(slot_dir: Path,
                                                                                       store: SnapshotStore) -> None:
    memory = MemoryStore()
    pool = make_pool(FakeClient(slot_dir), store, n_slots=3)
    tier = tier_of(pool, memory)
    for k in (A, B, C):
        await turn(pool, k)
    await flush(pool)
    await upload_all(tier)
    assert len(memory.blobs()) == 3
    memory._put("blobs/stray", b"x" * 100)  # a file whose manifest was never written
    one = len(memory.objects[memory.blobs()[0]])
    # The three commits may land (and be uploaded) in any order: the first manifest written is the one to go.
    first = min((k for k in memory.objects if k.startswith("manifests/")), key=lambda k: int(memory.etags[k][1:-1]))
    oldest = Manifest.from_json(json.loads(memory.objects[first])).meta.session_id
    tier.budget = 2 * one
    assert tier.collect_garbage() == 0  # the oldest manifest goes; its file and the stray are marked
    left = [Manifest.from_json(json.loads(v)).meta.session_id for k, v in memory.objects.items()
            if k.startswith("manifests/")]
    assert oldest not in left and len(left) == 2
    assert len(memory.blobs()) == 4 and "gc/blobs/stray" in memory.objects
    assert tier.collect_garbage() == 2  # a grace period later, both go
    assert "blobs/stray" not in memory.objects and len(memory.blobs()) == 2


async def test_a_save_made_under_an_older_lease_is_refused(slot_dir: Path, store: SnapshotStore,
                                                           tmp_path: Path) -> None:
    """Replica B took the session's lease (token 2) from A (token 1), which stalled: A's late save does not replace
    B's manifest, and its file is removed; a save under B's token, or a newer one, replaces it."""
    memory = MemoryStore()
    pool_a = make_pool(FakeClient(slot_dir), store)
    tier_a = tier_of(pool_a, memory)
    b_slots = tmp_path / "b-slots"
    store_b = SnapshotStore(b_slots, tmp_path / "b-index" / "index.db")
    try:
        pool_b = make_pool(FakeClient(b_slots), store_b)
        tier_b = tier_of(pool_b, memory)
        pool_a.snapshots.fence = lambda key: 1
        pool_b.snapshots.fence = lambda key: 2
        await turn(pool_b, A, n_tokens=14)
        await flush(pool_b)
        await upload_all(tier_b)
        key = tier_b.manifest_key(A, SnapshotKind.SESSION)
        written = Manifest.from_json(json.loads(memory.objects[key]))
        assert written.version.fence == 2
        await turn(pool_a, A, n_tokens=30)  # the stale holder's late save
        await flush(pool_a)
        await upload_all(tier_a)
        assert tier_a.refused_older == 1 and tier_a.uploads == 0
        assert Manifest.from_json(json.loads(memory.objects[key])) == written
        tier_a.collect_garbage()
        tier_a.collect_garbage()
        assert memory.blobs() == [tier_b.blob_key(written.meta.checksum)]  # A's file went with the sweeps
        pool_a.snapshots.fence = lambda key: 3  # A holds the lease again, under a newer token
        await turn(pool_a, A, n_tokens=40)
        await flush(pool_a)
        await upload_all(tier_a)
        assert tier_a.uploads == 1
        assert Manifest.from_json(json.loads(memory.objects[key])).version.fence == 3
    finally:
        store_b.close()


async def test_an_upload_that_reuses_an_object_marked_for_removal_puts_it_again_under_a_fresh_name(
        pool: SlotPool) -> None:
    """Likely at 99614b5 and so: a sweep deleted what no manifest named at that moment, and an upload that had found
    the object stored and was about to name it lost it. Now the upload's last look before its manifest sees the
    mark, and names a fresh copy that no mark covers."""
    memory = MemoryStore()
    tier = tier_of(pool, memory)
    await turn(pool, A)
    await flush(pool)
    await upload_all(tier)
    [stored] = memory.blobs()
    del memory.objects[tier.manifest_key(A, SnapshotKind.SESSION)]  # its manifest went (a budget, another host)
    tier.collect_garbage()
    assert f"gc/{stored}" in memory.objects
    tier.committed(A, SnapshotKind.SESSION)  # the same state uploaded again: its file is in the store, marked
    await upload_all(tier)
    manifest = Manifest.from_json(json.loads(memory.objects[tier.manifest_key(A, SnapshotKind.SESSION)]))
    assert manifest.object and manifest.object_key != stored and manifest.object_key in memory.objects
    assert manifest.object.startswith(manifest.meta.checksum + ".")
    tier.collect_garbage()  # the marked object goes; the one the manifest names stays
    assert stored not in memory.objects and manifest.object_key in memory.objects
    assert tier.collect_garbage() == 0 and manifest.object_key in memory.objects


async def test_a_sweep_between_an_uploads_look_up_and_its_manifest_cannot_remove_what_it_names(
        pool: SlotPool) -> None:
    """The upload found its file stored (unmarked) and skipped putting it; two sweeps then run before its manifest
    write (its last look comes after them): the object it names is there when the manifest lands."""
    memory = MemoryStore()
    tier = tier_of(pool, memory)
    await turn(pool, A)
    await flush(pool)
    await upload_all(tier)
    [stored] = memory.blobs()
    del memory.objects[tier.manifest_key(A, SnapshotKind.SESSION)]
    real_exists = memory.exists
    looked = []

    def exists_then_sweep(key: str) -> bool:
        found = real_exists(key)
        if key == stored and not looked:
            looked.append(key)
            tier.collect_garbage()  # marks it
            tier.collect_garbage()  # and removes it, the grace period having passed
        return found

    memory.exists = exists_then_sweep  # type: ignore[method-assign]
    tier.committed(A, SnapshotKind.SESSION)
    await upload_all(tier)
    manifest = Manifest.from_json(json.loads(memory.objects[tier.manifest_key(A, SnapshotKind.SESSION)]))
    assert looked and stored not in memory.objects
    assert manifest.object_key in memory.objects  # put again under a fresh name
