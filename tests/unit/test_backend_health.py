"""The backend's health with a fake backend: what counts as down (not one slow probe), requests that wait for the
backend (and the bound on it), and a backend that was only slow keeping its slots' unsaved state, while one that
restarted (its /slots show other tasks) loses it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.errors import UpstreamUnavailable
from slotkeeper.serving.service import TurnService
from slotkeeper.serving.watch import BackendWatch
from slotkeeper.upstream.health import BackendHealth, Probe
from tests.unit.test_pool import FP, FakeClient, key

A, B = key("A"), key("B")


class FlakyBackend(FakeClient):
    """A fake backend whose /health answers come from `probes` (then OK), whose /slots shows `task_ids`, and which
    answers chat requests while `up`."""

    base_url = "http://fake"

    def __init__(self, slot_dir: Path) -> None:
        super().__init__(slot_dir)
        self.probes: list[Probe] = []
        self.task_ids: dict[int, int | None] = {0: None}
        self.up = True
        self.next_task = 1

    async def probe(self, timeout: float = 2.0) -> Probe:
        return self.probes.pop(0) if self.probes else Probe.OK

    async def healthy(self) -> bool:
        return await self.probe() is Probe.OK

    async def get_json(self, path: str, *, timeout: float | None = 10.0) -> Any:
        assert path == "/slots"
        return [{"id": i, "n_ctx": 4096, **({} if t is None else {"id_task": t})} for i, t in self.task_ids.items()]

    async def post_json(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> Any:
        if not self.up:
            raise UpstreamUnavailable("cannot reach the backend at http://fake (ConnectError: refused)")
        self.task_ids[int(body["id_slot"])] = self.next_task
        self.next_task += 1
        return {"choices": [], "timings": {"cache_n": 0, "prompt_n": 10, "predicted_n": 2}}

    async def slot_action(self, slot_id: int, action: str, filename: str | None = None) -> Any:
        if not self.up:
            raise UpstreamUnavailable("cannot reach the backend at http://fake (ConnectError: refused)")
        return await super().slot_action(slot_id, action, filename)

    def restart(self) -> None:
        """Another process on the same address: no slot ran a task, task ids start again."""
        self.task_ids = {i: None for i in self.task_ids}
        self.next_task = 1


@pytest.fixture
def backend(slot_dir: Path) -> FlakyBackend:
    return FlakyBackend(slot_dir)


class Stack:
    def __init__(self, backend: FlakyBackend, store: SnapshotStore, wait: float, save_idle: float) -> None:
        self.backend = backend
        self.health = BackendHealth(backend.base_url)
        fake: Any = backend
        self.pool = SlotPool(1, fake, Snapshots(store), FP, 4096, save_idle_seconds=save_idle, health=self.health)
        self.service = TurnService(fake, self.pool, self.health, backend_wait=wait)
        self.watch = BackendWatch(fake, self.pool, self.health)

    async def turn(self, k: Any = A, hung_up: Any = None) -> Any:
        def build(slot_id: int) -> dict[str, Any]:
            return {"messages": [{"role": "user", "content": f"hello from {k.session_id}"}], "id_slot": slot_id}

        _, record = await self.service.unary("t", k, "/v1/chat/completions", build, hung_up=hung_up)
        return record


def stack(backend: FlakyBackend, store: SnapshotStore, wait: float = 5.0, save_idle: float = -1) -> Stack:
    return Stack(backend, store, wait, save_idle)


async def test_one_slow_probe_is_not_an_outage_and_a_request_during_it_succeeds(
        backend: FlakyBackend, store: SnapshotStore) -> None:
    s = stack(backend, store, wait=0)  # no waiting: a request fails at once if the backend counts as down
    await s.turn()
    backend.probes = [Probe.NO_ANSWER]
    await s.watch.check()
    assert s.health.up and s.health.outages == 0
    record = await s.turn()
    assert record.status == 200
    assert s.pool.slots[0].occupant == A and s.pool.slots[0].dirty


async def test_probes_that_time_out_in_a_row_mark_it_down_and_one_refusal_at_once(
        backend: FlakyBackend, store: SnapshotStore) -> None:
    s = stack(backend, store)
    backend.probes = [Probe.NO_ANSWER, Probe.NO_ANSWER]
    await s.watch.check()
    await s.watch.check()
    assert s.health.up
    backend.probes = [Probe.OK, Probe.NO_ANSWER, Probe.NO_ANSWER]  # an answer in between starts the count again
    for _ in range(3):
        await s.watch.check()
    assert s.health.up
    backend.probes = [Probe.NO_ANSWER]
    await s.watch.check()
    assert not s.health.up and s.health.outages == 1
    await s.watch.check()  # answers again: up
    assert s.health.up
    backend.probes = [Probe.REFUSED]
    await s.watch.check()
    assert not s.health.up and s.health.outages == 2


async def test_a_request_while_the_backend_is_down_waits_and_succeeds_once_it_is_back(
        backend: FlakyBackend, store: SnapshotStore) -> None:
    s = stack(backend, store, wait=5.0)
    backend.up, backend.probes = False, [Probe.REFUSED]
    await s.watch.check()
    assert not s.health.up
    request = asyncio.create_task(s.turn())
    await asyncio.sleep(0.3)
    assert not request.done()  # waiting, not failed at once
    backend.restart()
    backend.up = True
    await s.watch.check()
    record = await asyncio.wait_for(request, 2)
    assert record.status == 200 and s.health.up


async def test_the_wait_is_bounded_and_ends_in_the_clients_error(backend: FlakyBackend, store: SnapshotStore) -> None:
    s = stack(backend, store, wait=0.3)
    backend.up, backend.probes = False, [Probe.REFUSED]
    await s.watch.check()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(UpstreamUnavailable, match=r"did not come back within 0\.3 s"):
        await s.turn()
    assert 0.25 <= loop.time() - started < 2
    assert s.pool.slots[0].busy is False and s.pool.queue_length == 0  # it never took a slot


async def test_a_client_that_hangs_up_stops_waiting(backend: FlakyBackend, store: SnapshotStore) -> None:
    s = stack(backend, store, wait=30)
    backend.probes = [Probe.REFUSED]
    await s.watch.check()
    gone = False

    async def hung_up() -> bool:
        return gone

    request = asyncio.create_task(s.turn(hung_up=hung_up))
    await asyncio.sleep(0.1)
    gone = True
    with pytest.raises(UpstreamUnavailable, match="hung up"):
        await asyncio.wait_for(request, 2)


async def test_a_slow_backend_keeps_its_slots_dirty_and_the_turn_is_saved_later(
        backend: FlakyBackend, store: SnapshotStore) -> None:
    s = stack(backend, store, save_idle=0.05)
    await s.turn()
    assert s.pool.slots[0].dirty
    backend.probes = [Probe.NO_ANSWER] * 3  # slow, not gone: the same process answers again afterwards
    for _ in range(3):
        await s.watch.check()
    assert not s.health.up
    await asyncio.sleep(0.2)
    assert backend.actions("save") == []  # no save is tried while the backend is away
    await s.watch.check()
    assert s.health.up
    assert s.pool.slots[0].occupant == A and s.pool.slots[0].dirty  # still its state, still to be saved
    await asyncio.sleep(0.2)
    await s.pool.snapshots.settle()
    assert len(backend.actions("save")) == 1
    saved = store.get(A)
    assert saved is not None and saved.n_tokens == backend.save_tokens
    await s.pool.aclose()


async def test_a_backend_that_restarted_during_the_outage_loses_its_slots(
        backend: FlakyBackend, store: SnapshotStore) -> None:
    s = stack(backend, store)
    await s.turn()
    await s.watch.check()  # reads the slots' task ids
    backend.probes = [Probe.NO_ANSWER] * 3
    for _ in range(3):
        await s.watch.check()
    assert not s.health.up
    backend.restart()
    await s.watch.check()
    assert s.health.up
    slot = s.pool.slots[0]
    assert slot.occupant is None and not slot.dirty  # nothing of it is in the new process, nothing to save


async def test_a_restart_between_two_probes_is_seen_by_the_task_ids(
        backend: FlakyBackend, store: SnapshotStore) -> None:
    s = stack(backend, store)
    backend.next_task = 7  # the old process had run a few tasks
    await s.turn()
    await s.watch.check()
    backend.restart()
    backend.task_ids[0] = 1  # another client already ran a task on the new process: the id went back
    await s.watch.check()
    assert s.health.up and s.pool.slots[0].occupant is None and not s.pool.slots[0].dirty


async def test_a_crash_the_supervisor_saw_loses_the_slots_even_if_slots_cannot_be_read(
        backend: FlakyBackend, store: SnapshotStore) -> None:
    s = stack(backend, store)
    await s.turn()
    s.health.mark_down("llama-server exited with signal SIGKILL", lost=True)

    async def no_slots(path: str, *, timeout: float | None = 10.0) -> Any:
        raise UpstreamUnavailable("no /slots")

    backend.get_json = no_slots  # type: ignore[method-assign]
    await s.watch.check()
    assert s.health.up and s.pool.slots[0].occupant is None and not s.pool.slots[0].dirty


async def test_a_turn_on_the_server_the_supervisor_restarted_is_kept(
        backend: FlakyBackend, store: SnapshotStore) -> None:
    """The old process's task ids say nothing of the new one: after the supervisor's restart, a turn the new process
    ran (with a lower task id than the old reading) is not taken for another restart."""
    s = stack(backend, store)
    backend.next_task = 50
    await s.turn()
    await s.watch.check()  # reads task id 50 on slot 0
    s.health.mark_down("llama-server exited with signal SIGKILL", lost=True)
    s.pool.reset_slots(s.pool.generations(), "llama-server exited")
    backend.restart()
    s.health.mark_up()  # the supervisor saw it answer /health
    await s.turn(B)  # task 1 of the new process
    await s.watch.check()
    assert s.pool.slots[0].occupant == B and s.pool.slots[0].dirty
