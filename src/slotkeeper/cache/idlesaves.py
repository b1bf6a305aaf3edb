"""Idle saves: a slot whose state changed in a turn is saved once it stayed idle for a while, so that the next
request that needs the slot (another conversation's) finds the state on disk already and waits for no save.

The pool schedules one after each turn that leaves a slot changed; this module owns the timers. A save takes the
slot as a turn would (nothing else uses it meanwhile) and gives it back through the pool, so a request that queued
for it meanwhile gets it at once. After the save, a slot whose conversation should be cut back to its system part is
handed to the warm-ups (warmups.py). See docs/design-pool.md for why a save waits while another slot generates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from slotkeeper.cache.saving import Saver
from slotkeeper.cache.slots import Held, SlotState
from slotkeeper.types import SnapshotKind
from slotkeeper.upstream.health import BackendHealth

# The shortest idle time before a changed slot is saved (when --save-idle-seconds is longer): an agent's next request
# after a quick tool call, or a side task right after the answer, comes back within it and waits for no save.
IDLE_SAVE_FLOOR_SECONDS = 0.25


class IdleSaves:
    def __init__(self, saver: Saver, slots: Sequence[SlotState], save_idle_seconds: float,
                 health: BackendHealth | None, give_back: Callable[[SlotState], None],
                 cut_back: Callable[[SlotState], Awaitable[None]],
                 side_task_follows: Callable[[SlotState], bool]) -> None:
        self._saver = saver
        self._slots = slots
        # The longest a changed slot stays idle unsaved; negative: never saved when idle (only on a switch, at exit).
        self._save_idle_seconds = save_idle_seconds
        # Whether the backend is up: an idle save waits for it, and one that failed while it was away is tried again.
        self._health = health
        # The pool's: a slot taken for a save is handed back through it (so a waiting request gets it at once).
        self._give_back = give_back
        self._cut_back = cut_back  # the warm-ups': what a saved slot marked for a cut goes through next
        # The pool's: whether a side task is expected to take the slot right after its occupant's turn.
        self._side_task_follows = side_task_follows
        self._timers: set[asyncio.Task[None]] = set()

    def schedule(self, slot: SlotState) -> None:
        """The slot's state changed in a turn that just ended: save it once it stayed idle long enough."""
        if self._save_idle_seconds < 0:
            return
        self._in_background(self._save_when_idle(slot, slot.generation))

    def delay(self, slot: SlotState) -> float:
        """How long a changed slot stays idle before it is saved: `save_idle_seconds` at most; a state the backend
        writes quickly sooner, after twice its expected save time and at least IDLE_SAVE_FLOOR_SECONDS. A
        conversation that comes back within that finds its slot unsaved and hot; one that comes back later, or
        another conversation that needs the slot, finds the state on disk already and waits for no save. A side
        task's state is saved at once: no conversation comes back to it, and the next request, which needs the slot,
        often follows within milliseconds (OpenWebUI's tasks, one after another). So is a conversation's whose slot
        a side task took right after its last turn: OpenWebUI sends its follow-up and tag tasks after every answer,
        and each would otherwise wait for the save."""
        cap = self._save_idle_seconds
        if self._at_once(slot):
            return 0.0
        expected = self._saver.expected_seconds(slot.n_tokens)
        if expected is None:
            return cap
        return min(cap, max(IDLE_SAVE_FLOOR_SECONDS, 2 * expected))

    def _at_once(self, slot: SlotState) -> bool:
        return slot.kind is SnapshotKind.SIDE or self._side_task_follows(slot)

    async def aclose(self) -> None:
        """Stop the timers (and the saves and cuts they run), and wait until they are stopped."""
        for task in list(self._timers):
            task.cancel()
        await asyncio.gather(*self._timers, return_exceptions=True)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` as a task kept here (aclose cancels and awaits them)."""
        task = asyncio.get_running_loop().create_task(work)
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    async def _save_when_idle(self, slot: SlotState, generation: int) -> None:
        at_once, delay = self._at_once(slot), self.delay(slot)
        await asyncio.sleep(delay)
        if delay < self._save_idle_seconds and any(s.busy for s in self._slots if s is not slot):
            # The backend writes a slot between decode steps of every slot: while another slot generates, the save
            # pauses it (docs/design-pool.md), so it waits the full idle time as it always did.
            await asyncio.sleep(self._save_idle_seconds - delay)
        if self._health is not None:
            await self._health.wait_up()  # a save sent to a backend that is away would fail and lose the turn
        if slot.busy or slot.generation != generation or not slot.dirty or slot.occupant is None:
            return
        key = slot.occupant
        commit = await self._save_held(slot)
        if commit is None:
            return
        # The slot was given back once the backend wrote the file; what comes next waits for the commit: until it
        # lands, the slot holds the conversation's only copy of its turn.
        if not await asyncio.shield(commit):
            # Still the same turn's state (no lease since; an operator's clear may hold the slot, waiting for this):
            # the next switch, the clear or the exit saves it again (no retry loop on a full disk).
            if slot.generation == generation and slot.occupant == key:
                slot.dirty = True
            return
        if slot.cut is not None and slot.generation == generation and not at_once:
            # Not after a save at once: the side task expected next would wait for the cut. As when such a task
            # takes the slot before the idle save, the conversation's next turn marks the slot for the cut again.
            await self._cut_back(slot)

    async def _save_held(self, slot: SlotState) -> asyncio.Task[bool] | None:
        """Take an idle slot, save its dirty occupant, and give the slot back once the backend wrote it; returns
        the commit going on (its result: whether the state is on disk), or None when the backend's write failed. A
        save that failed because the backend went away leaves the slot changed, saved once the backend is back (or
        forgotten, if it restarted)."""
        key = slot.occupant
        assert key is not None
        slot.busy = True
        slot.dirty = False
        generation = slot.generation
        commit = None
        try:
            commit = await self._saver.start(slot.slot_id, key, Held.of(slot))
        finally:
            self._give_back(slot)
        if (commit is None and self._health is not None and not self._health.up and slot.generation == generation
                and slot.occupant == key and not slot.busy):
            slot.dirty = True
            self.schedule(slot)
        return commit
