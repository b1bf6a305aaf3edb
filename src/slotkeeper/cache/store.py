"""The snapshot store: the slot files' lifecycle in the slot directory; their rows are the index's (index.py).

A file is listed in the index only once it was completely written, fsynced and renamed; anything else in the
directory is a leftover. Every lookup re-checks size, checksum and fingerprint before a file may be restored (the
checksum is hashed again only when the file's stat identity moved since this process last hashed it: hashmemo.py).

The backend reads and writes the slot dir itself, or, with a RAM dir (ramdir.py), a directory on tmpfs that holds
copies of recent snapshots and symlinks to the others: `backend_dir` is whichever it is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import sqlite3
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from slotkeeper.cache.assembly import Assembly
from slotkeeper.cache.blockstore import (
    BLOCK_HEADER_BYTES,
    TAIL_SUFFIX,
    BlockStore,
    DamagedState,
    Split,
    SplitFailed,
)
from slotkeeper.cache.blockstore import Manifest as BlockManifest
from slotkeeper.cache.budget import DiskBudget, Eviction, SnapshotId, choose_evictions
from slotkeeper.cache.chain import Link, common_prefix
from slotkeeper.cache.hashmemo import HashMemo, fine_timestamps, read_identity
from slotkeeper.cache.index import SnapshotIndex
from slotkeeper.cache.ramdir import RamDir
from slotkeeper.cache.tokens import Tokens, block_hashes, read_tokens
from slotkeeper.cache.tokens import common_prefix as common_tokens
from slotkeeper.errors import OlderVersion, SnapshotError
from slotkeeper.files import copy_durably, fsync_dir, make_private_dir, unlink_quietly
from slotkeeper.files import file_checksum as file_checksum  # where the rest of the code finds it
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.version import Version

log = logging.getLogger("slotkeeper.store")

# Our own names: 40 hex digits, a dash and a nonce; temporaries carry `.tmp-<nonce>` before `.bin`.
_FINAL_NAME = re.compile(r"^[0-9a-f]{40}-[0-9a-f]{8}\.bin$")
_TEMP_NAME = re.compile(r"^[0-9a-f]{40}\.tmp-[0-9a-f]{8}\.bin$")
# The block store's temporaries in the slot dir: a tail being written, a file being assembled, an export's copy.
_BLOCK_TEMP_NAME = re.compile(r"^\.((tmp|assembling)-[0-9a-f]{8}-[0-9a-f]{40}-[0-9a-f]{8}\.bin(\.tail)?"
                              r"|export-[0-9a-f]{8}\.bin)$")
# A sidecar a patched llama-server may write next to a slot file (context checkpoints): it lives and dies with it.
SIDECAR_SUFFIXES = (".ckpt",)
QUARANTINE_DIR = "quarantine"
# How long a quarantined file is kept for a person to look at when the budget sets no max age.
QUARANTINE_KEEP_SECONDS = 7 * 86400
# Token lists of saved states kept in memory for exact comparisons (4 bytes a token): about 32 MiB.
_TOKENS_KEPT = 8 << 20


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A snapshot whose first `messages` messages equal the request's: restoring it reuses about `est_tokens`.
    `whole`: the request has every message the snapshot was saved with."""

    snapshot: Snapshot
    messages: int
    est_tokens: int
    whole: bool = False


@dataclass(frozen=True, slots=True)
class TokenMatch:
    """A saved state and exactly how many leading tokens it shares with a request (its token list was compared)."""

    snapshot: Snapshot
    tokens: int


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    temporaries_removed: int
    orphans_removed: int
    rows_dropped: int


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
        self._tokens = _TokenMemo(_TOKENS_KEPT)

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
            split = self._split(source, final_name, tokens, fingerprint, n_written)
        except OSError as exc:
            self.discard_temp(temp_name)
            self.blocks.remove_tail(final_name)
            if isinstance(exc, SplitFailed):  # the blocks it wrote go now, not at the next start: the disk is full
                self.blocks.collect(exc.keys, self._index.referenced)
            raise SnapshotError(f"could not store the blocks of the snapshot of {key}: {exc}") from exc
        if split is not None:
            return self._commit_split(key, kind, temp_name, final_name, fingerprint, n_tokens, split, in_ram,
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
            previous, snapshot = self._index.replace(key, kind, final_name, fingerprint, n_tokens, n_bytes, checksum,
                                                     chain, n_prompt, blocks, version, fence)
        except OlderVersion:
            self._unlink_snapshot_files(final_name)
            raise
        self._after_commit(final_name, tokens, previous, in_ram)
        return snapshot

    def _after_commit(self, final_name: str, tokens: Tokens | None, previous: Snapshot | None, in_ram: bool) -> None:
        """Once a save is indexed: its tokens kept in memory, the state it replaced removed, the RAM dir trimmed."""
        if tokens is not None:
            self._tokens.put(final_name, tokens)
        if previous is not None and previous.filename != final_name:
            self._unlink_snapshot_files(previous.filename)
        if in_ram:
            self.trim_ram()

    def _split(self, source: Path, final_name: str, tokens: Tokens | None, fingerprint: str,
               n_written: int | None) -> Split | None:
        """Store a save as KV blocks and a tail (blockstore.py); None when it is kept whole."""
        if self.blocks.block_tokens <= 0:
            return None
        _check_size(source.stat().st_size, n_written)
        return self.blocks.split(source, final_name, tokens, fingerprint)

    def _commit_split(self, key: SessionKey, kind: SnapshotKind, temp_name: str, final_name: str, fingerprint: str,
                      n_tokens: int, split: Split, in_ram: bool, chain: Sequence[Link], n_prompt: int,
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
                previous, snapshot = self._index.replace(
                    key, kind, final_name, fingerprint, n_tokens, n_bytes, split.checksum, chain, n_prompt, blocks,
                    version, fence, tail_bytes=split.tail_bytes, kv_keys=split.keys,
                    kv_block_bytes=split.cut.block_bytes + BLOCK_HEADER_BYTES)
            except OlderVersion:
                self._unlink_snapshot_files(final_name)
                raise
        finally:
            self.blocks.release(split.keys)
        self._after_commit(final_name, tokens, previous, in_ram)
        log.debug("stored %s as %d blocks (%d bytes new) and a tail of %d bytes", final_name, len(split.keys),
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
        copies = self.ram.copies(_is_final_name)
        if sum(copies.values()) <= self.ram.budget:
            return 0
        for name in self.assembly.in_use():  # a copy a restore is about to read stays until it has read it
            copies.pop(name, None)
        indexed = self._index.filenames_by_use()
        unindexed = [name for name in copies if name not in set(indexed)]
        return self.ram.trim(copies, [*unindexed, *indexed])

    def ram_usage(self) -> tuple[int, int]:
        """(copies, bytes) in the RAM dir; (0, 0) without one."""
        return (0, 0) if self.ram is None else self.ram.usage(_is_final_name)

    # -- restoring ------------------------------------------------------------------------------------------

    def checked_snapshot(self, key: SessionKey, fingerprint: str,
                         kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        """The key's snapshot if its file is intact and made by this backend; else None (bad files quarantined)."""
        snapshot = self._index.get(key, kind)
        return None if snapshot is None else self._verified(snapshot, fingerprint)

    def prefix_matches(self, model: str, fingerprint: str, chain: Sequence[Link],
                       min_messages: int = 1) -> list[PrefixMatch]:
        """The intact states (of every kind, of this model and backend) sharing the most leading messages with
        `chain`, at least `min_messages`: the few that hold the deepest shared position (most recently used first).

        A digest covers every message up to its position, so a state that holds the request's digest at position i
        shares its first i+1 messages: positions are tried from the deepest one down, one indexed lookup each, and
        the first that an intact state holds wins. (Matching all digests in one join let SQLite scan every state of
        the model, and sort every conversation on a shared system prompt, on each lookup.)
        """
        for position in range(len(chain) - 1, max(min_messages, 1) - 2, -1):
            found = []
            for candidate in self._index.prefix_candidates(chain[position].digest, model, fingerprint):
                snapshot = self._verified(candidate, fingerprint)
                if snapshot is None:
                    continue
                total_chars = self._index.chain_chars(snapshot.filename)
                share = chain[position].chars / total_chars if total_chars else 0.0
                whole = chain[position].chars >= total_chars
                found.append(PrefixMatch(snapshot, position + 1, int(snapshot.owed_tokens * min(share, 1.0)), whole))
            if found:
                return found
        return []

    def best_prefix(self, model: str, fingerprint: str, chain: Sequence[Link],
                    min_messages: int = 1) -> PrefixMatch | None:
        """The most recently used of `prefix_matches`."""
        found = self.prefix_matches(model, fingerprint, chain, min_messages)
        return found[0] if found else None

    def in_ram(self, snapshot: Snapshot) -> bool:
        """Whether a restore of the state reads a copy in the RAM dir (not its file on disk)."""
        return self.ram is not None and self.ram.in_ram(snapshot.filename)

    def best_by_tokens(self, model: str, fingerprint: str, tokens: Tokens) -> list[TokenMatch]:
        """The intact states (of every kind) of this model and backend that share the most leading tokens with
        `tokens`, each with exactly how many: the deepest shared token block found in the index (index.py), then the
        states holding it compared token by token. Most shared first; empty when none shares a whole block."""
        depth, rows = self._index.deepest_blocks(block_hashes(tokens), model, fingerprint)
        if depth == 0:
            return []
        found = []
        for row in rows:
            snapshot = self._verified(row, fingerprint)
            saved = self.tokens_of(snapshot) if snapshot is not None else None
            if snapshot is not None and saved is not None:
                found.append(TokenMatch(snapshot, common_tokens(saved, tokens)))
        return sorted(found, key=lambda m: -m.tokens)

    def tokens_of(self, snapshot: Snapshot) -> Tokens | None:
        """The tokens a saved state holds, from memory or from its file (None: not a file this code reads)."""
        known = self._tokens.get(snapshot.filename)
        if known is not None:
            return known
        path = self.slot_dir / snapshot.filename
        if self.ram is not None and self.ram.in_ram(snapshot.filename):
            path = self.ram.path / snapshot.filename
        elif snapshot.tail_bytes:
            path = self.blocks.tail_path(snapshot.filename)  # a tail starts as its file did: header, then tokens
        tokens = read_tokens(path)
        if tokens is not None:
            self._tokens.put(snapshot.filename, tokens)
        return tokens

    def fill_blocks(self, limit: int = 256) -> int:
        """Index the token blocks of states saved before blocks were indexed (read from their files); returns how
        many were done. Called at start, in a worker thread, until it returns 0."""
        names = self._index.unblocked(limit)
        for name in names:
            tail = self.blocks.tail_path(name)  # a state kept as blocks: its tail starts as its file did
            tokens = read_tokens(tail if tail.is_file() else self.slot_dir / name)
            self._index.set_blocks(name, None if tokens is None else block_hashes(tokens))
        return len(names)

    def chain_of(self, snapshot: Snapshot) -> list[Link]:
        """The message chain recorded with a snapshot (empty when none was)."""
        return self._index.chain_of(snapshot.filename)

    def shared_prefix(self, snapshot: Snapshot, chain: Sequence[Link]) -> tuple[int, int] | None:
        """How many leading messages of `chain` the snapshot covers, and about how many of its prompt tokens that
        is (generated tokens are never counted: a client may send back another answer); None when no chain was
        recorded for it. All of its prompt when the request extends the snapshot's messages."""
        return shared_with(snapshot, self.chain_of(snapshot), chain)

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
            reason = self._tail_problem(snapshot)
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

    def _tail_problem(self, snapshot: Snapshot) -> str | None:
        """Why a state kept as blocks cannot be assembled, as far as its tail tells (its blocks are checked as they
        are read); None when it can. The tail is read again only when its stat identity moved."""
        name = snapshot.filename + TAIL_SUFFIX
        path = self.slot_dir / name
        try:
            st, identity = read_identity(path)
        except FileNotFoundError:
            return "its tail is missing"
        if not stat.S_ISREG(st.st_mode):
            return "its tail is not a regular file"
        if self.hashes.checksum(name, identity) == snapshot.checksum:
            return None
        try:
            manifest = self.blocks.manifest(snapshot.filename)
            self.blocks.read_tail(manifest, snapshot.filename)
        except (DamagedState, OSError) as exc:
            return str(exc)
        if manifest.checksum != snapshot.checksum or manifest.cut.layout.file_size != snapshot.n_bytes:
            return "its tail belongs to another save"
        self.hashes.remember(name, identity, snapshot.checksum)
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

    def open_parts(self, snapshot: Snapshot) -> tuple[BinaryIO, BlockManifest]:
        """A state kept as blocks, for an upload: its tail open for reading and its checked manifest; its blocks are
        held (never collected) until `release_parts`. DamagedState when its tail is not intact."""
        manifest = self.blocks.manifest(snapshot.filename)
        if manifest.checksum != snapshot.checksum:
            raise DamagedState("its tail belongs to another save")
        self.blocks.hold(manifest.keys)
        try:
            return self.blocks.tail_path(snapshot.filename).open("rb"), manifest
        except BaseException:
            self.blocks.release(manifest.keys)
            raise

    def release_parts(self, manifest: BlockManifest) -> None:
        self.blocks.release(manifest.keys)

    def appendix_extent(self, snapshot: Snapshot) -> tuple[Path, int | None]:
        """Where the state's slot file ends with its checkpoint appendix, if any: the file and its end (a tail's
        bytes end where the original file ended; its manifest follows)."""
        if not snapshot.tail_bytes:
            return self.slot_dir / snapshot.filename, None
        return self.blocks.tail_path(snapshot.filename), snapshot.tail_bytes

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
        if source.exists() or source.is_symlink():
            target_dir = self.slot_dir / QUARANTINE_DIR
            make_private_dir(target_dir)
            try:
                os.replace(source, target_dir / f"{snapshot.filename}.{int(time.time())}")
            except OSError as exc:
                log.error("could not move %s aside: %s", source, exc)
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
        """Remove quarantined files older than the budget's max age (a week without one), then, oldest first, as many
        as it takes for the snapshots and the quarantine together to fit the budget's total. Returns how many."""
        now = time.time() if now is None else now
        found = []
        try:
            with os.scandir(self.slot_dir / QUARANTINE_DIR) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    moved = entry.name.rsplit(".", 1)[-1]  # "<file>.<unix time it was moved aside>"
                    found.append((int(moved) if moved.isdigit() else st.st_mtime, st.st_size, Path(entry.path)))
        except FileNotFoundError:
            return 0
        keep_for = budget.max_age_seconds if budget.max_age_seconds > 0 else QUARANTINE_KEEP_SECONDS
        found.sort()
        removed = [f for f in found if now - f[0] > keep_for]
        if budget.max_bytes > 0:
            rest = [f for f in found if f not in removed]
            total = self._index.total_bytes() + sum(f[1] for f in rest)
            for f in rest:
                if total <= budget.max_bytes:
                    break
                removed.append(f)
                total -= f[1]
        for _, _, path in removed:
            unlink_quietly(path)
        if removed:
            log.info("removed %d quarantined file(s) (older than %.0f s, or over the disk budget)", len(removed),
                     keep_for)
        return len(removed)

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
        self._tokens.drop(filename)
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

    def sweep_blocks(self) -> int:
        """At start, in a worker thread: remove blocks no state names (a save that crashed before its commit, a
        removal that crashed before its blocks went) and block temporaries; returns how many blocks went."""
        orphans = self._index.orphan_refs()
        stored = self.blocks.stored_keys()
        unnamed = (stored - self._index.all_referenced()) | set(orphans)
        return self.blocks.collect(unnamed, self._index.referenced)

    def reconcile(self) -> ReconcileReport:
        """At start: remove our leftover temporaries and unindexed files, and rows whose file is gone.

        Only names of our own shape are touched: the directory may be shared with other tools.
        """
        indexed = self._index.filenames()
        temps = orphans = 0
        tails = {name for name in indexed if (self.slot_dir / (name + TAIL_SUFFIX)).is_file()}
        for entry in os.scandir(self.slot_dir):
            if _TEMP_NAME.match(entry.name) or _BLOCK_TEMP_NAME.match(entry.name):
                unlink_quietly(Path(entry.path))
                temps += 1
            elif entry.name in tails and entry.is_file(follow_symlinks=False):
                unlink_quietly(Path(entry.path))  # a whole file assembled for a restore that never finished
            elif _unindexed_own_file(entry.name, indexed):
                unlink_quietly(Path(entry.path))
                orphans += 1
        if self.ram is not None:
            orphans += self._reconcile_ram(indexed)
        self._index.drop_orphan_chains()
        dropped = 0
        for name in indexed:
            if name not in tails and not (self.slot_dir / name).is_file():
                self._index.drop(name)
                dropped += 1
        self.trim_ram()
        report = ReconcileReport(temps, orphans, dropped)
        if temps or orphans or dropped:
            log.info(
                "slot dir reconciled: %d temporaries and %d unindexed files removed, %d rows without a file dropped",
                temps, orphans, dropped,
            )
        return report

    def _reconcile_ram(self, indexed: set[str]) -> int:
        """At start, in the RAM dir: remove temporaries, half-made links, and names no snapshot has (copies
        of indexed snapshots stay: they are checked against their checksum before a restore uses them)."""
        assert self.ram is not None
        removed = 0
        for entry in os.scandir(self.ram.path):
            name = entry.name
            if _TEMP_NAME.match(name) or _BLOCK_TEMP_NAME.match(name) or name.startswith(".link-") or (
                    _is_final_name(name) and name not in indexed):
                self.ram.remove(name)
                removed += 1
        return removed

    # -- model file identities (cached, so a 20 GB GGUF is not re-read at every start) ------------------------

    def cached_identity(self, path: str, size: int, mtime_ns: int) -> str | None:
        return self._index.cached_identity(path, size, mtime_ns)

    def remember_identity(self, path: str, size: int, mtime_ns: int, identity: str) -> None:
        self._index.remember_identity(path, size, mtime_ns, identity)


def shared_with(snapshot: Snapshot, saved: Sequence[Link], chain: Sequence[Link]) -> tuple[int, int] | None:
    """`SnapshotStore.shared_prefix` for a snapshot whose recorded chain (`saved`) is already at hand."""
    if not saved:
        return None
    shared = common_prefix(saved, chain)
    if shared == len(saved):
        return shared, snapshot.owed_tokens
    if shared == 0:
        return 0, 0
    return shared, int(snapshot.owed_tokens * saved[shared - 1].chars / max(saved[-1].chars, 1))


class _TokenMemo:
    """Token lists by file name, the least recently used dropped past a total count. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lists: OrderedDict[str, Tokens] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def get(self, name: str) -> Tokens | None:
        with self._lock:
            tokens = self._lists.get(name)
            if tokens is not None:
                self._lists.move_to_end(name)
            return tokens

    def put(self, name: str, tokens: Tokens) -> None:
        with self._lock:
            old = self._lists.pop(name, None)
            self._total -= 0 if old is None else old.size
            self._lists[name] = tokens
            self._total += tokens.size
            while self._total > self._capacity and len(self._lists) > 1:
                _, dropped = self._lists.popitem(last=False)
                self._total -= dropped.size

    def drop(self, name: str) -> None:
        with self._lock:
            old = self._lists.pop(name, None)
            self._total -= 0 if old is None else old.size


def _is_final_name(name: str) -> bool:
    return bool(_FINAL_NAME.match(name))


def _check_size(n_bytes: int, n_written: int | None) -> None:
    """A file of another size than the backend says it wrote is torn, and never indexed."""
    if n_written is not None and n_bytes != n_written:
        raise OSError(f"the file has {n_bytes} bytes but the backend wrote {n_written}")


def _unindexed_own_file(name: str, indexed: set[str]) -> bool:
    """A snapshot file of our naming, or its sidecar, that no index row names."""
    base = name
    for suffix in (*SIDECAR_SUFFIXES, TAIL_SUFFIX):
        base = base.removesuffix(suffix)
    return bool(_FINAL_NAME.match(base)) and base not in indexed
