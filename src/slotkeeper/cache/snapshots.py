"""Snapshots: the one holder of a backend's saved states (index rows, files, RAM-dir copies) and of the writes still
pending on them. Nothing outside `cache/` reaches the store; the slot pool saves and looks up through here, the web
layer lists, reads, pins, deletes, exports and imports through here.

The rule that used to be written out at every call site lives here once: every public method waits for the pending
writes of the snapshots it touches before it reads or writes them, so no caller settles anything.

A save has two parts. First the backend writes the slot's state to a temporary file: the slot must wait for that,
since its next turn changes what would be written. Then the commit makes that file the snapshot (fsync, rename,
checksum, index: SnapshotStore.commit) and applies the disk budget, in one worker-thread call. Only the snapshot's
readers need to wait for the commit, so it runs in the background, as one of the snapshot's pending writes
(`_PendingWrites`): a snapshot's writes land in the order they were started, so of two saves of one session the newer
is the one kept, and an import is ordered with the saves like any other write.

What is reported, where:
- `save()`'s return value (a lease's `save_ms`): the time the caller waited; with `wait=False` that is the backend's
  write only.
- `saves`, `failed_saves`, `events.saved` (the save-duration histogram) and the "saved slot" log line: once the
  commit is done (or failed), with the time from the start of the save until the snapshot was durable and indexed.

Its parts, each in a module of its own: the pending writes per snapshot (pending.py), the look-ups of what a request
could start from (candidates.py), and the snapshots going in and out: imports, exports, uploads (transfers.py).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from slotkeeper.cache import tails
from slotkeeper.cache.blockstore import BlockStore
from slotkeeper.cache.budget import DiskBudget, SnapshotId
from slotkeeper.cache.candidates import Found as Found  # where the rest of the code finds it
from slotkeeper.cache.candidates import Lookups
from slotkeeper.cache.chain import Link
from slotkeeper.cache.events import CacheEvents
from slotkeeper.cache.fingerprint import model_file_identity
from slotkeeper.cache.kvprobe import KvProbe
from slotkeeper.cache.pending import PendingWrites
from slotkeeper.cache.pending import key_of as key_of  # where the rest of the code finds them
from slotkeeper.cache.pending import snapshot_id as snapshot_id
from slotkeeper.cache.quarantine import count as count_quarantined
from slotkeeper.cache.ramdir import RamDir
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.cache.tokens import Tokens
from slotkeeper.cache.transfers import Transfers
from slotkeeper.errors import SnapshotError, UpstreamError, UpstreamUnavailable
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.upstream.client import SlotActionResult, UpstreamClient

log = logging.getLogger("slotkeeper.pool")

# How long an operator's view (listings, counters, /metrics) waits for saves still being committed in the background
# so that it shows them; past this it shows what is indexed so far.
VIEW_WAIT_SECONDS = 5.0
# Snapshots the budget evicted, remembered (newest last) so that their session's next turn can say why it ran cold.
_GONE_KEPT = 4096


class Snapshots:
    """One backend's snapshots. Opened at start (`open`: the directories, the index, a reconcile); the slot pool then
    `attach`es the backend they belong to, which saving and every fingerprint-checked lookup need."""

    def __init__(self, store: SnapshotStore, owns_store: bool = True) -> None:
        self._store = store
        self._owns_store = owns_store  # a view of another backend's store (`sharing`) leaves closing it to that one
        self._writes = PendingWrites()
        self._lookups = Lookups(store, self._writes, self._evicted)
        # Snapshots brought in and handed out (imports, exports, the shared tier's transfers): a part of its own,
        # which waits for the pending writes it needs as every method here does.
        self.transfers = Transfers(store, self._writes)
        self._client: UpstreamClient | None = None
        self._fingerprint = ""
        self.budget = DiskBudget()
        self.events = CacheEvents()
        # The sessions the slots hold now: the budget never evicts their snapshots.
        self._occupants: Callable[[], Iterable[SnapshotId]] = lambda: ()
        # Called in the commit's worker thread with each new snapshot (the pool learns from saved files).
        self._inspect: Callable[[Snapshot], None] | None = None
        # Called on the event loop after each committed save (the shared tier uploads it).
        self.on_commit: Callable[[SessionKey, SnapshotKind], None] | None = None
        # The fencing token of the lease this replica holds on a session (the session directory), if any: the first
        # part of the version of a conversation's save (version.py).
        self.fence: Callable[[SessionKey], int | None] | None = None
        self.saves = 0
        self.failed_saves = 0
        self.evictions = 0
        # Seconds per token of the last backend write (the part of a save the slot waits for), None before one: how
        # long the next save of a slot is expected to take (idle saves, idlesaves.py).
        self.write_seconds_per_token: float | None = None
        self._written: Callable[[int, int, float], None] | None = None
        self._gone: OrderedDict[SnapshotId, None] = OrderedDict()
        self._gone_lock = threading.Lock()  # budget enforcement runs in worker threads, several at once

    @classmethod
    def open(cls, slot_dir: Path, index_path: Path, ram: RamDir | None = None, block_tokens: int = 0) -> Snapshots:
        """Blocking (run it in a worker thread): make the directories, open the index, and drop what a crash left
        behind (reconcile). `block_tokens` > 0: saves are kept as KV blocks of that many tokens and a tail."""
        store = SnapshotStore(slot_dir, index_path, ram, block_tokens)
        try:
            store.reconcile()
        except BaseException:
            store.close()
            raise
        return cls(store)

    def attach(self, client: UpstreamClient, fingerprint: str, budget: DiskBudget, events: CacheEvents,
               occupants: Callable[[], Iterable[SnapshotId]],
               inspect: Callable[[Snapshot], None] | None = None,
               written: Callable[[int, int, float], None] | None = None) -> None:
        """The backend these snapshots belong to, and what the pool lends them: its slots' occupants (kept from the
        budget), its event counters, a look at each saved file, and its cost meter, told of each write the backend
        made (bytes, tokens, ms: costs.py)."""
        self._client, self._fingerprint = client, fingerprint
        self.budget, self.events, self._occupants, self._inspect = budget, events, occupants, inspect
        self._written = written
        self._lookups.attach(fingerprint)
        self.transfers.attach(fingerprint, inspect)

    def refingerprint(self, fingerprint: str) -> None:
        """The backend's fingerprint changed (its KV setting, probed again after it restarted): saves are made, and
        states looked up, under the new one from now on."""
        self._fingerprint = fingerprint
        self._lookups.attach(fingerprint)
        self.transfers.attach(fingerprint, self._inspect)

    def sharing(self) -> Snapshots:
        """Another backend's snapshots in this one's slot dir, index and disk budget (the models of one llama-server
        router, which all save into its one --slot-save-path); their rows and files are told apart by their keys'
        model and fingerprint. Closing it leaves the store open: this one closes it."""
        return Snapshots(self._store, owns_store=False)

    async def close(self, drop_ram_copies: bool = False) -> None:
        """Close the index (after the pool's `aclose`); `drop_ram_copies` once every save is committed and the
        server that read the RAM dir is gone, so all of it is on disk."""
        if not self._owns_store:
            return
        self._store.close()
        if drop_ram_copies and self._store.ram is not None:
            await asyncio.to_thread(self._store.ram.remove_all)

    # -- the directories, for the backend's start-up checks ------------------------------------------------------

    @property
    def slot_dir(self) -> Path:
        return self._store.slot_dir

    @property
    def backend_dir(self) -> Path:
        """Where the backend reads and writes slot files: the RAM dir when there is one, else the slot dir."""
        return self._store.backend_dir

    @property
    def has_ram_dir(self) -> bool:
        return self._store.ram is not None

    def model_identity(self, path: Path) -> str:
        """Blocking: the model file's content identity, from the index's cache when the file did not change."""
        return model_file_identity(path, self._store)

    def kv_setting(self, base: str, probe: KvProbe) -> str:
        """Blocking: the name of the KV setting a backend's probe shows under `base` (kvprobe.py)."""
        return self._store.kv_setting(base, probe)

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
        written, done = self.begin_save(slot_id, key, chain, kind, n_prompt=n_prompt)
        return done if await asyncio.shield(written) else None

    def begin_save(self, slot_id: int, key: SessionKey, chain: Sequence[Link],
                   kind: SnapshotKind = SnapshotKind.SESSION, *,
                   n_prompt: int = 0) -> tuple[asyncio.Future[bool], asyncio.Task[bool]]:
        """`start_save` without waiting: the save is a pending write of the snapshot once this returns (a look-up
        made meanwhile waits for it where it could find the snapshot). Returns the backend's write (its result:
        whether it succeeded) and the whole save's task, commit included."""
        temp = self._store.temp_name(key, self._fingerprint, kind)
        started = time.perf_counter()
        written: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        sid = snapshot_id(key, kind)
        earlier = self._writes.current(sid)

        async def write() -> bool:
            ok = False
            try:
                result = await self._backend_save(slot_id, key, temp)
                elapsed = time.perf_counter() - started
                if result.n_tokens > 0:
                    self.write_seconds_per_token = elapsed / result.n_tokens
                if self._written is not None:
                    self._written(result.n_bytes, result.n_tokens, elapsed * 1000)
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
        # snapshot the save replaces. A caller that gives up waiting does not stop the save.
        return written, self._writes.start(sid, write, chain, at_once=True)

    async def _backend_save(self, slot_id: int, key: SessionKey, temp: str) -> SlotActionResult:
        """Have the backend write the slot into `temp`: into the RAM dir when there is one with room; a save there
        that fails (the tmpfs may have filled up) is tried once more straight into the slot dir."""
        assert self._client is not None, "attach() the backend first"
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
        fence = self.fence(key) if self.fence is not None and kind is SnapshotKind.SESSION else None
        try:
            evicted = await asyncio.to_thread(self._commit_now, key, temp, result, chain, kind, keep, n_prompt,
                                              fence)
        except Exception as exc:  # whatever it is, it must not escape a background task unlogged
            self._failed(slot_id, key, exc.message if isinstance(exc, SnapshotError) else repr(exc))
            return False
        elapsed = (time.perf_counter() - started) * 1000
        self.evictions += evicted
        self.saves += 1
        self.events.saved(elapsed, result.n_bytes, result.n_tokens)
        if self.on_commit is not None:
            self.on_commit(key, kind)
        log.info("saved slot %d as %s%s: %d tokens, %d bytes, %.1f ms", slot_id,
                 "the system snapshot " if kind is SnapshotKind.SYSTEM else "", key, result.n_tokens, result.n_bytes,
                 elapsed)
        return True

    def _commit_now(self, key: SessionKey, temp: str, result: SlotActionResult, chain: Sequence[Link],
                    kind: SnapshotKind, keep: set[SnapshotId], n_prompt: int, fence: int | None) -> int:
        """In a worker thread: commit, then enforce the budget; returns how many snapshots the budget evicted."""
        try:
            snapshot = self._store.commit(key, temp, self._fingerprint, result.n_tokens, chain, result.n_bytes, kind,
                                          n_prompt, fence=fence)
        except BaseException:
            self._store.discard_temp(temp)
            raise
        if self._inspect is not None:
            try:
                self._inspect(snapshot)
            except Exception as exc:  # learning about the build must never fail a save
                log.warning("inspecting the saved file of %s failed: %s", key, exc)
        return self._enforce_budget_now(keep)

    def _failed(self, slot_id: int, key: SessionKey, reason: str) -> None:
        self.failed_saves += 1
        log.error("saving slot %d as %s failed: %s", slot_id, key, reason)

    # -- the block store, for the shared tier ----------------------------------------------------------------

    @property
    def blocks(self) -> BlockStore:
        """The block store, for the shared tier's downloads (checked blocks adopted, temporaries)."""
        return self._store.blocks

    # -- what a request could start from (the pool's look-ups) --------------------------------------------------

    async def candidates(self, key: SessionKey, chain: Sequence[Link], tokens: Tokens | None = None,
                         system: SessionKey | None = None, n_system: int = 0) -> Found:
        """Every saved state a request could start from (candidates.py)."""
        return await self._lookups.candidates(key, chain, tokens, system, n_system)

    async def index_old_states(self) -> int:
        """At start, in the background: index the token blocks of states saved before blocks were (read from their
        files); returns how many. Until then they are found by their chains and names only."""
        done = 0
        while added := await asyncio.to_thread(self._store.fill_blocks):
            done += added
        swept = await asyncio.to_thread(self._store.sweep_blocks)
        if swept:
            log.info("removed %d KV blocks no saved state names (left by a crash)", swept)
        warmed = await asyncio.to_thread(self._store.prewarm_ram, self._fingerprint)
        if warmed:
            log.info("assembled the %d most recently used saved state(s) into the RAM dir: their restores read "
                     "memory", warmed)
        return done

    def appendix_extent(self, snapshot: Snapshot) -> tuple[Path, int | None]:
        """Blocking: the file where a state's slot file ends (its tail when kept as blocks), and that end."""
        return tails.appendix_extent(self._store.blocks, snapshot)

    async def materialize(self, snapshot: Snapshot) -> bool:
        """Before a restore: the state's whole file ready for the backend (assembled from its blocks when it is
        kept as blocks); False when it cannot be (quarantined; the turn runs cold). Pair with `restored`."""
        return await asyncio.to_thread(self._store.materialize, snapshot)

    async def restored(self, snapshot: Snapshot) -> None:
        """After a restore `materialize` prepared (whatever came of it)."""
        await asyncio.to_thread(self._store.restored, snapshot)

    async def system(self, key: SessionKey, checked: bool = True) -> Snapshot | None:
        """The system snapshot of `key` (model, system digest); unchecked (its index row only) when all that matters
        is whether there is one."""
        await self._writes.wait([snapshot_id(key, SnapshotKind.SYSTEM)])
        if checked:
            return await asyncio.to_thread(self._store.checked_snapshot, key, self._fingerprint, SnapshotKind.SYSTEM)
        return await asyncio.to_thread(self._store.get, key, SnapshotKind.SYSTEM)

    async def settled(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> None:
        """Wait until `key`'s pending writes (a save being committed) are done."""
        await self._writes.wait([snapshot_id(key, kind)])

    async def checked(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        """`key`'s snapshot if its file is intact and of this backend (a damaged one is quarantined: None)."""
        await self._writes.wait([snapshot_id(key, kind)])
        return await asyncio.to_thread(self._store.checked_snapshot, key, self._fingerprint, kind)

    async def chain(self, snapshot: Snapshot) -> builtins.list[Link]:
        """The message chain recorded with a snapshot."""
        return await asyncio.to_thread(self._store.chain_of, snapshot)

    def mine_now(self) -> builtins.list[Snapshot]:
        """Blocking: every indexed snapshot of this backend's fingerprint (for what saved files tell at start)."""
        return [s for s in self._store.list(kind=None) if s.fingerprint == self._fingerprint]

    async def quarantine(self, snapshot: Snapshot, reason: str) -> None:
        """Move a snapshot the backend proved bad out of the way (its row goes, its file waits in quarantine)."""
        await self._writes.wait([snapshot_id(key_of(snapshot), snapshot.kind)])
        await asyncio.to_thread(self._store.quarantine, snapshot, reason)

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

    # -- the disk budget ----------------------------------------------------------------------------------------

    async def enforce_budget(self, also_keep: set[SnapshotId] | None = None) -> int:
        """Evict what the disk budget does not allow, never a snapshot whose session a slot holds (nor `also_keep`).
        Returns how many were evicted; a failure is logged and leaves everything in place."""
        if not self.budget.limited:
            await asyncio.to_thread(self._trim_quarantine_now)  # quarantined files age out even so
            return 0
        evicted = await asyncio.to_thread(self._enforce_budget_now, self._budget_keep(also_keep))
        self.evictions += evicted
        return evicted

    def _evicted(self, snapshot: SnapshotId) -> bool:
        """Whether the budget evicted the snapshot (of the last _GONE_KEPT it evicted)."""
        with self._gone_lock:
            return snapshot in self._gone

    def _budget_keep(self, also_keep: set[SnapshotId] | None) -> set[SnapshotId]:
        keep = set(also_keep or ())
        keep.update(self._occupants())
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
            evicted = self._store.enforce_budget(self.budget, keep)
        except Exception as exc:  # the budget is housekeeping: it must never fail a turn
            log.error("enforcing the disk budget failed: %s", exc)
            return 0
        with self._gone_lock:
            for eviction in evicted:
                self._gone[snapshot_id(key_of(eviction.snapshot), eviction.snapshot.kind)] = None
            while len(self._gone) > _GONE_KEPT:
                self._gone.popitem(last=False)
        return len(evicted)

    # -- waiting for pending writes -----------------------------------------------------------------------------

    async def settle(self, key: SessionKey | None = None, kind: SnapshotKind = SnapshotKind.SESSION,
                     timeout: float | None = None) -> bool:
        """Wait for the writes started so far (of `key`'s snapshot of `kind`, or of every snapshot) to finish; True
        when none of them is left running. A timeout, or the caller being cancelled, leaves them running. For
        shutdown and tests: the other methods wait for what they need themselves."""
        return await self._writes.wait(None if key is None else [snapshot_id(key, kind)], timeout)

    async def caught_up(self, timeout: float = VIEW_WAIT_SECONDS) -> bool:
        """Wait (bounded) for every write started so far, so that what is read next (counters included) shows them;
        True when none is left running."""
        return await self._writes.wait(None, timeout)

    # -- what an operator sees and does -------------------------------------------------------------------------

    async def list(self, model: str | None = None, kind: SnapshotKind | None = SnapshotKind.SESSION
                   ) -> builtins.list[Snapshot]:
        await self.caught_up()
        return await asyncio.to_thread(self._store.list, model, kind)

    async def get(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        await self._writes.wait([snapshot_id(key, kind)])
        return await asyncio.to_thread(self._store.get, key, kind)

    async def set_pinned(self, key: SessionKey, pinned: bool,
                         kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        await self._writes.wait([snapshot_id(key, kind)])
        return await asyncio.to_thread(self._store.set_pinned, key, pinned, kind)

    async def delete(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        """Remove the snapshot's row and files, after a save of it still being committed (which would bring it
        back). The caller stops the slots saving the session first (SlotPool.forget)."""
        await self._writes.wait([snapshot_id(key, kind)])
        return await asyncio.to_thread(self._store.delete, key, kind)

    async def usage(self) -> dict[str, dict[str, int]]:
        await self.caught_up()
        return await asyncio.to_thread(self._store.usage)

    def usage_now(self) -> dict[str, dict[str, int]]:
        """`usage` without waiting, for the metrics collector's thread (the scrape waits with `caught_up` first)."""
        return self._store.usage()

    async def disk(self) -> dict[str, Any]:
        """The slot dir, its free bytes, and the RAM dir's copies (None without a RAM dir)."""
        free = await asyncio.to_thread(shutil.disk_usage, self._store.slot_dir)
        count, block_bytes = await asyncio.to_thread(self._store.block_usage)
        return {"slot_dir": str(self._store.slot_dir), "free_bytes": free.free, "ram": await self.ram(),
                "blocks": {"count": count, "bytes": block_bytes},
                "stored_bytes": await asyncio.to_thread(self._store.stored_bytes)}

    def blocks_now(self) -> tuple[int, int]:
        """(blocks, bytes) of the block store, for the metrics collector's thread."""
        return self._store.block_usage()

    def stored_bytes_now(self) -> int:
        return self._store.stored_bytes()

    async def ram(self) -> dict[str, Any] | None:
        ram = self._store.ram
        if ram is None:
            return None
        copies, copy_bytes = await asyncio.to_thread(self._store.ram_usage)
        return {"dir": str(ram.path), "copies": copies, "bytes": copy_bytes, "budget_bytes": ram.budget}

    def ram_bytes_now(self) -> int:
        """Bytes of the RAM dir's copies (0 without one), for the metrics collector's thread."""
        return self._store.ram_usage()[1]

    @property
    def ram_budget(self) -> int:
        """The RAM dir's budget for copies (0 without a RAM dir)."""
        return 0 if self._store.ram is None else self._store.ram.budget

    def quarantined_now(self) -> int:
        """Files in the quarantine directory, for the metrics collector's thread."""
        return count_quarantined(self._store.slot_dir)
