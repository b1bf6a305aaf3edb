"""A save that hands its slot on commits in the background: the next turn does not wait for it, whoever reads the
snapshot does, a failure keeps the previous snapshot, two saves of one session land in order, and shutdown waits."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.cache import store as store_mod
from slotkeeper.cache.operations import flush
from slotkeeper.cache.slots import TurnEnd
from slotkeeper.cache.store import SnapshotStore, file_checksum
from slotkeeper.config import Settings
from slotkeeper.errors import UpstreamError
from slotkeeper.types import CacheOutcome, SessionKey, SnapshotKind
from slotkeeper.upstream.client import SlotActionResult
from slotkeeper.upstream.launcher import StartedBackend
from slotkeeper.web.runtime import RunningBackend
from slotkeeper.web.state import AppState
from tests.unit.test_pool import FP, A, B, C, FakeClient, make_pool, turn


class Gate:
    """Holds every SnapshotStore.commit (in its worker thread) until opened; counts the commits that started."""

    def __init__(self, store: SnapshotStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.started = 0
        real = store.commit

        def held(*args: Any, **kwargs: Any) -> Any:
            self.started += 1
            assert self.opened.wait(10), "the test never opened the gate"
            return real(*args, **kwargs)

        monkeypatch.setattr(store, "commit", held)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def client(slot_dir: Path) -> FakeClient:
    return FakeClient(slot_dir)


@pytest.fixture
def gate(store: SnapshotStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(store, monkeypatch)
    try:
        yield g
    finally:
        g.open()  # never leave a worker thread waiting


async def until(predicate: Any, timeout: float = 2.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_the_next_turn_does_not_wait_for_the_commit(client: FakeClient, store: SnapshotStore,
                                                          gate: Gate) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)
    lease = await asyncio.wait_for(pool.acquire(B), 1)  # A's commit is held: B got the slot anyway
    assert lease.cache.outcome is CacheOutcome.COLD and pool.slots[0].occupant == B
    await until(lambda: gate.started == 1)
    assert store.get(A) is None and pool.snapshots.saves == 0
    assert not await pool.snapshots.settle(timeout=0.05)
    lease.release(TurnEnd.COMPLETED, 10)
    gate.open()
    assert await pool.snapshots.settle()
    snap = store.get(A)
    assert snap is not None and pool.snapshots.saves == 1 and pool.snapshots.failed_saves == 0
    assert store.checked_snapshot(A, FP) == snap


async def test_a_restore_waits_for_the_pending_commit_of_its_session(client: FakeClient, store: SnapshotStore,
                                                                     gate: Gate) -> None:
    pool = make_pool(client, store)
    gate.open()
    await turn(pool, A)
    await turn(pool, B)  # A's first snapshot
    await pool.snapshots.settle()
    old = store.get(A)
    assert old is not None
    await turn(pool, A)  # restored, then a newer state of A in the slot
    await pool.snapshots.settle()  # B's save
    gate.opened.clear()
    await turn(pool, B)  # saves that newer state: its commit is held
    await until(lambda: gate.started == 3)  # A, B, A
    back = asyncio.create_task(pool.acquire(A))
    await asyncio.sleep(0.1)
    assert not back.done()  # waiting for A's commit, not restoring the old file
    still = store.get(A)
    assert still is not None and still.filename == old.filename
    gate.open()
    lease = await asyncio.wait_for(back, 2)
    new = store.get(A)
    assert new is not None and new.filename != old.filename
    assert lease.cache.outcome is CacheOutcome.RESTORED
    assert client.actions("restore")[-1][2] == new.filename
    assert not (store.slot_dir / old.filename).exists()
    lease.release(TurnEnd.COMPLETED, 10)


class TempVanishes(FakeClient):
    """A save the backend reports as written, whose file is gone by the time it is committed."""

    vanish = False

    async def slot_action(self, slot_id: int, action: str, filename: str | None = None) -> SlotActionResult:
        result = await super().slot_action(slot_id, action, filename)
        if action == "save" and self.vanish:
            assert filename is not None
            (self.slot_dir / filename).unlink()
        return result


@pytest.mark.parametrize("failure", ["disk-full", "temp-removed"])
async def test_a_commit_failing_in_the_background_keeps_the_previous_snapshot(
        store: SnapshotStore, slot_dir: Path, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    client = TempVanishes(slot_dir)
    pool = make_pool(client, store)
    await turn(pool, A)
    await turn(pool, B)
    await pool.snapshots.settle()
    good = store.get(A)
    assert good is not None
    await turn(pool, A)  # restores the good snapshot; the slot then holds a newer state
    await pool.snapshots.settle()
    if failure == "disk-full":
        def full(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(store_mod.os, "fsync", full)
    else:
        client.vanish = True
    lease = await pool.acquire(B)  # saving A's newer state fails in its commit: B's turn goes ahead
    assert lease.cache.outcome is CacheOutcome.RESTORED and lease.cache.save_ms > 0
    lease.release(TurnEnd.COMPLETED, 10)
    await pool.snapshots.settle()
    monkeypatch.undo()
    client.vanish = False
    assert pool.snapshots.failed_saves == 1
    kept = store.get(A)
    assert kept is not None and (kept.filename, kept.checksum, kept.n_tokens) == (good.filename, good.checksum,
                                                                                   good.n_tokens)
    assert store.checked_snapshot(A, FP) is not None
    assert file_checksum(slot_dir / good.filename) == good.checksum
    assert [n for n in os.listdir(slot_dir) if ".tmp-" in n] == []
    # The previous state is what A's next turn gets.
    again = await pool.acquire(A)
    assert again.cache.outcome is CacheOutcome.RESTORED
    assert client.actions("restore")[-1][2] == good.filename
    again.release(TurnEnd.COMPLETED, 10)


async def test_two_saves_of_one_session_land_in_order(client: FakeClient, store: SnapshotStore, gate: Gate) -> None:
    """An idle save's commit is held; the session's next turn ends in another idle save: the second commit waits
    for the first, and the newer state is the one kept."""
    pool = make_pool(client, store, save_idle_seconds=0.02)
    try:
        await turn(pool, A)
        await until(lambda: gate.started == 1)
        assert not pool.slots[0].busy  # the slot is free while its save is committed
        lease = await pool.acquire(A)
        assert lease.cache.outcome is CacheOutcome.HOT
        lease.release(TurnEnd.COMPLETED, 20)
        await until(lambda: len(client.actions("save")) == 2)
        await asyncio.sleep(0.05)
        assert gate.started == 1  # the second commit has not started: it waits for the first
        newest = client.actions("save")[1][2]
        assert newest is not None
        newest_sum = file_checksum(store.slot_dir / newest)
        gate.open()
        await pool.snapshots.settle()
        snap = store.get(A)
        assert snap is not None and snap.checksum == newest_sum and pool.snapshots.saves == 2
        assert [n for n in os.listdir(store.slot_dir) if n.endswith(".bin")] == [snap.filename]
    finally:
        await pool.aclose()


async def test_flush_and_close_wait_for_pending_commits(client: FakeClient, store: SnapshotStore,
                                                        gate: Gate) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)
    await turn(pool, B)  # A's commit is held
    flushing = asyncio.create_task(flush(pool))
    await until(lambda: gate.started == 2)  # A's, then B's (the flush saves B)
    await asyncio.sleep(0.05)
    assert not flushing.done()
    gate.open()
    assert await asyncio.wait_for(flushing, 2) == (1, 0)
    assert store.get(A) is not None and store.get(B) is not None and pool.snapshots.saves == 2

    await turn(pool, A)  # restores A (B was saved by the flush)
    await pool.snapshots.settle()
    gate.opened.clear()
    await turn(pool, B)  # A's save is held
    closing = asyncio.create_task(pool.aclose())
    await asyncio.sleep(0.05)
    assert not closing.done()
    gate.open()
    await asyncio.wait_for(closing, 2)
    assert pool.snapshots.saves == 3


async def test_pin_and_settle_wait_for_the_sessions_commit(client: FakeClient, store: SnapshotStore,
                                                           gate: Gate) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)
    await turn(pool, B)
    assert not await pool.snapshots.settle(A, timeout=0.05)
    assert await pool.snapshots.settle(B, timeout=0.05)  # nothing of B is pending
    waiting = asyncio.create_task(pool.snapshots.settle(A))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    gate.open()
    assert await asyncio.wait_for(waiting, 2)
    snap = store.get(A)
    assert snap is not None
    pinned = await pool.snapshots.set_pinned(SessionKey(snap.model, snap.session_id), True, snap.kind)
    assert pinned is not None and pinned.pinned and pinned.kind is SnapshotKind.SESSION


async def test_a_cancelled_reader_does_not_cancel_the_commit(client: FakeClient, store: SnapshotStore,
                                                             gate: Gate) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)
    await turn(pool, B)
    back = asyncio.create_task(pool.acquire(A))  # saves B, then waits for A's commit
    await asyncio.sleep(0.05)
    assert not back.done()
    back.cancel()
    with pytest.raises(asyncio.CancelledError):
        await back
    assert not pool.slots[0].busy
    gate.open()
    assert await pool.snapshots.settle()
    assert store.get(A) is not None and store.get(B) is not None and pool.snapshots.saves == 2


async def test_a_session_back_while_the_backend_still_writes_its_save_restores_that_save(
        client: FakeClient, store: SnapshotStore) -> None:
    """A's slot goes to B, and the backend is still writing A's state when A comes back on the other slot: A's
    turn waits for that save and restores it, never the older snapshot the save replaces."""
    pool = make_pool(client, store, n_slots=2)
    try:
        await turn(pool, A)
        await flush(pool)  # A's older snapshot
        older = store.get(A)
        assert older is not None
        await turn(pool, A)  # A changes again, in slot 0
        await turn(pool, C)  # slot 1
        real = client.slot_action

        async def slow_on_slot_0(slot_id: int, action: str, filename: str | None = None) -> SlotActionResult:
            result = await real(slot_id, action, filename)
            if slot_id == 0 and action == "save":
                await asyncio.sleep(0.3)  # the backend has not answered yet
            return result

        client.slot_action = slow_on_slot_0  # type: ignore[method-assign]
        b_lease = asyncio.create_task(pool.acquire(B))  # the least recently used slot: A's; A is saved first
        await until(lambda: len(client.actions("save")) == 2)  # the flush's, and A's now being written
        a_lease = await pool.acquire(A)  # slot 1 (C's, saved first), while the backend writes A's state
        newer = store.get(A)
        assert newer is not None and newer.filename != older.filename
        assert a_lease.cache.outcome is CacheOutcome.RESTORED
        assert client.actions("restore")[-1][2] == newer.filename
        a_lease.release(TurnEnd.COMPLETED, 10)
        (await b_lease).release(TurnEnd.COMPLETED, 10)
    finally:
        await pool.aclose()


async def test_a_save_the_backend_refuses_keeps_the_order_of_the_sessions_commits(
        client: FakeClient, store: SnapshotStore, gate: Gate) -> None:
    """An idle save's commit is held; the session's next save is refused by the backend. That failed save must not
    end the session's pending writes while the first commit still runs: readers keep waiting for it, and a third
    save commits after it, so the newest state is the one kept."""
    pool = make_pool(client, store, save_idle_seconds=0.02)
    try:
        await turn(pool, A)
        await until(lambda: gate.started == 1)  # the first save's commit is held
        client.save_error = UpstreamError(500, b'{"error":{"message":"the backend refused"}}')
        await turn(pool, A, n_tokens=20)
        await until(lambda: pool.snapshots.failed_saves == 1)  # the second save, refused by the backend
        # The first commit is still running: readers wait for it.
        assert not await pool.snapshots.settle(A, timeout=0.05)
        client.save_error = None
        await turn(pool, A, n_tokens=30)
        await until(lambda: len(client.actions("save")) == 3)
        await asyncio.sleep(0.05)
        assert gate.started == 1  # the third commit waits for the first
        newest = client.actions("save")[2][2]
        assert newest is not None
        newest_sum = file_checksum(store.slot_dir / newest)
        gate.open()
        assert await pool.snapshots.settle()
        snap = store.get(A)
        assert snap is not None and snap.checksum == newest_sum
        assert pool.snapshots.saves == 2 and pool.snapshots.failed_saves == 1
    finally:
        await pool.aclose()


class ClosingClient(FakeClient):
    async def aclose(self) -> None:
        pass


def running_backend(pool: Any, client: FakeClient, store: SnapshotStore, shutdown_timeout: float) -> RunningBackend:
    state = AppState(Settings(shutdown_timeout=shutdown_timeout), None, client, pool, None, 0.0)  # type: ignore[arg-type]
    return RunningBackend(state, pool.snapshots, StartedBackend("http://127.0.0.1:1"), [])


async def test_shutdown_keeps_its_bound_while_a_commit_hangs(slot_dir: Path, store: SnapshotStore, gate: Gate,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A commit that does not finish (a slow disk) does not hold the shutdown past its share of shutdown_timeout."""
    client = ClosingClient(slot_dir)
    pool = make_pool(client, store)
    await turn(pool, A)
    backend = running_backend(pool, client, store, shutdown_timeout=1.0)  # half of it, 0.5 s, for the saves
    started = asyncio.get_running_loop().time()
    with caplog.at_level(logging.INFO, logger="slotkeeper"):
        await asyncio.wait_for(backend.stop(), 3)
    assert asyncio.get_running_loop().time() - started < 1.0
    gate.open()  # the commit then fails on the closed index
    assert gate.started == 1
    assert "are cut short" in caplog.text


async def test_shutdown_counts_the_saves_that_succeeded(slot_dir: Path, store: SnapshotStore,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    client = ClosingClient(slot_dir)
    pool = make_pool(client, store, n_slots=2)
    await turn(pool, A)
    await turn(pool, B)
    client.save_tokens = 0  # the backend writes empty states: both commits fail
    backend = running_backend(pool, client, store, shutdown_timeout=30.0)
    with caplog.at_level(logging.INFO, logger="slotkeeper"):
        await asyncio.wait_for(backend.stop(), 10)
    assert pool.snapshots.failed_saves == 2
    assert "shutdown: saved 0 changed slot(s)" in caplog.text
    assert "shutdown: saving 2 changed slot(s) failed" in caplog.text
