"""The persister: turns a slot's state into a snapshot, and keeps the index's bookkeeping (a restore's use, the disk
budget), taking off the turn's path whatever the turn need not wait for.

A save has two parts. First the backend writes the slot's state to a temporary file: the slot must wait for that,
since its next turn changes what would be written. Then the commit makes that file the snapshot (fsync, rename,
checksum, index: SnapshotStore.commit) and applies the disk budget, in one worker-thread call. Only the snapshot's
readers need to wait for the commit, so a save that hands its slot on (`wait=False`) leaves it running in the
background (commits.py), and every reader of a snapshot waits for its pending writes first (`settle`).

What is reported, where:
- `save()`'s return value (a lease's and a request's `save_ms`): the time the caller waited; with `wait=False` that
  is the backend's write only.
- `saves`, `failed_saves`, `events.saved` (the save-duration histogram) and the "saved slot" log line: once the
  commit is done (or failed), with the time from the start of the save until the snapshot was durable and indexed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from slotkeeper.cache.budget import DiskBudget, SnapshotId
from slotkeeper.cache.chain import Link
from slotkeeper.cache.commits import PendingWrites
from slotkeeper.cache.events import CacheEvents
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.errors import SnapshotError, UpstreamError, UpstreamUnavailable
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.upstream.client import SlotActionResult, UpstreamClient

log = logging.getLogger("slotkeeper.pool")


def snapshot_id(key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> SnapshotId:
    return key.model, key.session_id, kind


def key_of(snapshot: Snapshot) -> SessionKey:
    return SessionKey(snapshot.model, snapshot.session_id)


class Persister:
    def __init__(self, client: UpstreamClient, store: SnapshotStore, fingerprint: str, budget: DiskBudget,
                 events: CacheEvents, occupants: Callable[[], Iterable[SessionKey]],
                 inspect: Callable[[Snapshot], None] | None = None) -> None:
        self._client = client
        self._store = store
        self._fingerprint = fingerprint
        self.budget = budget
        self.events = events
        # The sessions the slots hold now: the budget never evicts their snapshots.
        self._occupants = occupants
        # Called in the commit's worker thread with each new snapshot (the pool learns from saved files).
        self._inspect = inspect
        self._writes = PendingWrites()
        self.saves = 0
        self.failed_saves = 0
        self.evictions = 0

    # -- saving ---------------------------------------------------------------------------------------------

    async def save(self, slot_id: int, key: SessionKey, chain: Sequence[Link],
                   kind: SnapshotKind = SnapshotKind.SESSION, *, wait: bool = True, n_prompt: int = 0) -> float:
        """Save the slot's state as `key`'s snapshot; with `wait`, until it is on disk and indexed, else only until
        the backend wrote it. Returns the milliseconds waited, or 0 when the save failed: a failure is logged and
        counted, and costs only the snapshot's freshness (the previous snapshot stays)."""
        started = time.perf_counter()
        commit = await self.start_save(slot_id, key, chain, kind, n_prompt=n_prompt)
        if commit is None or (wait and not await asyncio.shield(commit)):
            return 0.0
        return (time.perf_counter() - started) * 1000

    async def start_save(self, slot_id: int, key: SessionKey, chain: Sequence[Link],
                         kind: SnapshotKind = SnapshotKind.SESSION, *, n_prompt: int = 0) -> asyncio.Task[bool] | None:
        """Have the backend write the slot's state, and commit it as `key`'s snapshot in the background. Returns the
        commit's task (its result: whether the save succeeded, failures logged and counted), or None when the
        backend's write failed. The commit goes on if the caller stops waiting for it."""
        temp = self._store.temp_name(key, self._fingerprint, kind)
        started = time.perf_counter()
        written: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        sid = snapshot_id(key, kind)
        earlier = self._writes.current(sid)

        async def write() -> bool:
            ok = False
            try:
                result = await self._backend_save(slot_id, key, temp)
                ok = True
            except (UpstreamError, UpstreamUnavailable) as exc:
                await asyncio.to_thread(self._store.discard_temp, temp)
                self._failed(slot_id, key, exc.message)
                return False
            finally:
                if not written.done():  # the caller waits for this part only, unless it asked to wait for all
                    written.set_result(ok)
            if earlier is not None:  # commits of one snapshot land in the order its saves were made
                await asyncio.wait({earlier})
            return await self._commit(slot_id, key, temp, result, chain, kind, started, n_prompt)

        # The whole save is one pending write, from before the backend writes the file: a reader of the snapshot
        # (the session back on another slot while its old slot is being saved) waits for it, never reads the
        # snapshot the save replaces. Shielded: a caller that gives up waiting does not stop the save.
        done = self._writes.start(sid, write, chain, at_once=True)
        return done if await asyncio.shield(written) else None

    async def _backend_save(self, slot_id: int, key: SessionKey, temp: str) -> SlotActionResult:
        """Have the backend write the slot into `temp`: into the RAM dir when there is one with room; a save there
        that fails (the tmpfs may have filled up) is tried once more straight into the slot dir."""
        # Plain syscalls on a memory file system (statvfs, maybe a symlink): not worth a worker thread.
        in_ram = self._store.prepare_save(temp)
        try:
            return await self._client.slot_action(slot_id, "save", temp)
        except UpstreamError as exc:
            if not in_ram:
                raise
            log.warning("saving slot %d as %s into the RAM dir failed (%s); saving it to disk instead", slot_id,
                        key, exc.message)
        await asyncio.to_thread(self._store.discard_temp, temp)
        self._store.prepare_save(temp, to_disk=True)
        return await self._client.slot_action(slot_id, "save", temp)

    async def _commit(self, slot_id: int, key: SessionKey, temp: str, result: SlotActionResult,
                      chain: Sequence[Link], kind: SnapshotKind, started: float, n_prompt: int) -> bool:
        keep = self._budget_keep({snapshot_id(key, kind)})
        try:
            evicted = await asyncio.to_thread(self._commit_now, key, temp, result, chain, kind, keep, n_prompt)
        except Exception as exc:  # whatever it is, it must not escape a background task unlogged
            self._failed(slot_id, key, exc.message if isinstance(exc, SnapshotError) else repr(exc))
            return False
        elapsed = (time.perf_counter() - started) * 1000
        self.evictions += evicted
        self.saves += 1
        self.events.saved(elapsed, result.n_bytes, result.n_tokens)
        log.info("saved slot %d as %s%s: %d tokens, %d bytes, %.1f ms", slot_id,
                 "the system snapshot " if kind is SnapshotKind.SYSTEM else "", key, result.n_tokens, result.n_bytes,
                 elapsed)
        return True

    def _commit_now(self, key: SessionKey, temp: str, result: SlotActionResult, chain: Sequence[Link],
                    kind: SnapshotKind, keep: set[SnapshotId], n_prompt: int) -> int:
        """In a worker thread: commit, then enforce the budget; returns how many snapshots the budget evicted."""
        try:
            snapshot = self._store.commit(key, temp, self._fingerprint, result.n_tokens, chain, result.n_bytes, kind,
                                          n_prompt)
        except BaseException:
            self._store.discard_temp(temp)
            raise
        if self._inspect is not None:
            try:
                self._inspect(snapshot)
            except Exception as exc:  # learning about the build must never fail a save
                log.warning("inspecting the saved file of %s failed: %s", key, exc)
        return self._enforce_budget_now(keep)

    async def commit_import(self, key: SessionKey, temp: str, n_tokens: int, chain: Sequence[Link], n_bytes: int,
                            kind: SnapshotKind, n_prompt: int) -> Snapshot:
        """Make an uploaded file (`temp`, checked) `key`'s snapshot, as one of the snapshot's writes: after the saves
        of it started before (none of them lands over it), before any started later. Raises what the commit raises
        (the temp file is then discarded). The commit goes on if the caller stops waiting for it."""
        committed: asyncio.Future[Snapshot] = asyncio.get_running_loop().create_future()

        async def write() -> bool:
            try:
                snapshot = await asyncio.to_thread(self._store.commit, key, temp, self._fingerprint, n_tokens, chain,
                                                   n_bytes, kind, n_prompt)
            except Exception as exc:
                await asyncio.to_thread(self._store.discard_temp, temp)
                committed.set_exception(exc)
                return False
            except BaseException:
                committed.cancel()  # the write was cancelled: its caller must not wait forever
                raise
            committed.set_result(snapshot)
            return True

        self._writes.start(snapshot_id(key, kind), write, chain)
        return await asyncio.shield(committed)

    def _failed(self, slot_id: int, key: SessionKey, reason: str) -> None:
        self.failed_saves += 1
        log.error("saving slot %d as %s failed: %s", slot_id, key, reason)

    # -- bookkeeping ------------------------------------------------------------------------------------------

    def used(self, snapshot: Snapshot) -> None:
        """Record a restore of `snapshot` (its last use and hits, for the budget's LRU order), in the background,
        in order with the snapshot's other writes: the turn need not wait for it."""
        key = key_of(snapshot)
        self._writes.start(snapshot_id(key, snapshot.kind), lambda: self._mark_used(key, snapshot.kind))

    async def _mark_used(self, key: SessionKey, kind: SnapshotKind) -> bool:
        try:
            await asyncio.to_thread(self._store.mark_used, key, kind)
        except Exception as exc:  # bookkeeping: it never fails anything
            log.error("recording the use of snapshot %s failed: %s", key, exc)
            return False
        return True

    async def enforce_budget(self, also_keep: set[SnapshotId] | None = None) -> int:
        """Evict what the disk budget does not allow, never a snapshot whose session a slot holds (nor `also_keep`).
        Returns how many were evicted; a failure is logged and leaves everything in place."""
        if not self.budget.limited:
            await asyncio.to_thread(self._trim_quarantine_now)  # quarantined files age out even so
            return 0
        evicted = await asyncio.to_thread(self._enforce_budget_now, self._budget_keep(also_keep))
        self.evictions += evicted
        return evicted

    def _budget_keep(self, also_keep: set[SnapshotId] | None) -> set[SnapshotId]:
        keep = set(also_keep or ())
        keep.update(snapshot_id(key) for key in self._occupants())
        return keep

    def _trim_quarantine_now(self) -> None:
        try:
            self._store.trim_quarantine(self.budget)
        except Exception as exc:  # housekeeping: it never fails anything
            log.error("removing old quarantined files failed: %s", exc)

    def _enforce_budget_now(self, keep: set[SnapshotId]) -> int:
        """In a worker thread: the store's budget enforcement; returns how many it evicted."""
        if not self.budget.limited:
            return 0
        try:
            return len(self._store.enforce_budget(self.budget, keep))
        except Exception as exc:  # the budget is housekeeping: it must never fail a turn
            log.error("enforcing the disk budget failed: %s", exc)
            return 0

    # -- waiting for pending writes -----------------------------------------------------------------------------

    async def settle(self, snapshots: Iterable[SnapshotId] | None = None, timeout: float | None = None) -> bool:
        """Wait for the pending writes of `snapshots` (of every snapshot with None) started so far; True when they
        all finished. A timeout, or the caller being cancelled, leaves them running."""
        return await self._writes.wait(snapshots, timeout)

    def pending(self, snapshot: SnapshotId) -> bool:
        return snapshot in self._writes

    def pending_sharing(self, chain: Sequence[Link], min_messages: int) -> list[SnapshotId]:
        """Session snapshots with a pending commit that a prefix lookup for `chain` could find once committed."""
        return self._writes.sharing(chain, min_messages) if chain else []
