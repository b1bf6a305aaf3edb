"""The writes still pending on each snapshot (snapshots.py): background commits of saves, imports, records of use.

A snapshot's writes land in the order they were started, so of two saves of one session the newer is the one kept,
and an import is ordered with the saves like any other write; a reader of a snapshot waits for its pending writes
(`wait`) before it reads it. A snapshot is named by its `SnapshotId` (`snapshot_id`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from slotkeeper.cache.budget import SnapshotId
from slotkeeper.cache.chain import Link, common_messages
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind

log = logging.getLogger("slotkeeper.pool")


def snapshot_id(key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> SnapshotId:
    return key.model, key.session_id, kind, key.domain


def key_of(snapshot: Snapshot) -> SessionKey:
    return snapshot.key


class PendingWrites:
    """The running background writes, by snapshot; only the newest of each snapshot is kept (it waits for the
    earlier ones before it starts, or with `at_once` before it finishes, whether it succeeded or not)."""

    def __init__(self) -> None:
        self._tasks: dict[SnapshotId, asyncio.Task[bool]] = {}
        # The message chain each snapshot will have once its pending commit lands (for prefix lookups).
        self._chains: dict[SnapshotId, Sequence[Link]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, snapshot: object) -> bool:
        return snapshot in self._tasks

    def current(self, snapshot: SnapshotId) -> asyncio.Task[bool] | None:
        """The snapshot's newest pending write, if any."""
        return self._tasks.get(snapshot)

    def start(self, snapshot: SnapshotId, write: Callable[[], Coroutine[Any, Any, bool]],
              chain: Sequence[Link] | None = None, *, at_once: bool = False) -> asyncio.Task[bool]:
        """Run `write()` in the background once the snapshot's earlier writes are done (`at_once`: right away, the
        write then waits for `current()` itself before the part that must come after them); the task's result is
        whether it succeeded. `write` handles its own failures; one that escapes anyway is logged here. `chain`:
        the message chain a commit will index with the snapshot."""
        earlier = self._tasks.get(snapshot)
        if chain is not None:
            self._chains[snapshot] = chain

        async def run() -> bool:
            if earlier is not None and not at_once:
                await asyncio.wait({earlier})
            try:
                return await write()
            finally:
                # Never done before an earlier write of the snapshot (a write that failed early, at once): the
                # snapshot's entry, which readers wait on and the next write orders itself after, stays until
                # every write of it is done.
                if earlier is not None and not earlier.done():
                    await asyncio.wait({earlier})

        task = asyncio.get_running_loop().create_task(run(), name=f"write {snapshot[0]}/{snapshot[1]}")
        self._tasks[snapshot] = task
        task.add_done_callback(lambda done: self._finished(snapshot, done))
        return task

    def _finished(self, snapshot: SnapshotId, task: asyncio.Task[bool]) -> None:
        if self._tasks.get(snapshot) is task:
            del self._tasks[snapshot]
            self._chains.pop(snapshot, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a background write of %s/%s failed", snapshot[0], snapshot[1], exc_info=exc)

    def sharing(self, chain: Sequence[Link], min_messages: int) -> list[SnapshotId]:
        """The states with a pending commit whose chain shares at least `min_messages` leading messages
        with `chain`: the ones a prefix lookup for it could find once they are committed."""
        return [s for s, pending in self._chains.items() if common_messages(pending, chain) >= min_messages]

    async def wait(self, snapshots: Iterable[SnapshotId] | None = None, timeout: float | None = None) -> bool:
        """Wait for the writes of `snapshots` (every snapshot's, with None) started so far; True when they all
        finished. A timeout, or the caller being cancelled, leaves them running."""
        if snapshots is None:
            tasks = set(self._tasks.values())
        else:
            tasks = {task for s in snapshots if (task := self._tasks.get(s)) is not None}
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        return not pending
