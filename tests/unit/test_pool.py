"""SlotPool decisions against a fake backend client and a real SnapshotStore."""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slotkeeper.cache.capability import Strategy
from slotkeeper.cache.idlesaves import IDLE_SAVE_FLOOR_SECONDS
from slotkeeper.cache.operations import clear, clear_slot, flush
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.slots import TurnEnd
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import QUARANTINE_DIR, SnapshotStore
from slotkeeper.errors import NotFound, SlotkeeperError, UpstreamError, UpstreamUnavailable
from slotkeeper.types import CacheOutcome, IdSource, SessionKey, Snapshot, SnapshotKind
from slotkeeper.upstream.client import SlotActionResult

FP = "00112233aabbccdd"


def slot_file(tokens: list[int], payload: int = 256) -> bytes:
    """A file shaped like llama-server's slot files (format v4: the token list, then the state's bytes)."""
    words = [-1, 1, len(tokens), *tokens]
    return struct.pack(f"<III{len(words)}i", 0x67677371, 4, len(words), *words) + os.urandom(payload)


class FakeClient:
    """Records slot actions; a save writes bytes the way llama-server would (with the tokens `slot_tokens` says the
    slot holds, or none: random bytes), a restore answers from `restore_tokens`."""

    def __init__(self, slot_dir: Path) -> None:
        self.slot_dir = slot_dir
        self.calls: list[tuple[int, str, str | None]] = []
        self.slot_tokens: dict[int, list[int]] = {}
        self.restore_tokens: dict[str, int] = {}
        self.restore_error: Exception | None = None
        self.save_error: Exception | None = None
        self.save_tokens = 42
        self.save_delay = 0.0
        self.restore_default = 7

    async def slot_action(self, slot_id: int, action: str, filename: str | None = None) -> SlotActionResult:
        self.calls.append((slot_id, action, filename))
        if action == "save":
            if self.save_delay:
                await asyncio.sleep(self.save_delay)
            if self.save_error is not None:
                raise self.save_error
            assert filename is not None
            held = self.slot_tokens.get(slot_id)
            data = os.urandom(256) if held is None else slot_file(held)
            (self.slot_dir / filename).write_bytes(data)
            return SlotActionResult(self.save_tokens if held is None else len(held), len(data), 1.0)
        if action == "restore":
            if self.restore_error is not None:
                raise self.restore_error
            assert filename is not None
            return SlotActionResult(self.restore_tokens.get(filename, self.restore_default), 256, 1.0)
        return SlotActionResult(0, 0, 0.0)

    def actions(self, action: str) -> list[tuple[int, str, str | None]]:
        return [c for c in self.calls if c[1] == action]


@pytest.fixture
def client(store: SnapshotStore, slot_dir: Path) -> FakeClient:
    return FakeClient(slot_dir)


def make_pool(client: FakeClient, store: SnapshotStore, n_slots: int = 1, save_idle_seconds: float = -1,
              n_ctx_slot: int = 4096, min_restore_tokens: int = 0) -> SlotPool:
    return SlotPool(n_slots, client, Snapshots(store), FP, n_ctx_slot,  # type: ignore[arg-type]
                    save_idle_seconds=save_idle_seconds, min_restore_tokens=min_restore_tokens)


def key(session: str, model: str = "m") -> SessionKey:
    return SessionKey(model, session, IdSource.HEADER)


A, B, C, D = key("A"), key("B"), key("C"), key("D")


async def turn(pool: SlotPool, k: SessionKey, end: TurnEnd = TurnEnd.COMPLETED, n_tokens: int = 10):
    lease = await pool.acquire(k)
    lease.release(end, n_tokens)
    return lease


# -- outcomes ---------------------------------------------------------------------------------------------------


async def test_first_acquire_cold(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    lease = await pool.acquire(A)
    assert lease.cache.outcome is CacheOutcome.COLD
    assert lease.slot_id == 0
    assert client.calls == []
    lease.release(TurnEnd.COMPLETED, 10)
    slot = pool.slots[0]
    assert slot.occupant == A and slot.dirty and not slot.busy
    assert slot.n_tokens == 10


async def test_same_session_hot(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)
    lease = await pool.acquire(A)
    assert lease.cache.outcome is CacheOutcome.HOT
    assert client.calls == []
    lease.release(TurnEnd.COMPLETED, 20)
    assert pool.slots[0].dirty and pool.slots[0].n_tokens == 20


async def test_switch_saves_and_restores(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)

    lease_b = await pool.acquire(B)
    assert lease_b.cache.outcome is CacheOutcome.COLD
    assert [(c[0], c[1]) for c in client.calls] == [(0, "save")]
    await pool.snapshots.settle()  # A's save is committed in the background, after B got the slot
    snap_a = store.get(A)
    assert snap_a is not None and snap_a.n_tokens == 42 and snap_a.hits == 0
    assert client.calls[0][2] is not None and client.calls[0][2].startswith(A.file_stem(FP))
    assert pool.snapshots.saves == 1
    lease_b.release(TurnEnd.COMPLETED, 10)

    client.calls.clear()
    snap_a = store.get(A)
    assert snap_a is not None
    client.restore_tokens[snap_a.filename] = 33
    lease_a = await pool.acquire(A)
    assert [(c[0], c[1]) for c in client.calls] == [(0, "save"), (0, "restore")]
    assert client.calls[1][2] == snap_a.filename
    await pool.snapshots.settle()  # B's save is committed, and A's use recorded, in the background
    assert store.get(B) is not None
    assert lease_a.cache.outcome is CacheOutcome.RESTORED
    assert lease_a.cache.restored_tokens == 33
    assert pool.restorer.restores == 1
    after = store.get(A)
    assert after is not None and after.hits == 1
    assert pool.slots[0].occupant == A and pool.slots[0].n_tokens == 33
    lease_a.release(TurnEnd.COMPLETED, 40)


class SlowSaves(FakeClient):
    """A save that takes `save_delay`, and when each one ended."""

    def __init__(self, slot_dir: Path) -> None:
        super().__init__(slot_dir)
        self.saves_done = 0

    async def slot_action(self, slot_id: int, action: str, filename: str | None = None) -> SlotActionResult:
        result = await super().slot_action(slot_id, action, filename)
        if action == "save":
            self.saves_done += 1
        return result


async def test_the_backends_writes_stand_in_for_restores_in_the_cost_meter_until_one_is_measured(
        client: FakeClient, store: SnapshotStore) -> None:
    """A day's first side tasks come before its first restore: the pool's meter hears of every write the backend
    made, with its bytes and time, and the first restore replaces what they said."""
    pool = make_pool(client, store)
    client.save_delay = 0.02
    await turn(pool, A)
    await turn(pool, B)  # A saved on the switch: 256 bytes in 20 ms or more
    await pool.snapshots.settle()
    costs = pool.costs.now()
    assert costs.restore == () and costs.stand_in is not None
    assert costs.stand_in.ms(256) >= 20.0 and costs.bytes_per_token == 256 / client.save_tokens
    await turn(pool, A)  # restored
    assert client.actions("restore") and pool.costs.now().stand_in is None


async def test_a_switch_looks_up_while_the_backend_writes_and_restores_after(store: SnapshotStore,
                                                                             slot_dir: Path) -> None:
    client = SlowSaves(slot_dir)
    pool = make_pool(client, store)
    await turn(pool, A)
    await turn(pool, B)  # A saved on the switch
    await pool.snapshots.settle()
    looked_up_during_save: list[bool] = []
    find = pool.snapshots.candidates

    async def candidates(*args, **kwargs):  # type: ignore[no-untyped-def]
        looked_up_during_save.append(client.saves_done < 2)
        return await find(*args, **kwargs)

    pool.snapshots.candidates = candidates  # type: ignore[method-assign]
    client.save_delay = 0.2
    client.calls.clear()
    lease = await pool.acquire(A)  # B is saved, and A's state found meanwhile
    assert looked_up_during_save == [True]
    assert [c[1] for c in client.calls] == ["save", "restore"]  # the restore came once the save had ended
    assert lease.cache.outcome is CacheOutcome.RESTORED
    assert lease.cache.save_ms >= 200
    lease.release(TurnEnd.COMPLETED, 20)
    await pool.snapshots.settle()
    assert store.get(B) is not None


async def test_a_look_up_that_fails_during_the_save_frees_the_slot_only_once_the_write_ended(
        store: SnapshotStore, slot_dir: Path) -> None:
    client = SlowSaves(slot_dir)
    pool = make_pool(client, store)
    await turn(pool, A)

    async def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("index gone")

    pool.snapshots.candidates = broken  # type: ignore[method-assign]
    client.save_delay = 0.2
    with pytest.raises(RuntimeError):
        await pool.acquire(B)
    assert client.saves_done == 1 and not pool.slots[0].busy
    await pool.snapshots.settle()
    assert store.get(A) is not None  # A's turn, saved all the same


async def test_default_session_never_saved_or_restored(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    default = SessionKey("m", "default")
    assert default.is_default
    lease = await turn(pool, default)
    assert lease.cache.outcome is CacheOutcome.COLD
    assert not pool.slots[0].dirty
    await turn(pool, A)  # the default occupant is not saved
    assert client.actions("save") == []
    await turn(pool, default)  # A is saved, the default session is not restored
    assert len(client.actions("save")) == 1
    assert client.actions("restore") == []
    assert store.get(default) is None
    assert await flush(pool) == (0, 0)
    assert len(client.actions("save")) == 1


INVALID = b'{"error":{"code":400,"message":"Unable to restore slot, no available space in KV cache or invalid slot save file","type":"invalid_request_error"}}'  # noqa: E501


async def test_a_file_the_backend_refuses_twice_is_quarantined(client: FakeClient, store: SnapshotStore,
                                                                slot_dir: Path) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)
    await turn(pool, B)
    await pool.snapshots.settle()
    snap_a = store.get(A)
    assert snap_a is not None
    client.restore_error = UpstreamError(400, INVALID)
    lease = await pool.acquire(A)
    assert lease.cache.outcome is CacheOutcome.COLD
    assert lease.slot_id == 0
    assert len(client.actions("restore")) == 2  # once more into the slot the first attempt emptied
    assert store.get(A) is None
    assert not (slot_dir / snap_a.filename).exists()
    assert any(n.startswith(snap_a.filename) for n in os.listdir(slot_dir / QUARANTINE_DIR))
    assert pool.slots[0].occupant == A and pool.slots[0].busy
    lease.release(TurnEnd.COMPLETED, 5)
    assert not pool.slots[0].busy and pool.restorer.failed_restores == 1


async def test_a_file_refused_once_is_restored_on_the_second_attempt(client: FakeClient, store: SnapshotStore) -> None:
    """With several slots, "no available space in KV cache" comes with the same message: the first attempt empties
    the slot, the second then fits."""
    pool = make_pool(client, store)
    await turn(pool, A)
    await turn(pool, B)
    await pool.snapshots.settle()
    real = client.slot_action
    refused = [UpstreamError(400, INVALID)]

    async def once(slot_id: int, action: str, filename: str | None = None) -> SlotActionResult:
        if action == "restore" and refused:
            client.calls.append((slot_id, action, filename))
            raise refused.pop()
        return await real(slot_id, action, filename)

    client.slot_action = once  # type: ignore[method-assign]
    lease = await pool.acquire(A)
    assert lease.cache.outcome is CacheOutcome.RESTORED and store.get(A) is not None
    lease.release(TurnEnd.COMPLETED, 5)
    assert pool.restorer.failed_restores == 0


@pytest.mark.parametrize("error", [
    UpstreamError(503, b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'),
    UpstreamError(500, b'{"error":{"code":500,"message":"boom"}}'),
    UpstreamError(400, b'{"error":{"code":400,"message":"slot is busy"}}'),
], ids=["loading", "server-error", "other-400"])
async def test_a_backend_error_on_restore_keeps_the_snapshot(client: FakeClient, store: SnapshotStore,
                                                              slot_dir: Path, error: UpstreamError) -> None:
    """Nothing proves the file bad: the turn runs cold, the failure is counted, the snapshot stays for later."""
    pool = make_pool(client, store)
    await turn(pool, A)
    await turn(pool, B)
    await pool.snapshots.settle()
    snap_a = store.get(A)
    client.restore_error = error
    lease = await pool.acquire(A)
    assert lease.cache.outcome is CacheOutcome.COLD and len(client.actions("restore")) == 1
    lease.release(TurnEnd.COMPLETED, 5)
    assert store.get(A) == snap_a and (slot_dir / snap_a.filename).exists()  # type: ignore[union-attr]
    assert not (slot_dir / QUARANTINE_DIR).exists() and pool.restorer.failed_restores == 1
    client.restore_error = None
    await turn(pool, B)
    lease = await pool.acquire(A)
    assert lease.cache.outcome is CacheOutcome.RESTORED  # restored once the backend is well again
    lease.release(TurnEnd.COMPLETED, 5)


async def test_snapshot_larger_than_slot_not_restored(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, n_ctx_slot=40)  # the fake saves 42 tokens
    await turn(pool, A)
    await turn(pool, B)
    await pool.snapshots.settle()
    assert store.get(A) is not None
    lease = await pool.acquire(A)
    assert lease.cache.outcome is CacheOutcome.COLD
    assert client.actions("restore") == []
    lease.release(TurnEnd.COMPLETED)


# -- turn ends --------------------------------------------------------------------------------------------------


async def test_release_failed_empties_slot(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    await turn(pool, A, TurnEnd.FAILED)
    slot = pool.slots[0]
    assert slot.occupant is None and not slot.dirty and slot.n_tokens == 0
    await turn(pool, B)
    assert client.actions("save") == []
    assert await flush(pool) == (1, 0)  # only B
    assert store.get(A) is None and store.get(B) is not None


async def test_release_cancelled_keeps_occupant_dirty(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    await turn(pool, A, TurnEnd.CANCELLED, 3)
    slot = pool.slots[0]
    assert slot.occupant == A and slot.dirty and slot.n_tokens == 3


async def test_release_rejected_keeps_dirty_flag(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    await turn(pool, A, TurnEnd.REJECTED)
    assert pool.slots[0].occupant == A and not pool.slots[0].dirty
    await turn(pool, A, TurnEnd.COMPLETED, 10)
    assert pool.slots[0].dirty
    await turn(pool, A, TurnEnd.REJECTED, 99)
    assert pool.slots[0].occupant == A and pool.slots[0].dirty
    assert pool.slots[0].n_tokens == 10


# -- waiting ----------------------------------------------------------------------------------------------------


async def test_second_session_waits_for_release(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    order: list[str] = []
    lease_a = await pool.acquire(A)
    order.append("A acquired")
    go = asyncio.Event()

    async def second() -> None:
        lease = await pool.acquire(B)
        order.append("B acquired")
        lease.release(TurnEnd.COMPLETED)

    async def first_turn() -> None:
        await go.wait()
        order.append("A released")
        lease_a.release(TurnEnd.COMPLETED)

    t2 = asyncio.create_task(second())
    await asyncio.sleep(0.05)
    assert not t2.done()
    t1 = asyncio.create_task(first_turn())
    await asyncio.sleep(0.05)
    assert not t2.done()
    go.set()
    await asyncio.wait_for(asyncio.gather(t1, t2), 2)
    assert order == ["A acquired", "A released", "B acquired"]


async def test_waiters_served_in_arrival_order(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    served: list[str] = []
    first = await pool.acquire(A)

    async def waiter(k: SessionKey) -> None:
        lease = await pool.acquire(k)
        served.append(k.session_id)
        await asyncio.sleep(0.01)
        lease.release(TurnEnd.COMPLETED)

    tasks = []
    for k in (B, C, D):
        tasks.append(asyncio.create_task(waiter(k)))
        await asyncio.sleep(0.01)
    assert served == []
    first.release(TurnEnd.COMPLETED)
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert served == ["B", "C", "D"]


async def test_two_slots_used_concurrently(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, n_slots=2)
    lease_a = await asyncio.wait_for(pool.acquire(A), 1)
    lease_b = await asyncio.wait_for(pool.acquire(B), 1)
    assert {lease_a.slot_id, lease_b.slot_id} == {0, 1}
    lease_b.release(TurnEnd.COMPLETED)
    lease_a.release(TurnEnd.COMPLETED)


async def test_busy_session_waits_for_its_own_slot(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, n_slots=2)
    lease_a = await pool.acquire(A)
    assert lease_a.slot_id == 0
    second = asyncio.create_task(pool.acquire(A))
    await asyncio.sleep(0.05)
    assert not second.done()  # slot 1 is free but A's state is in slot 0
    assert not pool.slots[1].busy
    lease_a.release(TurnEnd.COMPLETED)
    lease = await asyncio.wait_for(second, 1)
    assert lease.slot_id == 0
    assert lease.cache.outcome is CacheOutcome.HOT
    lease.release(TurnEnd.COMPLETED)
    assert pool.slots[1].occupant is None


async def test_cancelled_waiter_does_not_leak(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    lease_a = await pool.acquire(A)
    waiting = asyncio.create_task(pool.acquire(B))
    await asyncio.sleep(0.02)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.slots[0].occupant == A and pool.slots[0].busy
    lease_a.release(TurnEnd.COMPLETED)
    assert not pool.slots[0].busy
    assert len(pool._waiters) == 0
    lease_c = await asyncio.wait_for(pool.acquire(C), 1)
    assert lease_c.slot_id == 0
    lease_c.release(TurnEnd.COMPLETED)
    lease_a2 = await asyncio.wait_for(pool.acquire(A), 1)
    lease_a2.release(TurnEnd.COMPLETED)


# -- idle saves -------------------------------------------------------------------------------------------------


async def test_idle_save(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, save_idle_seconds=0.05)
    try:
        await turn(pool, A)
        for _ in range(100):  # the slot is given back just after the snapshot is indexed
            if store.get(A) is not None and not pool.slots[0].busy:
                break
            await asyncio.sleep(0.01)
        assert store.get(A) is not None
        assert len(client.actions("save")) == 1
        assert not pool.slots[0].dirty and not pool.slots[0].busy
        assert pool.slots[0].occupant == A
        # the next turn is hot and needs no save first
        lease = await pool.acquire(A)
        assert lease.cache.outcome is CacheOutcome.HOT
        lease.release(TurnEnd.REJECTED)
    finally:
        await pool.aclose()


async def test_idle_save_cancelled_by_new_lease(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, save_idle_seconds=0.05)
    try:
        await turn(pool, A)
        lease = await pool.acquire(A)  # before the timer fires
        await asyncio.sleep(0.2)
        assert client.actions("save") == []
        lease.release(TurnEnd.REJECTED)  # the slot is dirty again: a new timer runs
        await asyncio.sleep(0.3)
        assert len(client.actions("save")) == 1
    finally:
        await pool.aclose()


async def test_idle_save_generation_check_after_release(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, save_idle_seconds=0.1)
    try:
        await turn(pool, A)
        await asyncio.sleep(0.03)
        await turn(pool, A, TurnEnd.COMPLETED)  # a second timer; the first one's generation is stale
        await asyncio.sleep(0.4)
        assert len(client.actions("save")) == 1
    finally:
        await pool.aclose()


async def wait_saved(store: SnapshotStore, k: SessionKey, seconds: float) -> float | None:
    """Seconds until `k`'s snapshot is indexed, or None if it was not within `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if store.get(k) is not None:
            return time.monotonic() - started
        await asyncio.sleep(0.01)
    return None


async def test_a_state_that_saves_quickly_is_saved_soon_after_its_turn(client: FakeClient,
                                                                      store: SnapshotStore) -> None:
    """--save-idle-seconds is the longest an idle changed slot waits: once a save showed how fast the backend
    writes, a quick state is saved after twice its expected save time, at least IDLE_SAVE_FLOOR_SECONDS, so the next
    conversation finds it on disk and waits for no save."""
    pool = make_pool(client, store, save_idle_seconds=30)
    try:
        await turn(pool, A)
        assert pool.saver.expected_seconds(10) is None  # no save yet: the full idle time
        assert pool.idle_saves.delay(pool.slots[0]) == 30
        await turn(pool, B)  # the switch saves A, and the backend's write rate is known from then on
        assert len(client.actions("save")) == 1
        expected = pool.saver.expected_seconds(10)
        assert expected is not None and expected < IDLE_SAVE_FLOOR_SECONDS / 2
        assert pool.idle_saves.delay(pool.slots[0]) == IDLE_SAVE_FLOOR_SECONDS
        waited = await wait_saved(store, B, 10)
        assert waited is not None and waited >= IDLE_SAVE_FLOOR_SECONDS * 0.9
        assert not pool.slots[0].dirty
        lease = await pool.acquire(C)  # the next conversation's switch saves nothing
        assert len(client.actions("save")) == 2 and lease.cache.save_ms == 0
        lease.release(TurnEnd.REJECTED)
    finally:
        await pool.aclose()


async def test_a_slow_save_waits_longer_and_never_past_the_idle_seconds(client: FakeClient,
                                                                       store: SnapshotStore) -> None:
    pool = make_pool(client, store, save_idle_seconds=30)
    try:
        client.save_delay, client.save_tokens = 0.2, 100
        await turn(pool, A, n_tokens=100)
        await turn(pool, B, n_tokens=100)  # the backend's write of 100 tokens took 0.2 s
        assert pool.idle_saves.delay(pool.slots[0]) == pytest.approx(0.4, abs=0.1)
        pool.slots[0].n_tokens = 100_000  # 200 s expected: the idle seconds are the limit
        assert pool.idle_saves.delay(pool.slots[0]) == 30
    finally:
        await pool.aclose()


async def test_a_conversation_that_side_tasks_follow_is_saved_at_once(client: FakeClient,
                                                                      store: SnapshotStore) -> None:
    """OpenWebUI sends its follow-up and tag tasks right after every answer: once a side task took a chat's slot
    right after its turn, the chat's next turn is saved as soon as it ends, not after the idle time, so the next task
    finds the slot saved. A chat whose own turn came next again goes back to the idle time."""
    pool = make_pool(client, store, save_idle_seconds=30)
    try:
        await turn(pool, A)
        task = await pool.acquire(A, side=True)  # saves A on its path: side tasks follow A
        assert task.cache.save_ms > 0 and len(client.actions("save")) == 1
        task.release(TurnEnd.COMPLETED)
        await pool.snapshots.settle()
        await turn(pool, A)  # restored, and saved at once when it ends
        assert pool.idle_saves.delay(pool.slots[0]) == 0
        waited = await wait_saved_again(client, 2, 5)
        assert waited is not None and waited < IDLE_SAVE_FLOOR_SECONDS
        task = await pool.acquire(A, side=True)
        assert task.cache.save_ms == 0 and len(client.actions("save")) == 2  # nothing left to save on its path
        task.release(TurnEnd.COMPLETED)
        await turn(pool, A)
        await turn(pool, A)  # its own turn came next this time: back to the idle time
        assert pool.idle_saves.delay(pool.slots[0]) == IDLE_SAVE_FLOOR_SECONDS
    finally:
        await pool.aclose()


async def wait_saved_again(client: FakeClient, saves: int, seconds: float) -> float | None:
    """Seconds until the backend was asked for its `saves`-th save, or None if it was not within `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if len(client.actions("save")) >= saves:
            return time.monotonic() - started
        await asyncio.sleep(0.005)
    return None


async def test_no_early_save_while_another_slot_generates(client: FakeClient, store: SnapshotStore) -> None:
    """A backend's save pauses every slot's decoding: while another slot runs a turn, the idle slot waits the full
    --save-idle-seconds."""
    pool = make_pool(client, store, n_slots=2, save_idle_seconds=1.5)
    try:
        await turn(pool, A)
        await turn(pool, B)
        await turn(pool, C)  # evicts A (saved on the switch): the write rate is known
        assert len(client.actions("save")) == 1
        busy = await pool.acquire(D)  # takes B's slot (saved on the switch); it is generating from now on
        idle = next(s for s in pool.slots if s.slot_id != busy.slot_id)
        assert idle.occupant == C and idle.dirty
        assert pool.idle_saves.delay(idle) == IDLE_SAVE_FLOOR_SECONDS
        saves = len(client.actions("save"))
        await asyncio.sleep(0.8)
        assert len(client.actions("save")) == saves and store.get(C) is None  # past the floor, not saved
        assert await wait_saved(store, C, 5) is not None  # at --save-idle-seconds
        busy.release(TurnEnd.REJECTED)
    finally:
        await pool.aclose()


# -- operator actions -------------------------------------------------------------------------------------------


async def test_flush_saves_dirty_slots(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, n_slots=3)
    la = await pool.acquire(A)
    lb = await pool.acquire(B)
    lc = await pool.acquire(C)
    la.release(TurnEnd.COMPLETED)
    lb.release(TurnEnd.COMPLETED)
    lc.release(TurnEnd.FAILED)
    assert await flush(pool) == (2, 0)
    assert store.get(A) is not None and store.get(B) is not None and store.get(C) is None
    assert all(not s.dirty and not s.busy for s in pool.slots)
    assert await flush(pool) == (0, 0)
    assert len(client.actions("save")) == 2


async def test_clear_saves_then_erases(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, n_slots=2)
    la = await pool.acquire(A)
    lb = await pool.acquire(B)
    la.release(TurnEnd.COMPLETED)
    lb.release(TurnEnd.REJECTED)  # B not dirty
    erased = await clear(pool)
    assert erased == [0, 1]
    assert la.slot_id == 0
    assert [(c[0], c[1]) for c in client.calls] == [(0, "save"), (0, "erase"), (1, "erase")]
    assert store.get(A) is not None and store.get(B) is None
    assert all(s.occupant is None and not s.dirty and not s.busy and s.n_tokens == 0 for s in pool.slots)
    lease = await pool.acquire(A)
    assert lease.cache.outcome is CacheOutcome.RESTORED
    lease.release(TurnEnd.COMPLETED)


async def test_clear_slot_saves_and_erases_only_that_slot(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, n_slots=3)
    for k in (A, B, C):
        await turn(pool, k)
    assert [s.occupant for s in pool.slots] == [A, B, C]
    assert await clear_slot(pool, 1) == B
    assert [(c[0], c[1]) for c in client.calls] == [(1, "save"), (1, "erase")]
    assert store.get(B) is not None and store.get(A) is None and store.get(C) is None
    assert [s.occupant for s in pool.slots] == [A, None, C]
    assert pool.slots[0].dirty and pool.slots[2].dirty  # the other slots keep their unsaved state
    assert not pool.slots[1].dirty and pool.slots[1].n_tokens == 0 and pool.slots[1].chain == []
    assert not any(s.busy for s in pool.slots)
    # An empty or saved slot is erased without a save; the next turn of B restores its snapshot.
    client.calls.clear()
    assert await clear_slot(pool, 1) is None
    assert client.calls == [(1, "erase", None)]
    lease = await pool.acquire(B)
    assert (lease.slot_id, lease.cache.outcome) == (1, CacheOutcome.RESTORED)
    lease.release(TurnEnd.COMPLETED)


async def test_clear_slot_waits_for_the_running_turn(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, n_slots=2)
    running = await pool.acquire(A)
    clearing = asyncio.create_task(clear_slot(pool, running.slot_id))
    await asyncio.sleep(0.05)
    assert not clearing.done() and client.calls == []
    # The other slot stays usable meanwhile.
    other = await asyncio.wait_for(pool.acquire(B), 1)
    assert other.slot_id == 1
    other.release(TurnEnd.COMPLETED)
    running.release(TurnEnd.COMPLETED, 30)
    assert await asyncio.wait_for(clearing, 1) == A
    assert [(c[0], c[1]) for c in client.calls] == [(0, "save"), (0, "erase")]
    assert pool.slots[0].occupant is None and pool.slots[1].occupant == B


async def test_a_session_deleted_while_its_slot_is_cleared_does_not_haunt_the_slot(client: FakeClient,
                                                                                  store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)
    client.save_delay = 0.1
    clearing = asyncio.create_task(clear_slot(pool, 0))
    await asyncio.sleep(0.03)  # the clear is saving A
    pool.forget(A)
    assert await asyncio.wait_for(clearing, 1) == A
    client.save_delay = 0.0
    # The erase ended the slot's story: the next session in it is attributed and saved as usual.
    await turn(pool, B)
    assert pool.slots[0].occupant == B and pool.slots[0].dirty


@pytest.mark.parametrize("failure", ["backend", "zero-tokens"])
async def test_clear_keeps_a_slot_whose_save_failed(client: FakeClient, store: SnapshotStore, failure: str) -> None:
    """Clearing a slot whose changed state cannot be saved does not erase it: the state stays in the slot (still
    changed, still its session's), and the clear says so; a clear of every slot erases the others."""
    pool = make_pool(client, store, n_slots=2)
    await turn(pool, A)
    await turn(pool, B)
    if failure == "backend":
        client.save_error = UpstreamError(500, b'{"error":{"message":"disk full"}}')
    else:
        client.save_tokens = 0
    with pytest.raises(SlotkeeperError, match=r"saving slot 0 \(m/A\) failed, so it was not erased"):
        await clear_slot(pool, 0)
    assert client.actions("erase") == []
    assert pool.slots[0].occupant == A and pool.slots[0].dirty and not pool.slots[0].busy
    with pytest.raises(SlotkeeperError, match=r"slot\(s\) 0, 1 were not erased"):
        await clear(pool)
    assert client.actions("erase") == []
    pool.slots[1].dirty = False  # as if B's state were on disk: only A's save is tried, and fails
    with pytest.raises(SlotkeeperError, match=r"slot\(s\) 0 were not erased.*; erased: 1$"):
        await clear(pool)
    assert [c[0] for c in client.actions("erase")] == [1]
    client.save_error, client.save_tokens = None, 42
    assert await clear_slot(pool, 0) == A  # saved now, then erased
    assert store.get(A) is not None and pool.slots[0].occupant is None


async def test_clear_slot_refuses_a_slot_that_does_not_exist(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, n_slots=2)
    for slot_id in (2, -1):
        with pytest.raises(NotFound, match=f"no slot {slot_id}: the backend has 2 slot"):
            await clear_slot(pool, slot_id)
    assert client.calls == [] and len(pool._waiters) == 0


async def test_forget_stops_later_save(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)
    pool.forget(A)
    assert pool.slots[0].occupant is None and not pool.slots[0].dirty
    await turn(pool, B)
    assert await flush(pool) == (1, 0)
    assert store.get(A) is None
    assert next(c[2] for c in client.actions("save")).startswith(B.file_stem(FP))


async def test_forget_stops_idle_save(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, save_idle_seconds=0.05)
    try:
        await turn(pool, A)
        pool.forget(A)
        await asyncio.sleep(0.3)
        assert client.actions("save") == []
        assert store.get(A) is None
    finally:
        await pool.aclose()


# -- save failures ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["unavailable", "zero-tokens", "upstream-error"])
async def test_save_failure_does_not_fail_acquire(
    client: FakeClient, store: SnapshotStore, slot_dir: Path, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)
    if failure == "unavailable":
        client.save_error = UpstreamUnavailable("backend gone")
    elif failure == "upstream-error":
        client.save_error = UpstreamError(500, b'{"error":{"message":"disk full"}}')
    else:
        client.save_tokens = 0
    with caplog.at_level(logging.ERROR, logger="slotkeeper.pool"):
        lease = await pool.acquire(B)
        await pool.snapshots.settle()  # a commit that fails does so in the background
    assert lease.cache.outcome is CacheOutcome.COLD
    assert pool.snapshots.failed_saves == 1 and pool.snapshots.saves == 0
    assert store.get(A) is None
    assert [n for n in os.listdir(slot_dir) if ".tmp-" in n] == []
    assert any(r.levelno == logging.ERROR and "A" in r.getMessage() for r in caplog.records)
    lease.release(TurnEnd.COMPLETED)
    assert pool.slots[0].occupant == B


async def test_save_failure_keeps_previous_snapshot(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    await turn(pool, A)
    await turn(pool, B)  # A saved
    await pool.snapshots.settle()
    good = store.get(A)
    assert good is not None
    await turn(pool, A)  # A restored, B saved
    client.save_tokens = 0
    await turn(pool, B)  # saving A fails
    await pool.snapshots.settle()
    assert pool.snapshots.failed_saves == 1
    kept = store.get(A)
    assert kept is not None
    assert (kept.filename, kept.checksum, kept.n_tokens) == (good.filename, good.checksum, good.n_tokens)
    assert store.checked_snapshot(A, FP) is not None


async def test_idle_save_failure_counted(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, save_idle_seconds=0.05)
    try:
        client.save_error = UpstreamUnavailable("backend gone")
        await turn(pool, A)
        for _ in range(100):
            if pool.snapshots.failed_saves and not pool.slots[0].busy:
                break
            await asyncio.sleep(0.01)
        assert pool.snapshots.failed_saves == 1
        assert not pool.slots[0].busy
        lease = await asyncio.wait_for(pool.acquire(B), 1)
        lease.release(TurnEnd.REJECTED)
    finally:
        await pool.aclose()


# -- regressions ------------------------------------------------------------------------------------------------


async def test_forget_during_a_running_turn_stops_its_save(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, save_idle_seconds=0.05)
    lease = await pool.acquire(A)
    pool.forget(A)  # DELETE /api/sessions/A while A's turn is still streaming
    lease.release(TurnEnd.COMPLETED, 10)
    await asyncio.sleep(0.3)
    assert client.actions("save") == []
    assert pool.slots[0].occupant is None and not pool.slots[0].dirty
    await pool.aclose()


async def test_a_session_deleted_while_its_idle_save_runs_does_not_take_the_next_sessions_turn(
        client: FakeClient, store: SnapshotStore) -> None:
    """DELETE /api/sessions/A while A's idle save runs: once the save is done the slot no longer holds A, and the
    next session's completed turn in that slot is attributed to it and saved."""
    pool = make_pool(client, store, save_idle_seconds=0.02)
    try:
        await turn(pool, A)
        client.save_delay = 0.2
        for _ in range(100):
            if client.actions("save"):
                break
            await asyncio.sleep(0.01)
        assert pool.slots[0].busy  # the idle save: the backend is writing A's state
        pool.forget(A)
        for _ in range(100):
            if not pool.slots[0].busy:
                break
            await asyncio.sleep(0.01)
        client.save_delay = 0.0
        assert pool.slots[0].occupant is None  # deleted: no longer hot
        lease = await pool.acquire(B)
        assert lease.cache.outcome is CacheOutcome.COLD
        lease.release(TurnEnd.COMPLETED, 10)
        assert pool.slots[0].occupant == B and pool.slots[0].dirty
        assert (await flush(pool)).saved == 1
        assert store.get(B) is not None
    finally:
        await pool.aclose()


async def test_a_new_arrival_does_not_jump_the_queue(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store)
    holder = await pool.acquire(A)
    order: list[str] = []

    async def take_b() -> None:
        lease = await pool.acquire(B)
        order.append("B")
        lease.release(TurnEnd.COMPLETED, 1)

    waiting = asyncio.create_task(take_b())
    await asyncio.sleep(0.01)  # B is queued
    holder.release(TurnEnd.COMPLETED, 1)
    late = await pool.acquire(C)  # arrives right after the release, in this task, before B has run
    order.append("C")
    late.release(TurnEnd.COMPLETED, 1)
    await asyncio.wait_for(waiting, 5)
    assert order == ["B", "C"]


# -- the planner's choices ----------------------------------------------------------------------------------------

SYS_MSG = {"role": "system", "content": "shared"}


def chain_of(*texts: str) -> list:
    from slotkeeper.cache.chain import message_chain

    return message_chain([SYS_MSG, *({"role": "user", "content": t} for t in texts)])


async def test_a_new_session_restores_another_sessions_prefix(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, min_restore_tokens=0)
    lease = await pool.acquire(A, chain_of("a1"))
    lease.release(TurnEnd.COMPLETED, 40)
    other = await pool.acquire(B, [])  # unrelated: saves A with its chain
    other.release(TurnEnd.COMPLETED, 10)
    fresh = await pool.acquire(C, chain_of("c1"))
    assert fresh.cache.outcome == CacheOutcome.PREFIX and fresh.cache.restored_from == "A"
    fresh.release(TurnEnd.COMPLETED, 30)


async def test_only_a_conversations_own_side_tasks_say_they_follow_it(client: FakeClient,
                                                                      store: SnapshotStore) -> None:
    """Another chat's title task that takes an agent's slot right after its turn says nothing of the agent's next
    turn (which comes back hot, and must not wait for an early save); a conversation's own side task does. A turn
    that starts from the saved state of a conversation its side tasks follow (a new chat on the same system prompt)
    is expected to be followed too; one that starts from nothing of it is not."""
    pool = make_pool(client, store, save_idle_seconds=30, min_restore_tokens=0)
    try:
        agent = await pool.acquire(D, chain_of("d1"))
        agent.release(TurnEnd.COMPLETED, 40)
        title = await pool.acquire(C, side=True)  # another chat's title task, right after the agent's turn
        title.release(TurnEnd.COMPLETED)
        assert not pool.notes.side_task_follows(D)
        first = await pool.acquire(A, chain_of("a1"))
        first.release(TurnEnd.COMPLETED, 40)
        task = await pool.acquire(A, side=True)  # A's own follow-ups: side tasks follow A
        task.release(TurnEnd.COMPLETED)
        await pool.snapshots.settle()
        assert pool.notes.side_task_follows(A)
        second = await pool.acquire(B, chain_of("a1", "r1", "a2"))  # starts from A's state
        assert second.cache.restored_from == "A"
        second.release(TurnEnd.COMPLETED, 60)
        assert pool.notes.side_task_follows(B) and pool.idle_saves.delay(pool.slots[0]) == 0
        other = await pool.acquire(C, chain_of("c1"))  # another chat, from nothing of A's
        other.release(TurnEnd.COMPLETED, 40)
        assert not pool.notes.side_task_follows(C)
    finally:
        await pool.aclose()


async def test_two_chats_under_one_derived_name_each_start_from_their_own_state(client: FakeClient,
                                                                                 store: SnapshotStore) -> None:
    """Confirmed at 99614b5 (#38): two chats without an id that open alike share a derived name, and each one's
    save replaced the other's state, so each turn prefilled its history again. The name's other conversation's
    state stays as a branch, and each chat restores its own: the whole of what it had."""
    pool = make_pool(client, store, min_restore_tokens=0)
    chat = SessionKey("m", "chat-0123456789abcdef", IdSource.MESSAGES)
    one, two = ["hi", "r1", "q2"], ["hi", "r1", "q2 of the other chat"]
    for n in range(3):
        for history, size in ((one, 40 + 10 * n), (two, 45 + 10 * n)):
            lease = await pool.acquire(chat, chain_of(*history))
            if n > 0:  # its own state, not the other chat's under the same name, and all of it
                assert lease.cache.outcome is CacheOutcome.RESTORED or lease.cache.outcome is CacheOutcome.PREFIX
                assert lease.cache.restored_from is not None
                restored = await pool.snapshots.chain(
                    next(s for s in await store_rows(store) if s.filename == client.actions("restore")[-1][2]))
                assert restored == chain_of(*history[:-2])
            client.slot_tokens[lease.slot_id] = list(range(size))
            lease.release(TurnEnd.COMPLETED, size)
            history += [f"answer {n}", f"question {n + 1}"]
    rows = [s.session_id for s in await store_rows(store)]
    assert sorted(rows) == sorted([chat.session_id, next(r for r in rows if r.startswith(chat.session_id + "~"))])


async def store_rows(store: SnapshotStore) -> list[Snapshot]:
    return await asyncio.to_thread(store.list, "m")


async def test_prefix_restore_skipped_when_the_slot_already_shares_it(client: FakeClient,
                                                                      store: SnapshotStore) -> None:
    pool = make_pool(client, store, min_restore_tokens=0)
    (await pool.acquire(A, chain_of("a1"))).release(TurnEnd.COMPLETED, 40)
    (await pool.acquire(B, chain_of("b1"))).release(TurnEnd.COMPLETED, 40)  # slot holds B: shares the system
    lease = await pool.acquire(C, chain_of("c1"))
    assert lease.cache.outcome == CacheOutcome.COLD  # A's prefix would give no more than the slot already has
    lease.release(TurnEnd.COMPLETED, 30)


async def test_small_restores_are_skipped(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, min_restore_tokens=100)
    client.save_tokens = 50
    await turn(pool, A)
    await turn(pool, B)
    lease = await pool.acquire(A)
    assert lease.cache.outcome == CacheOutcome.COLD and client.actions("restore") == []
    lease.release(TurnEnd.COMPLETED, 1)


async def test_the_queue_is_bounded(client: FakeClient, store: SnapshotStore) -> None:
    from slotkeeper.errors import Overloaded

    pool = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1, max_queue=1)  # type: ignore[arg-type]
    holder = await pool.acquire(A)
    waiting = asyncio.create_task(pool.acquire(B))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded):
        await pool.acquire(C)
    holder.release(TurnEnd.COMPLETED, 1)
    (await waiting).release(TurnEnd.COMPLETED, 1)


@pytest.mark.parametrize(("cache_ns", "fell_back"), [
    ([0, 0, 0], True), ([0, 0, 7], False), ([7, 7, 7], False), ([0, 7, 0, 0], False), ([0, 7, 0, 0, 0], True),
], ids=["three-misses", "hit-last", "all-hits", "hit-breaks-run", "run-after-hit"])
async def test_restores_that_do_not_help_move_to_the_next_strategy(client: FakeClient, store: SnapshotStore,
                                                                   cache_ns: list[int], fell_back: bool) -> None:
    """Three restores in a row that reused less than they owed move the backend to the prompt-end strategy; saving
    goes on as before (every switch still saves)."""
    pool = make_pool(client, store, min_restore_tokens=0)
    client.save_tokens = 8
    await turn(pool, A)
    for cache_n in cache_ns:
        await turn(pool, B)  # saves A
        lease = await pool.acquire(A)
        assert lease.cache.outcome == CacheOutcome.RESTORED
        lease.release(TurnEnd.COMPLETED, 10, cache_n=cache_n)
    assert (pool.policy.fallback is Strategy.PROMPT_END) is fell_back
    assert pool.policy.effective_now is not fell_back
    saves = len(client.actions("save"))
    assert saves == 2 * len(cache_ns)
    if fell_back:
        await turn(pool, B)
        assert len(client.actions("save")) == saves + 1  # saving never stops
        lease = await pool.acquire(A)
        # A's snapshot holds generated tokens; the prompt-end strategy restores only what a request extends.
        assert lease.cache.outcome == CacheOutcome.COLD
        lease.release(TurnEnd.COMPLETED, 1)


async def test_a_reasoning_client_keeps_restores_on(client: FakeClient, store: SnapshotStore) -> None:
    """The slot holds prompt + thinking + answer; the client sends back a short answer, so the backend reuses the
    previous prompt only. That is all the restore owed: it counts as effective, however long the answer was."""
    pool = make_pool(client, store, min_restore_tokens=0)
    client.save_tokens = client.restore_default = 500  # 100 prompt tokens + 400 generated
    history = ["a1"]
    lease = await pool.acquire(A, chain_of(*history))
    lease.release(TurnEnd.COMPLETED, 500, cache_n=0, n_prompt=100)
    for round_ in range(10):
        (await pool.acquire(B, chain_of("b"))).release(TurnEnd.COMPLETED, 500, cache_n=98, n_prompt=100)
        history += [f"answer {round_}", f"question {round_}"]
        lease = await pool.acquire(A, chain_of(*history))
        assert lease.cache.outcome == CacheOutcome.RESTORED and lease.cache.expected_reuse == 100, round_
        lease.release(TurnEnd.COMPLETED, 500, cache_n=98, n_prompt=100)
    assert pool.policy.effective == 19 and pool.policy.ineffective == 0 and pool.policy.effective_now
    assert len(client.actions("save")) == 20  # every switch saved


async def test_an_own_snapshot_that_shares_nothing_is_not_restored(client: FakeClient, store: SnapshotStore) -> None:
    """A client that trimmed its history (a sliding window) no longer starts with the saved messages: restoring would
    reuse nothing, and must not count as a restore that did not help."""
    pool = make_pool(client, store, min_restore_tokens=0)
    (await pool.acquire(A, chain_of("a1", "a2"))).release(TurnEnd.COMPLETED, 40)
    (await pool.acquire(B, [])).release(TurnEnd.COMPLETED, 10)  # saves A with its chain
    from slotkeeper.cache.chain import message_chain

    trimmed = message_chain([{"role": "user", "content": "a2"}, {"role": "user", "content": "a3"}])
    lease = await pool.acquire(A, trimmed)
    assert lease.cache.outcome == CacheOutcome.COLD and client.actions("restore") == []
    lease.release(TurnEnd.COMPLETED, 10, cache_n=0)
    assert pool.policy.ineffective == 0


async def test_expected_reuse_is_the_shared_part(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, min_restore_tokens=0)
    client.save_tokens = 100
    (await pool.acquire(A, chain_of("a1", "a2", "a3"))).release(TurnEnd.COMPLETED, 100)
    (await pool.acquire(B, [])).release(TurnEnd.COMPLETED, 10)
    await pool.snapshots.settle()
    client.restore_tokens = {store.get(A).filename: 100}  # type: ignore[union-attr]
    edited = await pool.acquire(A, chain_of("a1", "edited"))
    assert edited.cache.outcome == CacheOutcome.RESTORED and 0 < edited.cache.expected_reuse < 100
    edited.release(TurnEnd.COMPLETED, 60, cache_n=edited.cache.expected_reuse)
    assert pool.policy.effective == 1


async def test_on_a_tie_the_sessions_own_snapshot_wins(client: FakeClient, store: SnapshotStore) -> None:
    """The slot holds another session on the same system prompt; this session's edited last message shares only
    the system prompt at message level, but its own state usually shares more text: restore it."""
    pool = make_pool(client, store, min_restore_tokens=0)
    (await pool.acquire(A, chain_of("a1"))).release(TurnEnd.COMPLETED, 40)
    (await pool.acquire(B, chain_of("b1"))).release(TurnEnd.COMPLETED, 40)  # saves A; the slot shares the system
    lease = await pool.acquire(A, chain_of("a1 with more text"))
    assert lease.cache.outcome == CacheOutcome.RESTORED
    lease.release(TurnEnd.COMPLETED, 50)


async def test_a_side_task_runs_in_its_own_conversations_slot(client: FakeClient, store: SnapshotStore) -> None:
    """With every slot taken, a chat's title or tags task runs where the chat is (saved first), not in the slot of
    another conversation (an agent that may be back at once), even when that one is already on disk."""
    pool = make_pool(client, store, n_slots=2)
    agent = await turn(pool, A)
    await flush(pool)  # the agent's state is on disk: its slot is clean
    chat = await turn(pool, B)
    task = await pool.acquire(B, side=True)
    assert task.slot_id == chat.slot_id != agent.slot_id
    assert [c[0] for c in client.actions("save")][-1] == chat.slot_id  # the chat was saved before the task
    task.release(TurnEnd.COMPLETED)
    back = await pool.acquire(A)
    assert back.slot_id == agent.slot_id and back.cache.outcome is CacheOutcome.HOT
    back.release(TurnEnd.COMPLETED)
    resumed = await pool.acquire(B)
    assert resumed.slot_id == chat.slot_id and resumed.cache.outcome is CacheOutcome.RESTORED
    resumed.release(TurnEnd.COMPLETED)


async def test_a_side_task_still_prefers_an_empty_slot(client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, n_slots=2)
    chat = await turn(pool, B)
    task = await pool.acquire(B, side=True)
    assert task.slot_id != chat.slot_id and client.actions("save") == []
    task.release(TurnEnd.COMPLETED)
    assert (await turn(pool, B)).cache.outcome is CacheOutcome.HOT


async def test_a_side_task_goes_where_the_last_side_task_ran(client: FakeClient, store: SnapshotStore) -> None:
    """OpenWebUI's tasks begin alike (the same instructions): the next one runs in the slot the last one left, where
    the backend reuses what they share, not in an empty slot; and never in a conversation's slot while another is
    free. The conversation stays hot in its own."""
    pool = make_pool(client, store, n_slots=3)
    chat = await turn(pool, B)
    title = await pool.acquire(B, side=True)
    title.release(TurnEnd.COMPLETED, 40, None, 30)
    assert title.slot_id != chat.slot_id
    assert pool.slots[title.slot_id].side_content and pool.slots[title.slot_id].occupant is None
    tags = await pool.acquire(C, side=True)  # another chat's task: still where a task ran last
    assert tags.slot_id == title.slot_id
    tags.release(TurnEnd.COMPLETED, 40, None, 30)
    assert (await turn(pool, B)).cache.outcome is CacheOutcome.HOT
    assert client.actions("save") == []  # nothing of a conversation was saved or moved for the tasks


async def test_a_title_task_sent_just_before_its_chat_goes_after_it(client: FakeClient, store: SnapshotStore) -> None:
    """OpenWebUI sends a new chat's title task a few ms before the chat's own request: held back, the task runs once
    the chat's turn is done, on one slot. Without the hold it would take the slot first."""
    for hold, expected in ((0.2, ["chat", "title"]), (0.0, ["title", "chat"])):
        pool = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1,  # type: ignore[arg-type]
                        side_hold_seconds=hold)
        served: list[str] = []

        async def request(name: str, k: SessionKey, side: bool, pool: SlotPool = pool,
                          served: list[str] = served) -> None:
            lease = await pool.acquire(k, side=side)
            served.append(name)
            await asyncio.sleep(0.05)
            lease.release(TurnEnd.COMPLETED)

        title = asyncio.create_task(request("title", key(f"chat-{hold}"), True))
        await asyncio.sleep(0.03)
        chat = asyncio.create_task(request("chat", key(f"chat-{hold}"), False))
        await asyncio.wait_for(asyncio.gather(title, chat), 2)
        assert served == expected, (hold, served)


async def test_a_held_title_task_waits_for_its_chat_and_no_longer(client: FakeClient, store: SnapshotStore) -> None:
    """The hold ends when the chat's request is queued: the title then runs right after the chat's turn, not when
    a long hold is over (on a fast model the chat's answer is done long before)."""
    pool = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1,  # type: ignore[arg-type]
                    side_hold_seconds=30)
    loop = asyncio.get_running_loop()
    served: dict[str, float] = {}

    async def request(name: str, side: bool) -> None:
        lease = await pool.acquire(key("chat-x"), side=side)
        served[name] = loop.time()
        await asyncio.sleep(0.02)
        lease.release(TurnEnd.COMPLETED)

    started = loop.time()
    title = asyncio.create_task(request("title", True))
    await asyncio.sleep(0.03)
    chat = asyncio.create_task(request("chat", False))
    await asyncio.wait_for(asyncio.gather(title, chat), 10)  # a 30 s hold would time this out
    assert served["chat"] < served["title"] < started + 5, served


async def test_queued_side_tasks_go_after_conversations(client: FakeClient, store: SnapshotStore) -> None:
    pool = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1,  # type: ignore[arg-type]
                    side_hold_seconds=0.01)
    first = await pool.acquire(A)
    served: list[str] = []

    async def request(name: str, k: SessionKey, side: bool) -> None:
        lease = await pool.acquire(k, side=side)
        served.append(name)
        lease.release(TurnEnd.COMPLETED)

    task = asyncio.create_task(request("tags", A, True))
    await asyncio.sleep(0.05)  # the task is queued, past its hold
    later = asyncio.create_task(request("B", B, False))
    await asyncio.sleep(0.01)
    first.release(TurnEnd.COMPLETED)
    await asyncio.wait_for(asyncio.gather(task, later), 2)
    assert served == ["B", "tags"]


# -- strategies per architecture and build ----------------------------------------------------------------------


def strategy_pool(client: FakeClient, store: SnapshotStore, kind: str, checkpoints: bool | None) -> SlotPool:
    from slotkeeper.cache.capability import ArchKind, Capability

    return SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1, min_restore_tokens=0,  # type: ignore[arg-type]
                    capability=Capability("x", ArchKind(kind), checkpoints))


class ReplayClient(FakeClient):
    """Also answers the prompt-end step (a chat request with max_tokens 0): the slot rolls back to 4 tokens before
    the prompt's end, and then holds exactly `prompt` tokens."""

    def __init__(self, slot_dir: Path, prompt: int = 100) -> None:
        super().__init__(slot_dir)
        self.prompt = prompt
        self.replays: list[dict[str, object]] = []

    async def post_json(self, path: str, body: dict[str, object], timeout: float | None = None) -> dict[str, object]:
        self.replays.append(body)
        self.save_tokens = self.prompt
        return {"timings": {"cache_n": self.prompt - 4, "prompt_n": 4}}


async def chat_turn(pool: SlotPool, k: SessionKey, chain: list, n_prompt: int = 100, generated: int = 40):
    lease = await pool.acquire(k, chain)
    lease.replay = ("/v1/chat/completions", {"messages": [], "max_tokens": generated, "stream": True})
    lease.release(TurnEnd.COMPLETED, n_prompt + generated, cache_n=n_prompt, n_prompt=n_prompt)
    return lease


async def test_prompt_end_saves_hold_the_prompt_and_the_next_turn_restores_them(store: SnapshotStore,
                                                                              slot_dir: Path) -> None:
    client = ReplayClient(slot_dir)
    client.restore_default = 100
    pool = strategy_pool(client, store, "recurrent", False)
    await chat_turn(pool, A, chain_of("a1"))
    client.save_tokens = 140
    await chat_turn(pool, B, chain_of("b1"))  # saves A: first back to its prompt's end
    assert client.replays[0]["max_tokens"] == 0 and client.replays[0]["stream"] is False
    await pool.snapshots.settle()
    snap = store.get(A)
    assert snap is not None and snap.n_tokens == 100 and snap.at_prompt_end
    assert (pool.saver.prompt_end_steps, pool.saver.prompt_end_tokens) == (1, 4)
    lease = await pool.acquire(A, chain_of("a1", "answer", "a2"))  # the next turn extends the prompt
    assert lease.cache.outcome is CacheOutcome.RESTORED and lease.cache.expected_reuse == 100
    lease.release(TurnEnd.COMPLETED, 150, cache_n=100, n_prompt=110)
    assert pool.policy.effective == 1


async def test_prompt_end_restores_only_what_the_request_extends(store: SnapshotStore, slot_dir: Path) -> None:
    client = ReplayClient(slot_dir)
    pool = strategy_pool(client, store, "hybrid", None)
    await chat_turn(pool, A, chain_of("a1", "x", "a2"))
    await chat_turn(pool, B, chain_of("b1"))
    edited = await pool.acquire(A, chain_of("a1", "x", "a2 edited"))  # diverges inside the snapshot
    assert edited.cache.outcome is CacheOutcome.COLD and client.actions("restore") == []
    edited.release(TurnEnd.COMPLETED, 10)
    await chat_turn(pool, B, chain_of("b1", "y", "b2"))
    again = await pool.acquire(A, chain_of("a1", "x", "a2 edited"))  # the same prompt again: no extension either
    assert again.cache.outcome is CacheOutcome.COLD
    again.release(TurnEnd.COMPLETED, 10)
    assert pool.policy.ineffective == 0


class CutClient(ReplayClient):
    """Also renders a system part followed by a user message (`/apply-template`), and answers the cut (a
    `/completion` of the rendered system part) with the slot holding exactly `system` tokens."""

    def __init__(self, slot_dir: Path, system: int = 80) -> None:
        super().__init__(slot_dir)
        self.system = system
        self.cuts: list[dict[str, object]] = []

    async def post_json(self, path: str, body: dict[str, object], timeout: float | None = None) -> dict[str, object]:
        if path == "/apply-template":
            messages = body["messages"]
            assert isinstance(messages, list)
            return {"prompt": "<system>shared</system><user>" + str(messages[-1]["content"])}
        if path == "/completion":
            self.cuts.append(body)
            self.save_tokens = self.system
            return {"timings": {"cache_n": self.system - 1, "prompt_n": 1}}
        return await super().post_json(path, body, timeout)


@pytest.mark.parametrize(("kind", "restored"), [("dense", False), ("recurrent", True)])
async def test_a_new_system_part_is_cut_from_the_first_conversation_when_it_idles(
        store: SnapshotStore, slot_dir: Path, kind: str, restored: bool) -> None:
    """No warm-up on a request's path: the first conversation on a new system part runs in one pass, and once its
    state is saved and the slot idles, the slot is cut back to the system part, which is saved as a state of its
    own. A new chat then extends the slot; another one, while the slot holds a conversation on that part, keeps the
    system part for free on a dense model and restores the system state on a recurrent one (which cannot roll back
    that far)."""
    from slotkeeper.cache.capability import ArchKind, Capability
    from slotkeeper.cache.systemprompt import system_prompt_of

    system = system_prompt_of({"messages": [SYS_MSG, {"role": "user", "content": "hello"}]})
    assert system is not None
    client = CutClient(slot_dir)
    client.restore_default = 80
    pool = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=0.01,  # type: ignore[arg-type]
                    capability=Capability("x", ArchKind(kind), False))
    lease = await pool.acquire(A, chain_of("a1"), system=system)
    assert lease.cut_system and lease.cache.outcome is CacheOutcome.COLD and client.cuts == []
    lease.replay = ("/v1/chat/completions", {"messages": [], "max_tokens": 8})
    client.save_tokens = 120
    lease.release(TurnEnd.COMPLETED, 120, cache_n=0, n_prompt=100)
    assert await eventually(lambda: pool.warmups.cuts == 1)
    await pool.snapshots.settle()
    saved = store.get(SessionKey("m", system.digest), SnapshotKind.SYSTEM)
    assert saved is not None and saved.n_tokens == 80 and store.get(A) is not None
    assert client.cuts[0]["prompt"] == "<system>shared</system><user>" and client.cuts[0]["n_predict"] == 0
    assert pool.slots[0].occupant is None and not pool.slots[0].dirty
    first = await pool.acquire(C, chain_of("c1"), system=system)  # extends what the slot holds now
    assert first.cache.outcome is CacheOutcome.COLD and not first.cut_system and client.actions("restore") == []
    first.release(TurnEnd.COMPLETED, 120, n_prompt=100)
    other = await pool.acquire(D, chain_of("d1"), system=system)
    assert (other.cache.outcome is CacheOutcome.RESTORED) is restored
    other.release(TurnEnd.COMPLETED, 120)
    back = await pool.acquire(A, chain_of("a1", "answer", "a2"), system=system)  # restores its own state
    assert back.cache.outcome is CacheOutcome.RESTORED and back.cache.restored_from == "A"
    back.release(TurnEnd.COMPLETED, 150)
    await pool.aclose()


async def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether `predicate` holds within `timeout`, the event loop running the pool's timers meanwhile."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_keep_hot_never_restores_and_still_saves(store: SnapshotStore, slot_dir: Path) -> None:
    client = ReplayClient(slot_dir)
    pool = strategy_pool(client, store, "swa", False)
    await chat_turn(pool, A, chain_of("a1"))
    await chat_turn(pool, B, chain_of("b1"))
    lease = await pool.acquire(A, chain_of("a1", "x", "a2"))
    assert lease.cache.outcome is CacheOutcome.COLD and client.actions("restore") == []
    lease.release(TurnEnd.COMPLETED, 10)
    assert len(client.actions("save")) == 2 and client.replays == []  # saved, without a prompt-end step
    # A new system prompt is not cut into a state of its own either: it could never be restored.
    from slotkeeper.cache.systemprompt import system_prompt_of

    system = system_prompt_of({"messages": [SYS_MSG, {"role": "user", "content": "hello"}]})
    lease = await pool.acquire(C, chain_of("c1"), system=system)
    assert lease.cache.outcome is CacheOutcome.COLD
    lease.release(TurnEnd.COMPLETED, 10)
    pool.slots[0].dirty = False  # as after its idle save
    await pool.warmups.cut_back(pool.slots[0])  # what the idle save does next
    assert pool.warmups.cuts == 0 and client.replays == []


async def test_a_file_with_checkpoints_switches_to_restoring(store: SnapshotStore, slot_dir: Path) -> None:
    import struct

    class AppendixClient(ReplayClient):
        async def slot_action(self, slot_id: int, action: str, filename: str | None = None) -> SlotActionResult:
            result = await super().slot_action(slot_id, action, filename)
            if action == "save" and filename is not None:
                path = self.slot_dir / filename
                appendix = struct.pack("<III", 0x504B4353, 1, 1) + struct.pack("<Qii", 96, 0, 95)
                appendix += struct.pack("<Q", 5) + b"state" + struct.pack("<QQ", 0, 0)
                path.write_bytes(path.read_bytes() + appendix)
                result = SlotActionResult(result.n_tokens, path.stat().st_size, 1.0)
            return result

    client = AppendixClient(slot_dir)
    pool = strategy_pool(client, store, "hybrid", None)
    assert pool.policy.strategy is Strategy.PROMPT_END
    await chat_turn(pool, A, chain_of("a1"))
    await chat_turn(pool, B, chain_of("b1"))
    await pool.snapshots.settle()
    await asyncio.sleep(0)  # the commit's thread hands what it learned to the loop
    assert pool.policy.capability.checkpoints_in_file is True and pool.policy.strategy is Strategy.RESTORE


async def test_a_rolled_back_save_without_checkpoints_says_the_build_has_none(store: SnapshotStore,
                                                                              slot_dir: Path) -> None:
    client = ReplayClient(slot_dir)
    pool = strategy_pool(client, store, "recurrent", None)
    await chat_turn(pool, A, chain_of("a1"))
    await chat_turn(pool, B, chain_of("b1"))  # A's prompt-end step rolled back to a checkpoint; the file has none
    await pool.snapshots.settle()
    await asyncio.sleep(0)
    assert pool.policy.capability.checkpoints_in_file is False and pool.policy.strategy is Strategy.PROMPT_END


async def test_a_small_request_that_shares_nothing_with_its_sessions_state_runs_as_a_side_request(
        client: FakeClient, store: SnapshotStore) -> None:
    """A client's one-off request under a conversation's id (a title, a summary: no shape rule knew it) shares no
    message with the conversation's state and is much smaller: it runs as a side request, so the conversation's
    state stays its own, and the conversation's next turn starts from it again."""
    from slotkeeper.cache.chain import message_chain

    pool = make_pool(client, store, min_restore_tokens=0)
    conversation = chain_of("a long task " + "x" * 4000)
    lease = await pool.acquire(A, conversation)
    lease.release(TurnEnd.COMPLETED, 1200, cache_n=0, n_prompt=1150)
    title = message_chain([{"role": "system", "content": "You are a title generator."},
                           {"role": "user", "content": "a long task"}])
    one_off = await pool.acquire(A, title)
    assert one_off.side and one_off.cache.why == "side-task" and pool.slots[0].occupant is None
    one_off.release(TurnEnd.COMPLETED, 60, n_prompt=50)
    await pool.snapshots.settle()
    saved = store.get(A)
    assert saved is not None and store.chain_of(saved) == conversation  # saved before the one-off, and kept
    back = await pool.acquire(A, [*conversation, *chain_of("a long task " + "x" * 4000, "ok", "next")[2:]])
    assert back.cache.outcome is CacheOutcome.RESTORED and back.cache.restored_from == "A"
    back.release(TurnEnd.COMPLETED, 1300)


async def test_a_first_small_request_then_the_conversation_keeps_the_conversation(client: FakeClient,
                                                                                  store: SnapshotStore) -> None:
    """OpenCode's order: its title request comes first under the new conversation's id, then the conversation's
    first, much larger request, which shares nothing with it: the larger one is the conversation."""
    from slotkeeper.cache.chain import message_chain

    pool = make_pool(client, store, min_restore_tokens=0)
    title = message_chain([{"role": "system", "content": "You are a title generator."},
                           {"role": "user", "content": "a long task"}])
    first = await pool.acquire(A, title)
    first.release(TurnEnd.COMPLETED, 60, n_prompt=50)
    main = await pool.acquire(A, chain_of("a long task " + "x" * 4000))
    assert not main.side and pool.slots[0].occupant == A
    main.release(TurnEnd.COMPLETED, 1200, n_prompt=1150)


async def test_a_request_that_takes_the_slot_while_a_cut_looks_up_the_index_is_left_alone(
        store: SnapshotStore, slot_dir: Path) -> None:
    """The cut of an idle slot first asks the index whether its system part is saved already; a request may lease
    the slot while it waits for the answer. The cut then leaves the slot to the request: it neither cuts nor saves
    the request's state as the system state, nor frees the slot under the request (a CI run saw both: the system
    state saved with the request's 504 tokens, and the request's turn never saved)."""
    from slotkeeper.cache.systemprompt import system_prompt_of

    system = system_prompt_of({"messages": [SYS_MSG, {"role": "user", "content": "hello"}]})
    assert system is not None
    client = CutClient(slot_dir)
    pool = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1)  # type: ignore[arg-type]
    lease = await pool.acquire(A, chain_of("a1"), system=system)
    assert lease.cut_system
    lease.release(TurnEnd.COMPLETED, 120, n_prompt=100)
    slot = pool.slots[0]
    slot.dirty = False  # as after its idle save, which hands the slot to the cut next
    assert slot.cut is system

    answer = asyncio.Event()
    looked_up = asyncio.Event()
    lookup = pool.snapshots.get

    async def slow_get(key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> object:
        looked_up.set()
        await answer.wait()
        return await lookup(key, kind)

    pool.snapshots.get = slow_get  # type: ignore[method-assign]
    cut = asyncio.create_task(pool.warmups.cut_back(slot))
    await looked_up.wait()
    taken = await pool.acquire(B, chain_of("b1"))
    answer.set()
    await cut
    assert client.cuts == [] and pool.warmups.cuts == 0
    assert slot.busy and slot.occupant == B  # still the request's
    assert store.get(SessionKey("m", system.digest), SnapshotKind.SYSTEM) is None
    taken.release(TurnEnd.COMPLETED, 60, n_prompt=50)
    assert not slot.busy and slot.dirty  # B's turn is there to be saved
    await pool.aclose()


async def test_hot_turns_keep_a_pending_cut_until_the_conversation_pauses(store: SnapshotStore,
                                                                           slot_dir: Path) -> None:
    """An agent's tool loop: turn after turn comes back hot before the slot idles; the system part is cut once it
    pauses, not forgotten."""
    from slotkeeper.cache.systemprompt import system_prompt_of

    system = system_prompt_of({"messages": [SYS_MSG, {"role": "user", "content": "hello"}]})
    assert system is not None
    client = CutClient(slot_dir)
    pool = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=0.3)  # type: ignore[arg-type]
    history = ["a1"]
    for turn_number in range(3):
        lease = await pool.acquire(A, chain_of(*history), system=system)
        assert lease.cut_system and (turn_number == 0 or lease.cache.outcome is CacheOutcome.HOT)
        client.save_tokens = 120
        lease.release(TurnEnd.COMPLETED, 120, n_prompt=100)
        history += ["tool call", f"tool output {turn_number}"]
    assert pool.warmups.cuts == 0
    assert await eventually(lambda: pool.warmups.cuts == 1)
    await pool.aclose()


async def test_one_session_never_holds_two_slots_when_two_free_up_in_one_step(
        client: FakeClient, store: SnapshotStore) -> None:
    """Confirmed at 99614b5 (#38): two queued requests of one session and two slots freed in the same event-loop
    step got one slot each, as a slot became the session's only once its request resumed. Both slots then held the
    session, and whichever was saved last became its only state. The second request must wait for the first's
    slot."""
    pool = make_pool(client, store, n_slots=2)
    x, y = await pool.acquire(B), await pool.acquire(C)
    first = asyncio.ensure_future(pool.acquire(A))
    second = asyncio.ensure_future(pool.acquire(A))
    await asyncio.sleep(0)
    x.release(TurnEnd.COMPLETED, 10)  # both slots free in one step: no await between
    y.release(TurnEnd.COMPLETED, 10)
    lease = await first
    await asyncio.sleep(0.05)
    assert not second.done()  # it waits for the session's slot, although the other one is free
    assert [s.slot_id for s in pool.slots if s.occupant == A] == [lease.slot_id]
    lease.release(TurnEnd.COMPLETED, 20)
    again = await second
    assert again.slot_id == lease.slot_id and again.cache.outcome is CacheOutcome.HOT
    again.release(TurnEnd.COMPLETED, 30)
    assert [s.slot_id for s in pool.slots if s.occupant == A] == [lease.slot_id]


async def test_a_claimed_slot_is_given_up_when_its_request_is_cancelled_before_it_runs(
        client: FakeClient, store: SnapshotStore) -> None:
    pool = make_pool(client, store, n_slots=2)
    x, y = await pool.acquire(B), await pool.acquire(C)
    first = asyncio.ensure_future(pool.acquire(A))
    second = asyncio.ensure_future(pool.acquire(A))
    await asyncio.sleep(0)
    x.release(TurnEnd.COMPLETED, 10)
    first.cancel()  # handed slot 0, cancelled before it resumed: the slot goes back, unclaimed
    with pytest.raises(asyncio.CancelledError):
        await first
    lease = await asyncio.wait_for(second, 1)
    assert lease.slot_id == 0 and [s.claimed for s in pool.slots] == [A, C]
    lease.release(TurnEnd.COMPLETED, 10)
    y.release(TurnEnd.COMPLETED, 10)
    assert all(s.claimed is None for s in pool.slots)


async def test_an_idle_save_whose_commit_fails_keeps_the_turn_in_the_slot(
        store: SnapshotStore, slot_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Likely at 99614b5 (#38): the idle save reports success once the backend wrote the file, before the commit;
    a commit that then fails (a full disk) must not let the slot be cut back to its system part, which would drop
    the conversation's only copy of its turn. The slot keeps it, changed, for the next save (a switch, the exit)."""
    import errno

    from slotkeeper.cache.systemprompt import system_prompt_of

    system = system_prompt_of({"messages": [SYS_MSG, {"role": "user", "content": "hello"}]})
    assert system is not None
    client = CutClient(slot_dir)
    pool = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=0.01)  # type: ignore[arg-type]

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "commit", full)
    lease = await pool.acquire(A, chain_of("a1"), system=system)
    assert lease.cut_system
    client.save_tokens = 120
    lease.release(TurnEnd.COMPLETED, 120, cache_n=0, n_prompt=100)
    assert await eventually(lambda: len(client.actions("save")) >= 1)
    await asyncio.sleep(0.2)
    await pool.snapshots.settle()
    slot = pool.slots[0]
    assert await eventually(lambda: slot.dirty)  # saved again by the next switch or at exit
    assert client.cuts == [] and pool.warmups.cuts == 0  # not cut back: the turn is only in the slot
    assert slot.occupant == A
    monkeypatch.undo()
    other = await pool.acquire(B, chain_of("b1"))  # the switch saves A's turn, now that the disk has room
    other.release(TurnEnd.COMPLETED, 10)
    await pool.snapshots.settle()
    saved = store.get(A)
    assert saved is not None and saved.n_tokens == 120
    await pool.aclose()


@pytest.mark.parametrize("operation", ["clear", "flush"])
@pytest.mark.parametrize("fails", [False, True])
async def test_a_clear_during_an_idle_saves_commit_answers_once_the_state_is_on_disk(
        client: FakeClient, store: SnapshotStore, monkeypatch: pytest.MonkeyPatch, fails: bool,
        operation: str) -> None:
    """Found by CI (test_odd_session_ids_are_just_names, a loaded machine): an idle save gives its slot back once the
    backend wrote the file, before the commit; an operator's clear that took the slot then saw it unchanged, erased
    it and answered while the commit was still running, so the session list read next lacked the state. The clear
    waits for that commit, and when the commit failed (the slot held the turn's only copy) it saves the slot again;
    so does the flush at exit."""
    import errno
    import threading

    pool = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=0.01)  # type: ignore[arg-type]
    committing, go_on = threading.Event(), threading.Event()
    commit = store.commit

    def slow(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(store, "commit", commit)  # only the idle save's commit is held back
        committing.set()
        go_on.wait(10)
        if fails:
            raise OSError(errno.ENOSPC, "No space left on device")
        return commit(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "commit", slow)
    lease = await pool.acquire(A, chain_of("a1"))
    lease.release(TurnEnd.COMPLETED, 50)
    assert await eventually(committing.is_set)
    done = asyncio.create_task(clear_slot(pool, 0) if operation == "clear" else flush(pool))
    await asyncio.sleep(0.2)
    assert not done.done()  # waiting for the commit
    go_on.set()
    await done
    assert store.get(A) is not None
    assert len(client.actions("save")) == 1 + fails  # a failed commit: saved again
    assert pool.slots[0].occupant is (None if operation == "clear" else A)
    await pool.aclose()


@pytest.mark.parametrize("kind", ["dense", "recurrent", "hybrid", "swa"])
async def test_a_compacted_conversation_that_keeps_its_system_prompt_stays_the_conversation(
        client: FakeClient, store: SnapshotStore, kind: str) -> None:
    """Likely at 99614b5 (#38): on a recurrent, hybrid or SWA backend the slot's messages a request shares count as
    none unless it keeps all of them (such a slot rolls back only to its checkpoints), so a conversation compacted
    far below its state (its system prompt, then a summary) ran as a one-off side request, and its state was kept
    only among its model's side states. What the request shares is counted in messages, whatever the backend can
    roll back to: it stays the conversation, and its state is the conversation's own."""
    from slotkeeper.cache.capability import ArchKind, Capability

    pool = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1,  # type: ignore[arg-type]
                    capability=Capability("x", ArchKind(kind), kind == "dense"))
    long = chain_of("a long task " + "x" * 4000, "an answer " + "y" * 4000)
    lease = await pool.acquire(A, long)
    lease.release(TurnEnd.COMPLETED, 2200, cache_n=0, n_prompt=2150)
    compacted = chain_of("a summary of the task so far")
    again = await pool.acquire(A, compacted)
    assert not again.side and pool.slots[0].occupant == A
    again.release(TurnEnd.COMPLETED, 60, n_prompt=50)
    other = await pool.acquire(B, chain_of("b1"))  # the switch saves A's compacted state as A's
    other.release(TurnEnd.COMPLETED, 10)
    await pool.snapshots.settle()
    saved = store.get(A)
    assert saved is not None and store.chain_of(saved) == compacted
    await pool.aclose()
