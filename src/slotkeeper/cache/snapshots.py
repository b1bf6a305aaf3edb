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
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from slotkeeper.cache.blockstore import BlockStore, DamagedState
from slotkeeper.cache.blockstore import Manifest as BlockManifest
from slotkeeper.cache.budget import DiskBudget, SnapshotId
from slotkeeper.cache.chain import Link, common_prefix
from slotkeeper.cache.events import CacheEvents
from slotkeeper.cache.fingerprint import model_file_identity
from slotkeeper.cache.planner import NEAR_TIE_TOKENS, Candidate, Tier
from slotkeeper.cache.ramdir import RamDir
from slotkeeper.cache.reasons import Reason
from slotkeeper.cache.store import QUARANTINE_DIR, SnapshotStore, file_checksum, shared_with
from slotkeeper.cache.tokens import Tokens
from slotkeeper.cache.tokens import common_prefix as common_tokens
from slotkeeper.errors import OlderVersion, SnapshotError, UpstreamError, UpstreamUnavailable
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.upstream.client import SlotActionResult, UpstreamClient
from slotkeeper.version import Version

log = logging.getLogger("slotkeeper.pool")

# How long an operator's view (listings, counters, /metrics) waits for saves still being committed in the background
# so that it shows them; past this it shows what is indexed so far.
VIEW_WAIT_SECONDS = 5.0
# Snapshots the budget evicted, remembered (newest last) so that their session's next turn can say why it ran cold.
_GONE_KEPT = 4096


def snapshot_id(key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> SnapshotId:
    return key.model, key.session_id, kind


def key_of(snapshot: Snapshot) -> SessionKey:
    return SessionKey(snapshot.model, snapshot.session_id)


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    """What a look-up found for a request: the session's own state (or what became of it: `fate`), every candidate
    (the own one included) with the tokens it shares, and whether the request's system part has a saved state."""

    own: Candidate | None
    fate: Reason | None
    saved: builtins.list[Candidate]
    system_saved: bool = False


class Snapshots:
    """One backend's snapshots. Opened at start (`open`: the directories, the index, a reconcile); the slot pool then
    `attach`es the backend they belong to, which saving and every fingerprint-checked lookup need."""

    def __init__(self, store: SnapshotStore) -> None:
        self._store = store
        self._writes = _PendingWrites()
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
        self.refused_older = 0  # copies brought in that were not newer than the state here: refused
        self.saves = 0
        self.failed_saves = 0
        self.evictions = 0
        # Seconds per token of the last backend write (the part of a save the slot waits for), None before one: how
        # long the next save of a slot is expected to take (the pool's idle saves, pool.py).
        self.write_seconds_per_token: float | None = None
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
               inspect: Callable[[Snapshot], None] | None = None) -> None:
        """The backend these snapshots belong to, and what the pool lends them: its slots' occupants (kept from the
        budget), its event counters, and a look at each saved file."""
        self._client, self._fingerprint = client, fingerprint
        self.budget, self.events, self._occupants, self._inspect = budget, events, occupants, inspect

    async def close(self, drop_ram_copies: bool = False) -> None:
        """Close the index (after the pool's `aclose`); `drop_ram_copies` once every save is committed and the
        server that read the RAM dir is gone, so all of it is on disk."""
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
                if result.n_tokens > 0:
                    self.write_seconds_per_token = (time.perf_counter() - started) / result.n_tokens
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

    # -- importing ----------------------------------------------------------------------------------------------

    async def stage_upload(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> tuple[str, Path]:
        """A temporary name (and its path) in the slot dir for an uploaded snapshot file of `key`."""
        temp = self._store.temp_name(key, self._fingerprint, kind)
        return temp, self._store.slot_dir / temp

    async def checksum(self, path: Path) -> str:
        return await asyncio.to_thread(file_checksum, path)

    async def discard_upload(self, temp: str) -> None:
        await asyncio.to_thread(self._store.discard_temp, temp)

    async def commit_import(self, key: SessionKey, temp: str, n_tokens: int, chain: Sequence[Link], n_bytes: int,
                            kind: SnapshotKind, n_prompt: int, version: Version | None) -> Snapshot:
        """Make an uploaded file (`temp`, checked) `key`'s snapshot, as one of the snapshot's writes: after the saves
        of it started before (none of them lands over it), before any started later. Raises what the commit raises
        (the temp file is then discarded); OlderVersion (counted) when the copy at `version` is not newer than the
        state here (None: a new version, as a save made here gets). The commit goes on if the caller stops waiting
        for it. The pool's `import_snapshot` lets go of the session in its slots first."""
        committed: asyncio.Future[Snapshot] = asyncio.get_running_loop().create_future()

        async def write() -> bool:
            try:
                snapshot = await asyncio.to_thread(self._store.commit, key, temp, self._fingerprint, n_tokens, chain,
                                                   n_bytes, kind, n_prompt, version)
            except Exception as exc:
                if isinstance(exc, OlderVersion):
                    self.refused_older += 1
                await asyncio.to_thread(self._store.discard_temp, temp)
                committed.set_exception(exc)
                return False
            except BaseException:
                committed.cancel()  # the write was cancelled: its caller must not wait forever
                raise
            if self._inspect is not None:  # an imported file tells about its build as a saved one does
                try:
                    await asyncio.to_thread(self._inspect, snapshot)
                except Exception as exc:
                    log.warning("inspecting the saved file of %s failed: %s", key, exc)
            committed.set_result(snapshot)
            return True

        self._writes.start(snapshot_id(key, kind), write, chain)
        return await asyncio.shield(committed)

    # -- what a request could start from (the pool's look-ups) --------------------------------------------------

    async def candidates(self, key: SessionKey, chain: Sequence[Link], tokens: Tokens | None = None,
                         system: SessionKey | None = None, n_system: int = 0) -> Found:
        """Every saved state a request could start from, each with the tokens it shares with the request: the
        session's own (its name is a hint, never the proof), and those of every kind that share the most leading
        messages (the chains) or, given the request's `tokens`, the most leading tokens, compared one by one.
        `system` names the request's system part, to tell whether a state of it is saved.

        Writes still pending that the look-up could find are waited for first: the session's own, the system
        part's, and those of states sharing more than the system part (`n_system` messages) with the request. A
        state found whose save started since (its file is about to be replaced) is waited for, and the look-up made
        again, only when it shares more than every other; else it is left out."""
        pending = [snapshot_id(key)] + ([snapshot_id(system, SnapshotKind.SYSTEM)] if system is not None else [])
        await self._writes.wait(pending)
        if chain:
            await self._writes.wait(self._writes.sharing(chain, n_system + 1))
        found = await asyncio.to_thread(self._find_now, key, chain, tokens, system)
        settled = [c for c in found.saved if snapshot_id(key_of(c.snapshot), c.snapshot.kind) not in self._writes]
        if len(settled) == len(found.saved):
            return found
        best = max((c.tokens for c in settled), default=0)
        if all(c.tokens <= best + NEAR_TIE_TOKENS for c in found.saved):
            # A state whose file a save is about to replace, and that shares no more than others: left out rather
            # than waited for (the save being committed is another conversation's, and its newer state no better).
            return dataclasses.replace(found, saved=settled)
        await self._writes.wait([snapshot_id(key_of(c.snapshot), c.snapshot.kind) for c in found.saved
                                 if c not in settled])
        return await asyncio.to_thread(self._find_now, key, chain, tokens, system)

    def _find_now(self, key: SessionKey, chain: Sequence[Link], tokens: Tokens | None,
                  system: SessionKey | None) -> Found:
        """In a worker thread, in one go."""
        own, fate = self._own_now(key, chain)
        found: dict[str, Candidate] = {} if own is None else {own.snapshot.filename: own}
        if chain:
            for match in self._store.prefix_matches(key.model, self._fingerprint, chain):
                if match.snapshot.filename not in found:
                    found[match.snapshot.filename] = Candidate(match.snapshot, match.messages, match.est_tokens,
                                                               match.whole, tier=self._tier(match.snapshot))
        found = _same_estimates(found)
        if tokens is not None:
            for name, candidate in list(found.items()):
                found[name] = self._exact(candidate, tokens)
            for token_match in self._store.best_by_tokens(key.model, self._fingerprint, tokens):
                snapshot = token_match.snapshot
                if snapshot.filename in found:
                    continue
                messages = common_prefix(self._store.chain_of(snapshot), chain) if chain else 0
                saved = self._store.tokens_of(snapshot)
                whole = saved is not None and token_match.tokens >= saved.size
                found[snapshot.filename] = Candidate(snapshot, messages, token_match.tokens, whole, exact=True,
                                                     tier=self._tier(snapshot), own=False)
        own = found.get(own.snapshot.filename) if own is not None else None
        system_saved = system is not None and self._store.get(system, SnapshotKind.SYSTEM) is not None
        return Found(own, fate, list(found.values()), system_saved)

    def _exact(self, candidate: Candidate, tokens: Tokens) -> Candidate:
        """The candidate with the tokens it shares counted one by one, when its file's tokens can be read."""
        saved = self._store.tokens_of(candidate.snapshot)
        if saved is None:
            return candidate
        shared = common_tokens(saved, tokens)
        return dataclasses.replace(candidate, tokens=shared, whole=shared >= saved.size, exact=True)

    def _tier(self, snapshot: Snapshot) -> Tier:
        return Tier.RAM if self._store.in_ram(snapshot) else Tier.DISK

    def _own_now(self, key: SessionKey, chain: Sequence[Link]) -> tuple[Candidate | None, Reason | None]:
        """The session's own conversation state and what of it the request still shares (a client may have
        edited or trimmed its history); without one, what became of it (evicted, not restorable here,
        quarantined), if anything is known. A request without messages (a raw prompt), or a state without a
        recorded chain, is taken as sharing all of it."""
        row = self._store.get(key)
        own = self._store.checked_snapshot(key, self._fingerprint) if row is not None else None
        if own is None:
            if row is None:
                with self._gone_lock:
                    gone = snapshot_id(key) in self._gone
                return None, Reason.EVICTED if gone else None
            return None, Reason.NOT_RESTORABLE if row.fingerprint != self._fingerprint else Reason.QUARANTINED
        saved = self._store.chain_of(own) if chain else []
        shared = shared_with(own, saved, chain)  # one read of the recorded chain for both answers
        tier = self._tier(own)
        if shared is None:
            return Candidate(own, len(chain), own.owed_tokens, True, tier=tier, own=True), None
        return Candidate(own, shared[0], shared[1], shared[0] == len(saved), tier=tier, own=True), None

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
        return self._store.appendix_extent(snapshot)

    async def materialize(self, snapshot: Snapshot) -> bool:
        """Before a restore: the state's whole file ready for the backend (assembled from its blocks when it is
        kept as blocks); False when it cannot be (quarantined; the turn runs cold). Pair with `restored`."""
        return await asyncio.to_thread(self._store.materialize, snapshot)

    async def restored(self, snapshot: Snapshot) -> None:
        """After a restore `materialize` prepared (whatever came of it)."""
        await asyncio.to_thread(self._store.restored, snapshot)

    async def tokens_of(self, snapshot: Snapshot) -> Tokens | None:
        """The tokens a saved state holds (None: its file is not one this code reads)."""
        return await asyncio.to_thread(self._store.tokens_of, snapshot)

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
        try:
            with os.scandir(self._store.slot_dir / QUARANTINE_DIR) as entries:
                return sum(1 for entry in entries if entry.is_file())
        except OSError:
            return 0

    async def open_for_upload(self, key: SessionKey, kind: SnapshotKind) -> Upload | None:
        """`open_for_export` for the shared tier: a state kept as blocks comes as its tail (open) and manifest, its
        blocks held until `finish_upload`; a state kept whole as its file."""
        await self._writes.wait([snapshot_id(key, kind)])
        snapshot = await asyncio.to_thread(self._store.checked_snapshot, key, self._fingerprint, kind)
        if snapshot is not None and snapshot.tail_bytes:
            try:
                handle, manifest = await asyncio.to_thread(self._store.open_parts, snapshot)
            except (DamagedState, FileNotFoundError):
                return None  # replaced or evicted meanwhile: a newer save is queued, or there is nothing to upload
            chain = await asyncio.to_thread(self._store.chain_of, snapshot)
            return Upload(snapshot, chain, handle, manifest)
        found = await self.open_for_export(key, kind)
        return None if found is None else Upload(*found, None)

    def finish_upload(self, upload: Upload) -> None:
        upload.handle.close()
        if upload.blocks is not None:
            self._store.release_parts(upload.blocks)

    def block_file(self, key: str) -> Path:
        """Where the block store keeps a block (for an upload of it)."""
        return self._store.blocks.block_path(key)

    @property
    def blocks(self) -> BlockStore:
        """The block store, for the shared tier's downloads (checked blocks adopted, temporaries)."""
        return self._store.blocks

    async def open_for_export(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION
                              ) -> tuple[Snapshot, builtins.list[Link], BinaryIO] | None:
        """`key`'s checked snapshot, its message chain and its file opened for reading, once the snapshot's pending
        writes are done; None when there is none. A commit or an eviction that removes the file between the look-up
        and the open is met by waiting and looking it up once more."""
        for _ in range(2):
            await self._writes.wait([snapshot_id(key, kind)])
            snapshot = await asyncio.to_thread(self._store.checked_snapshot, key, self._fingerprint, kind)
            if snapshot is None:
                return None
            try:
                handle = await asyncio.to_thread(self._store.open_whole, snapshot)
            except FileNotFoundError:
                continue
            except DamagedState as exc:
                await asyncio.to_thread(self._store.quarantine, snapshot, f"it cannot be assembled: {exc}")
                return None
            chain = await asyncio.to_thread(self._store.chain_of, snapshot)
            return snapshot, chain, handle
        return None


@dataclasses.dataclass(frozen=True)
class Upload:
    """A saved state opened for an upload: its file, or its tail with its blocks' manifest (`blocks`)."""

    snapshot: Snapshot
    chain: builtins.list[Link]
    handle: BinaryIO
    blocks: BlockManifest | None


def _same_estimates(found: dict[str, Candidate]) -> dict[str, Candidate]:
    """Candidates that hold the same leading messages of a request share the same tokens of it (but for part of the
    next message, which only counting tells): they get the same estimate, the count of one the request holds whole
    where there is one (its prompt), else the largest, so that a near-tie between them is a tie the cheapest wins."""
    by_depth: dict[int, list[Candidate]] = {}
    for candidate in found.values():
        if not candidate.exact and candidate.messages > 0:
            by_depth.setdefault(candidate.messages, []).append(candidate)
    out = dict(found)
    for group in by_depth.values():
        whole = [c.tokens for c in group if c.whole]
        shared = max(whole) if whole else max(c.tokens for c in group)
        for candidate in group:
            out[candidate.snapshot.filename] = dataclasses.replace(candidate, tokens=shared)
    return out


class _PendingWrites:
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

    def sharing(self, chain: Sequence[Link], min_messages: int) -> builtins.list[SnapshotId]:
        """The states with a pending commit whose chain shares at least `min_messages` leading messages
        with `chain`: the ones a prefix lookup for it could find once they are committed."""
        return [s for s, pending in self._chains.items() if common_prefix(pending, chain) >= min_messages]

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
