"""Watches the backend: probes /health into the BackendHealth, and tells a restarted server (its slots hold nothing)
from one that was only slow (its slots still hold their state) by the task ids its /slots shows.

llama.cpp numbers tasks from 0 in each process, and a slot that ran no task since the process started shows no
`id_task` (the binary and the embedded server alike). So a slot whose `id_task` went missing or back is a sign of
another process; the same ids, or higher ones, are the same process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from slotkeeper.cache.pool import SlotPool
from slotkeeper.errors import SlotkeeperError
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.health import BackendHealth, Probe

log = logging.getLogger("slotkeeper.watch")

TaskIds = dict[int, int | None]


class BackendWatch:
    def __init__(self, client: UpstreamClient, pool: SlotPool, health: BackendHealth, interval: float = 1.0) -> None:
        self._client = client
        self._pool = pool
        self.health = health
        self._interval = interval
        # Called, with no await before it, when the backend is found to be another process (kvcheck.py).
        self.on_restart: Callable[[], None] | None = None
        self._tasks: TaskIds | None = None  # each slot's id_task at the last reading of /slots
        self._tasks_recoveries = 0  # health.recoveries then: after a recovery the watch did not see, it is stale

    def forget(self) -> None:
        """The backend is a new process slotkeeper started on purpose (its model was loaded again: swaps.py), whose
        slots were already forgotten: its first reading is not compared with the old process's."""
        self._tasks = None

    async def run(self) -> None:
        while True:
            await self.check()  # the first reading at once: a restart in the first second is another process too
            await asyncio.sleep(self._interval)

    async def check(self) -> None:
        observed = self._pool.generations()  # taken before any await: a reset applies only to slots unchanged since
        changes = self.health.changes  # and a reading decides nothing if the health changed while it was taken
        held = self._held()
        probe = await self._client.probe()
        if changes != self.health.changes:
            return
        self.health.probed(probe)
        if probe is not Probe.OK:
            return
        tasks = await self._task_ids()
        if changes != self.health.changes:
            return
        # After a recovery the watch did not make (the supervisor's restart), the last reading is of the old process.
        previous = self._tasks if self._tasks_recoveries == self.health.recoveries else None
        self._judge(observed, held, previous, tasks)
        if tasks is not None:
            self._tasks, self._tasks_recoveries = tasks, self.health.recoveries

    def _judge(self, observed: dict[int, int], held: set[int], previous: TaskIds | None,
               tasks: TaskIds | None) -> None:
        """Decide on one answered probe: whether the backend is another process than at the last reading, and so
        whether what the slots held is gone."""
        other_process = tasks is not None and _restarted(previous or {}, tasks, held)
        if not self.health.up:
            lost = self.health.lost or other_process or (tasks is None and self.health.refused)
            self.recovered(observed, lost, "the backend restarted" if other_process else "the backend was away")
            if lost:
                return
        elif other_process:
            log.warning("the backend at %s restarted (its slots show other tasks than before); no slot state it "
                        "held is trusted", self._client.base_url)
            self._pool.reset_slots(observed, "the backend restarted")
            self._restarted()
            return
        if tasks is not None:
            # A slot that never ran a task since the server started holds nothing (a restart between two probes).
            fresh = {i for i, task in tasks.items() if task is None}
            self._pool.reset_slots({i: g for i, g in observed.items() if i in fresh}, "the backend restarted")

    def recovered(self, observed: dict[int, int], lost: bool, reason: str) -> None:
        """The backend answers again: when what its slots held is gone (`lost`), forget it for the slots unused since
        `observed`; otherwise keep every slot's state (and its unsaved changes). Then serve again."""
        if self.health.up:
            return
        if lost:
            log.warning("the backend is back (%s): no slot state it held is trusted, sessions restore from disk",
                        reason)
            self._pool.reset_slots(observed, reason)
            self._restarted()  # before requests go on: its KV settings are checked again
        else:
            log.warning("the backend is back, the same server process as before: the slots keep their state and "
                        "their unsaved turns")
        self.health.mark_up()

    def _restarted(self) -> None:
        if self.on_restart is not None:
            self.on_restart()

    def _held(self) -> set[int]:
        """The slots the pool counts as holding something, which ran a task on the backend: each shows an id_task (a
        slot cut back to its system part holds that part, though no session)."""
        return {slot.slot_id for slot in self._pool.slots
                if (slot.occupant is not None or slot.n_tokens > 0) and not slot.busy}

    async def _task_ids(self) -> TaskIds | None:
        try:
            slots = await self._client.get_json("/slots", timeout=2.0)
        except SlotkeeperError:
            return None
        if not isinstance(slots, list):
            return None
        return {int(s["id"]): _task_id(s) for s in slots if isinstance(s, dict) and "id" in s}


def _task_id(slot: dict[str, Any]) -> int | None:
    task = slot.get("id_task")
    return int(task) if isinstance(task, int) and task >= 0 else None


def _restarted(before: TaskIds, now: TaskIds, held: set[int]) -> bool:
    """Whether `now` comes from another process than `before`: a slot that ran a task (at the last reading, or a slot
    in `held`) shows none, or an older one."""
    if any(slot_id in now and now[slot_id] is None for slot_id in held):
        return True
    for slot_id, task in before.items():
        later = now.get(slot_id)
        if task is not None and (later is None or later < task):
            return True
    return False
