"""The snapshot store: the slot files' lifecycle in the slot directory; their rows are the index's (index.py).

A file is listed in the index only once it was completely written, fsynced and renamed; anything else in the
directory is a leftover. Every lookup re-checks size, checksum and fingerprint before a file may be restored (the
checksum is hashed again only when the file's stat identity moved since this process last hashed it: hashmemo.py).

The backend reads and writes the slot dir itself, or, with a RAM dir (ramdir.py), a directory on tmpfs that holds
copies of recent snapshots and symlinks to the others: `backend_dir` is whichever it is.

Its parts, each in a module of its own: the look-ups by shared prefix (matching.py), the checks and parts of a state
kept as blocks (tails.py), the quarantine directory (quarantine.py), and the start-of-day clean-up of what a crash
left behind (reconcile.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sqlite3
import stat
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import BinaryIO

from slotkeeper.cache.assembly import Assembly
from slotkeeper.cache.blocks import block_scope
from slotkeeper.cache.blockstore import BLOCK_HEADER_BYTES, TAIL_SUFFIX, BlockStore, Split, SplitFailed
from slotkeeper.cache.budget import DiskBudget, Eviction, SnapshotId, choose_evictions
from slotkeeper.cache.chain import Link
from slotkeeper.cache.hashmemo import HashMemo, fine_timestamps, read_identity
from slotkeeper.cache.index import BlockRef, SnapshotIndex
from slotkeeper.cache.kvprobe import KvProbe
from slotkeeper.cache.matching import Matching, PrefixMatch, TokenMatch
from slotkeeper.cache.quarantine import QUARANTINE_DIR as QUARANTINE_DIR  # where the rest of the code finds it
from slotkeeper.cache.quarantine import move_aside
from slotkeeper.cache.quarantine import trim as trim_quarantine
from slotkeeper.cache.ramdir import RamDir
from slotkeeper.cache.reconcile import SIDECAR_SUFFIXES, ReconcileReport, is_final_name, reconcile, sweep_blocks
from slotkeeper.cache.tails import tail_problem
from slotkeeper.cache.tokens import Tokens, block_hashes, read_tokens
from slotkeeper.errors import OlderVersion, SnapshotError
from slotkeeper.files import copy_durably, fsync_dir, make_private_dir, unlink_quietly
from slotkeeper.files import file_checksum as file_checksum  # where the rest of the code finds it
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.version import Version

log = logging.getLogger("slotkeeper.store")


class SnapshotStore:
    """Owns the files the index rows name, and the index: nothing else writes its rows. Thread-safe: the index locks
    its connection, and no file operation needs to hold that lock; callers run it off the event loop."""

    def __init__(self, slot_dir: Path, index_path: Path, ram: RamDir | None = None, block_tokens: int = 0) -> None:
        self.slot_dir = slot_dir
        self.ram = ram
        self.blocks = BlockStore(slot_dir, block_tokens)
        self.assembly = Assembly(self.blocks, slot_dir, ram)
        make_private_dir(slot_dir)
        make_private_dir(index_path.parent)
        self._index = SnapshotIndex(index_path)
        self.hashes = HashMemo(fine_timestamps(slot_dir))
        self._not_here: set[str] = set()  # snapshots of another fingerprint already reported
        self._matching = Matching(self._index, slot_dir, ram, self.blocks, self._verified)

    def close(self) -> None:
        self._index.close()

    @property
    def _db(self) -> sqlite3.Connection:
        """The index's connection, for the tests that count its statements or checkpoint its log."""
        return self._index.connection

    @property
    def backend_dir(self) -> Path:
        """The directory the backend saves into and restores from (its --slot-save-path)."""
        return self.ram.path if self.ram is not None else self.slot_dir

    # -- saving ---------------------------------------------------------------------------------------------

    def temp_name(self, key: SessionKey, fingerprint: str, kind: SnapshotKind = SnapshotKind.SESSION) -> str:
        """A fresh temporary file name for the backend to write a save into."""
        return f"{key.file_stem(fingerprint, kind)}.tmp-{secrets.token_hex(4)}.bin"

    def prepare_save(self, temp_name: str, *, to_disk: bool = False) -> bool:
        """Before the backend saves into `temp_name`: True when the save will land in the RAM dir, False when it
        goes to the slot dir (no RAM dir; it has no room; or `to_disk`)."""
        if self.ram is None:
            return False
        if to_disk:
            self.ram.link(temp_name)  # the backend's write follows the link into the slot dir
            return False
        return self.ram.prepare_save(temp_name)

    def commit(self, key: SessionKey, temp_name: str, fingerprint: str, n_tokens: int,
               chain: Sequence[Link] = (), n_written: int | None = None,
               kind: SnapshotKind = SnapshotKind.SESSION, n_prompt: int = 0, version: Version | None = None,
               fence: int | None = None) -> Snapshot:
        """Make a finished save durable and index it; the previous snapshot of the session is replaced only now.

        A save made here (`version` None) gets the state's next version under `fence`; a copy brought in keeps its
        `version` and is refused (OlderVersion, its file removed) unless it is newer than the one here.

        `n_written` is the size the backend says it wrote; a file of any other size is torn and never indexed.
        `n_prompt` is the token count of the prompt of the turn saved (0: not known); the tokens after it were
        generated, and a client may not send them back.
        """
        if n_tokens <= 0:
            self.discard_temp(temp_name)
            raise SnapshotError(f"the backend saved 0 tokens for {key}; the previous snapshot is kept")
        final_name = f"{key.file_stem(fingerprint, kind)}-{secrets.token_hex(4)}.bin"
        in_ram = self.ram is not None and self.ram.in_ram(temp_name)
        # Read before the copy, from where the backend wrote it (the RAM dir's copy is memory; the slot dir's file
        # is in the page cache still): a state whose tokens cannot be read is kept whole, found by its chain only.
        source = (self.ram.path if in_ram and self.ram is not None else self.slot_dir) / temp_name
        tokens = read_tokens(source)
        try:
            split = self._split(source, final_name, tokens, block_scope(fingerprint, key.domain), n_written, n_prompt)
        except OSError as exc:
            self.discard_temp(temp_name)
            self.blocks.remove_tail(final_name)
            if isinstance(exc, SplitFailed):  # the blocks it wrote go now, not at the next start: the disk is full
                self.blocks.collect(exc.digests, self._index.referenced)
            raise SnapshotError(f"could not store the blocks of the snapshot of {key}: {exc}") from exc
        if split is not None:
            # Only a save this host's backend wrote offers its blocks to later saves by key; a copy brought in
            # (`version` given: an import, the shared tier) names its own blocks by their bytes alone.
            own = version is None
            refs = [BlockRef(d, p if own else None, split.cut.block_bytes(b) + BLOCK_HEADER_BYTES,
                             o if own else None, end - start if own else 0)
                    for b, (p, o, d, (start, end)) in enumerate(zip(
                        split.prefixes, split.opens, split.digests, map(split.cut.span, range(split.cut.n_blocks)),
                        strict=True))]
            return self._commit_split(key, kind, temp_name, final_name, fingerprint, n_tokens, split, refs, in_ram,
                                      chain, n_prompt, tokens, version, fence)
        try:
            if in_ram:
                n_bytes, checksum = self._copy_from_ram(temp_name, final_name, n_written)
            else:
                n_bytes, checksum = self._finish_on_disk(temp_name, final_name, n_written)
        except OSError as exc:
            self.discard_temp(temp_name)
            unlink_quietly(self.slot_dir / final_name)
            raise SnapshotError(f"could not finish the snapshot of {key}: {exc}") from exc
        if self.ram is not None:
            self.ram.saw(n_bytes)
            if in_ram:
                try:
                    self.ram.keep_copy(temp_name, final_name, checksum)
                except OSError as exc:  # the snapshot is on disk: only the copy is lost
                    log.warning("keeping a RAM copy of %s failed (%s): it is restored from disk", final_name, exc)
                    self.ram.remove(temp_name)
            else:
                self.ram.remove(temp_name)  # the symlink the backend saved through
        blocks = None if tokens is None else block_hashes(tokens)
        try:
            replaced, snapshot = self._index.replace(key, kind, final_name, fingerprint, n_tokens, n_bytes, checksum,
                                                     chain, n_prompt, blocks, version, fence,
                                                     keep_branches=key.is_derived)
        except OlderVersion:
            self._unlink_snapshot_files(final_name)
            raise
        self._after_commit(final_name, tokens, replaced, in_ram)
        return snapshot

    def _after_commit(self, final_name: str, tokens: Tokens | None, replaced: list[Snapshot], in_ram: bool) -> None:
        """Once a save is indexed: its tokens kept in memory, the states it replaced removed, the RAM dir trimmed."""
        if tokens is not None:
            self._matching.tokens.put(final_name, tokens)
        for previous in replaced:
            if previous.filename != final_name:
                self._unlink_snapshot_files(previous.filename)
        if in_ram:
            self.trim_ram()

    def _split(self, source: Path, final_name: str, tokens: Tokens | None, scope: str,
               n_written: int | None, n_prompt: int) -> Split | None:
        """Store a save as KV blocks and a tail (blockstore.py), its blocks' keys under `scope` (the fingerprint and
        the cache domain: blocks.py), a block ending at the prompt's end; None when it is kept whole."""
        if self.blocks.block_tokens <= 0:
            return None
        _check_size(source.stat().st_size, n_written)
        return self.blocks.split(source, final_name, tokens, scope, self._index.stored_from, max(n_prompt, 0))

    def _commit_split(self, key: SessionKey, kind: SnapshotKind, temp_name: str, final_name: str, fingerprint: str,
                      n_tokens: int, split: Split, refs: Sequence[BlockRef], in_ram: bool, chain: Sequence[Link],
                      n_prompt: int,
                      tokens: Tokens | None, version: Version | None, fence: int | None) -> Snapshot:
        """Index a save stored as blocks and a tail; the file the backend wrote stays only as the RAM dir's copy."""
        n_bytes = split.cut.layout.file_size
        try:
            if self.ram is not None:
                self.ram.saw(n_bytes)
                if in_ram and split.exact:
                    try:
                        self.ram.keep_copy(temp_name, final_name, split.checksum)
                    except OSError as exc:
                        log.warning("keeping a RAM copy of %s failed (%s): it is assembled from blocks", final_name,
                                    exc)
                        self.ram.remove(temp_name)
                else:
                    self.ram.remove(temp_name)
            unlink_quietly(self.slot_dir / temp_name)
            blocks = None if tokens is None else block_hashes(tokens)
            try:
                replaced, snapshot = self._index.replace(
                    key, kind, final_name, fingerprint, n_tokens, n_bytes, split.checksum, chain, n_prompt, blocks,
                    version, fence, tail_bytes=split.tail_bytes, block_refs=refs, keep_branches=key.is_derived)
            except OlderVersion:
                self._unlink_snapshot_files(final_name)
                raise
        finally:
            self.blocks.release(split.digests)  # after the rows that name them: a collection sees one or the other
        self._after_commit(final_name, tokens, replaced, in_ram)
        log.debug("stored %s as %d blocks (%d bytes new) and a tail of %d bytes", final_name, len(split.digests),
                  split.new_block_bytes, split.tail_bytes)
        return snapshot

    def _finish_on_disk(self, temp_name: str, final_name: str, n_written: int | None) -> tuple[int, str]:
        """The backend wrote the save into the slot dir: fsync it, check its size, rename it, hash it."""
        temp_path, final_path = self.slot_dir / temp_name, self.slot_dir / final_name
        with temp_path.open("rb") as fh:
            os.fsync(fh.fileno())
            n_bytes = os.fstat(fh.fileno()).st_size
        _check_size(n_bytes, n_written)
        os.replace(temp_path, final_path)
        fsync_dir(self.slot_dir)
        _, identity = read_identity(final_path)  # before the hash: a later change moves it (hashmemo.py)
        checksum = file_checksum(final_path)
        self.hashes.remember(final_name, identity, checksum)
        return n_bytes, checksum

    def _copy_from_ram(self, temp_name: str, final_name: str, n_written: int | None) -> tuple[int, str]:
        """The backend wrote the save into the RAM dir: copy it to the slot dir (hashing what is written), fsync,
        rename."""
        assert self.ram is not None
        source = self.ram.path / temp_name
        _check_size(source.stat().st_size, n_written)
        disk_temp, final_path = self.slot_dir / temp_name, self.slot_dir / final_name
        n_bytes, checksum = copy_durably(source, disk_temp)
        _check_size(n_bytes, n_written)
        os.replace(disk_temp, final_path)
        fsync_dir(self.slot_dir)
        _, identity = read_identity(final_path)
        # Hashed as it was written, and settled below the page cache: only a change after this moves the identity.
        self.hashes.remember(final_name, identity, checksum)
        return n_bytes, checksum

    def discard_temp(self, temp_name: str) -> None:
        unlink_quietly(self.slot_dir / temp_name)
        if self.ram is not None:
            self.ram.remove(temp_name)

    def trim_ram(self) -> int:
        """Keep the RAM dir's copies within its budget, the least recently used going first (each replaced by a
        symlink to its file on disk); returns how many went."""
        if self.ram is None:
            return 0
        copies = self.ram.copies(is_final_name)
        if sum(copies.values()) <= self.ram.budget:
            return 0
        for name in self.assembly.in_use():  # a copy a restore is about to read stays until it has read it
            copies.pop(name, None)
        indexed = self._index.filenames_by_use()
        unindexed = [name for name in copies if name not in set(indexed)]
        return self.ram.trim(copies, [*unindexed, *indexed])

    def ram_usage(self) -> tuple[int, int]:
        """(copies, bytes) in the RAM dir; (0, 0) without one."""
        return (0, 0) if self.ram is None else self.ram.usage(is_final_name)

    # -- restoring ------------------------------------------------------------------------------------------

    def checked_snapshot(self, key: SessionKey, fingerprint: str,
                         kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        """The key's snapshot if its file is intact and made by this backend; else None (bad files quarantined)."""
        snapshot = self._index.get(key, kind)
        return None if snapshot is None else self._verified(snapshot, fingerprint)

    # the look-ups by shared prefix (matching.py)

    def prefix_matches(self, model: str, fingerprint: str, chain: Sequence[Link],
                       min_messages: int = 1, domain: str = "") -> list[PrefixMatch]:
        return self._matching.prefix_matches(model, fingerprint, chain, min_messages, domain)

    def best_prefix(self, model: str, fingerprint: str, chain: Sequence[Link],
                    min_messages: int = 1, domain: str = "") -> PrefixMatch | None:
        return self._matching.best_prefix(model, fingerprint, chain, min_messages, domain)

    def best_by_tokens(self, model: str, fingerprint: str, tokens: Tokens, domain: str = "") -> list[TokenMatch]:
        return self._matching.best_by_tokens(model, fingerprint, tokens, domain)

    def tokens_of(self, snapshot: Snapshot) -> Tokens | None:
        return self._matching.tokens_of(snapshot)

    def fill_blocks(self, limit: int = 256) -> int:
        return self._matching.fill_blocks(limit)

    def chain_of(self, snapshot: Snapshot) -> list[Link]:
        return self._matching.chain_of(snapshot)

    def shared_prefix(self, snapshot: Snapshot, chain: Sequence[Link]) -> tuple[int, int] | None:
        return self._matching.shared_prefix(snapshot, chain)

    def in_ram(self, snapshot: Snapshot) -> bool:
        """Whether a restore of the state reads a copy in the RAM dir (not its file on disk)."""
        return self.ram is not None and self.ram.in_ram(snapshot.filename)

    def _verified(self, snapshot: Snapshot, fingerprint: str) -> Snapshot | None:
        """The snapshot if the backend may restore it by its name in backend_dir: its RAM copy, or else its file on
        disk (then reached through a symlink from the RAM dir), is intact and of this backend."""
        if snapshot.fingerprint != fingerprint:
            # Made by another model, build or slot layout: not restorable here, but not bad either. It stays for
            # the backend it was made for, and the disk budget ages it out.
            if snapshot.filename not in self._not_here:
                self._not_here.add(snapshot.filename)
                log.warning("snapshot %s/%s was made by another model or slot layout (fingerprint %s, this "
                            "backend's %s): it is not restored here, and kept", snapshot.model,
                            snapshot.session_id, snapshot.fingerprint, fingerprint)
            return None
        if self.ram is not None and self.ram.intact_copy(snapshot.filename, snapshot.n_bytes, snapshot.checksum):
            return snapshot
        if snapshot.tail_bytes:
            reason = tail_problem(self.blocks, self.hashes, snapshot)
            if reason is None:
                return snapshot  # its file is assembled from blocks when it is restored (materialize)
            self.quarantine(snapshot, reason)
            return None
        reason = self._problem(snapshot, self.slot_dir / snapshot.filename)
        if reason is not None:
            self.quarantine(snapshot, reason)
            return None
        if self.ram is not None:
            try:
                self.ram.link(snapshot.filename)
            except OSError as exc:
                log.error("could not link %s into the RAM dir: %s", snapshot.filename, exc)
                return None
        return snapshot

    def _problem(self, snapshot: Snapshot, path: Path) -> str | None:
        try:
            st, identity = read_identity(path)
        except FileNotFoundError:
            return "file is missing"
        if not stat.S_ISREG(st.st_mode):  # lstat: a symlink is not one either
            return "not a regular file"
        if st.st_size != snapshot.n_bytes:
            return f"size {st.st_size} bytes, index says {snapshot.n_bytes} (truncated or replaced)"
        if self.hashes.checksum(snapshot.filename, identity) == snapshot.checksum:
            return None  # hashed whole by this process, and not touched since
        if file_checksum(path) != snapshot.checksum:
            return "checksum mismatch (the file changed after it was saved)"
        self.hashes.remember(snapshot.filename, identity, snapshot.checksum)
        return None

    def materialize(self, snapshot: Snapshot) -> bool:
        """The state's whole file ready for the backend under its name (assembly.py); False when it cannot be had:
        the state is quarantined and the turn runs cold. Pair with `restored`."""
        made = self.assembly.materialize(snapshot)
        if made is None:
            return True
        if made:
            if self.ram is not None:
                self.trim_ram()  # a copy assembled into the RAM dir counts against its budget
            return True
        self.quarantine(snapshot, f"it cannot be assembled from its blocks: {self.assembly.last_problem}")
        return False

    def restored(self, snapshot: Snapshot) -> None:
        self.assembly.restored(snapshot)

    def prewarm_ram(self, fingerprint: str) -> int:
        """At start: the most recently used states of this backend kept as blocks, assembled into the RAM dir."""
        return self.assembly.prewarm(self.list(kind=None), fingerprint)

    def open_whole(self, snapshot: Snapshot) -> BinaryIO:
        return self.assembly.open_whole(snapshot)

    def quarantine(self, snapshot: Snapshot, reason: str) -> None:
        """Drop the index row and move the file aside so it is never handed to the backend again."""
        self._index.drop(snapshot.filename)
        self.hashes.forget(snapshot.filename)
        if self.ram is not None:
            self.ram.remove(snapshot.filename)
        source = self.slot_dir / snapshot.filename
        if snapshot.tail_bytes:
            unlink_quietly(source)  # an assembled copy
            self._collect(snapshot.filename)
            source = self.blocks.tail_path(snapshot.filename)
        move_aside(self.slot_dir, source, snapshot.filename)
        log.warning("snapshot %s/%s quarantined: %s", snapshot.model, snapshot.session_id, reason)

    def mark_used(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> None:
        self._index.mark_used(key, kind)

    # -- listing and deleting -------------------------------------------------------------------------------

    def get(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        return self._index.get(key, kind)

    def list(self, model: str | None = None, kind: SnapshotKind | None = SnapshotKind.SESSION) -> list[Snapshot]:
        """Snapshots, most recently used first: of one kind (sessions by default) or, with kind None, all."""
        return self._index.snapshots(model, kind)

    def delete(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        """Remove a snapshot's row and file; returns what was removed, or None when there was nothing."""
        snapshot = self._index.delete(key, kind)
        if snapshot is None:
            return None
        self._unlink_snapshot_files(snapshot.filename)
        return snapshot

    def set_pinned(self, key: SessionKey, pinned: bool, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        """Pin (never evict) or unpin a snapshot; None when there is none."""
        return self._index.set_pinned(key, pinned, kind)

    def evict(self, snapshot: Snapshot, reason: str) -> bool:
        """Remove an evicted snapshot: its index row, its chain, its file and any sidecar, in that order (a crash
        in between leaves at most an unindexed file, which the next start removes). False if it was gone already."""
        if not self._index.drop(snapshot.filename):
            return False
        self._unlink_snapshot_files(snapshot.filename)
        log.info("evicted %s snapshot %s/%s (%d bytes, last used %.0f s ago): %s", snapshot.kind, snapshot.model,
                 snapshot.session_id, snapshot.n_bytes, time.time() - snapshot.last_used, reason)
        return True

    def enforce_budget(self, budget: DiskBudget, protected: Collection[SnapshotId] = ()) -> Sequence[Eviction]:
        """Evict what the budget does not allow (see budget.py); returns what was evicted. Quarantined files count
        in the total and age out first (`trim_quarantine`)."""
        now = time.time()
        self.trim_quarantine(budget, now)
        if not budget.limited or not self._index.over_budget(budget, now):
            return []
        evictions = choose_evictions(self._sized(self.list(kind=None)), budget, protected, now,
                                     self._index.total_bytes())
        return [e for e in evictions if self.evict(e.snapshot, e.reason)]

    def _sized(self, snapshots: Sequence[Snapshot]) -> Sequence[Snapshot]:
        """The states with `n_bytes` as what evicting each frees: its file, or its tail and the blocks only it names
        (blocks shared only with other states evicted at once are not counted: the budget errs towards evicting one
        state too many, never towards staying over)."""
        return [s if not s.tail_bytes else dataclasses.replace(
            s, n_bytes=s.tail_bytes + self._index.own_block_bytes(s.filename)) for s in snapshots]

    def trim_quarantine(self, budget: DiskBudget, now: float | None = None) -> int:
        """Age out quarantined files, and those over the budget with the snapshots (quarantine.py); how many went."""
        return trim_quarantine(self.slot_dir, budget, self._index.total_bytes, now)

    def block_usage(self) -> tuple[int, int]:
        """(blocks, bytes) of the block store, each block once."""
        return self._index.block_usage()

    def stored_bytes(self) -> int:
        """What the saved states take on disk: whole files, tails, and each block once."""
        return self._index.total_bytes()

    def usage(self) -> dict[str, dict[str, int]]:
        """Bytes and snapshot counts per kind: {"session": {"count", "bytes", "pinned"}, "system": {...}}."""
        return self._index.usage()

    def _unlink_snapshot_files(self, filename: str) -> None:
        self.hashes.forget(filename)
        self.hashes.forget(filename + TAIL_SUFFIX)
        self._matching.tokens.drop(filename)
        if self.ram is not None:
            self.ram.remove(filename)
        unlink_quietly(self.slot_dir / filename)
        self.blocks.remove_tail(filename)
        self._collect(filename)
        for suffix in SIDECAR_SUFFIXES:
            sidecar = self.slot_dir / (filename + suffix)
            if sidecar.exists():
                unlink_quietly(sidecar)

    def _collect(self, filename: str) -> None:
        """The blocks only a removed state named go with it."""
        keys = self._index.unref(filename)
        if keys:
            self.blocks.collect(keys, self._index.referenced)

    # -- at start (reconcile.py) ---------------------------------------------------------------------------

    def sweep_blocks(self) -> int:
        """In a worker thread: remove the blocks no state names; returns how many went."""
        return sweep_blocks(self._index, self.blocks)

    def reconcile(self) -> ReconcileReport:
        """Remove our leftover temporaries and unindexed files, and rows whose file is gone."""
        return reconcile(self.slot_dir, self._index, self.ram, self.trim_ram)

    # -- model file identities (cached, so a 20 GB GGUF is not re-read at every start) ------------------------

    def cached_identity(self, path: str, size: int, mtime_ns: int) -> str | None:
        return self._index.cached_identity(path, size, mtime_ns)

    def remember_identity(self, path: str, size: int, mtime_ns: int, identity: str) -> None:
        self._index.remember_identity(path, size, mtime_ns, identity)

    def kv_setting(self, base: str, probe: KvProbe) -> str:
        return self._index.kv_setting(base, probe)


def _check_size(n_bytes: int, n_written: int | None) -> None:
    """A file of another size than the backend says it wrote is torn, and never indexed."""
    if n_written is not None and n_bytes != n_written:
        raise OSError(f"the file has {n_bytes} bytes but the backend wrote {n_written}")
