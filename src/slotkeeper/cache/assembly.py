"""Whole slot files put back together from the block store, for the backend to restore and for exports.

llama-server restores only a whole file, by its name in its --slot-save-path. A state kept as blocks is assembled
there just before its restore: into the RAM dir, where the copy then stays within the RAM budget as a save's would;
or, without one, into the slot dir, where it is removed once the restore is over. A name in use by a restore is
counted, so that two restores of one state share one file and the RAM dir's trim never takes it away under a
restore. At start, the most recently used states are assembled into the RAM dir ahead of their restores.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from slotkeeper.cache.blockstore import BlockStore, DamagedState
from slotkeeper.cache.hashmemo import read_identity
from slotkeeper.cache.ramdir import RamDir
from slotkeeper.files import unlink_quietly
from slotkeeper.types import Snapshot

log = logging.getLogger("slotkeeper.store")

# The share of the RAM budget that assembling at start may fill.
PREWARM_SHARE = 0.5


class Assembly:
    """Assembled files of states kept as blocks, and the restores using them. Thread-safe."""

    def __init__(self, blocks: BlockStore, slot_dir: Path, ram: RamDir | None) -> None:
        self.blocks = blocks
        self.slot_dir = slot_dir
        self.ram = ram
        self._in_use: Counter[str] = Counter()
        self._on_disk: set[str] = set()  # assembled in the slot dir though there is a RAM dir (it had no room)
        self._lock = threading.Lock()
        self.last_problem = ""  # why the last `materialize` that failed failed

    def in_use(self) -> list[str]:
        with self._lock:
            return list(self._in_use)

    def materialize(self, snapshot: Snapshot) -> bool | None:
        """Make the state's whole file ready for the backend to restore by its name: a state kept as blocks is
        assembled (every block checked as it is read), unless the RAM dir holds an intact copy. True when it was
        assembled, None when there was nothing to do, False when a piece is missing or damaged (a damaged block is
        removed, so the next save of those tokens writes it again)."""
        if not snapshot.tail_bytes:
            return None
        with self._lock:  # in use by a restore until `restored`: never trimmed or removed meanwhile
            self._in_use[snapshot.filename] += 1
            if self.ram is None and self._in_use[snapshot.filename] > 1 and \
                    (self.slot_dir / snapshot.filename).is_file():
                return None  # another restore assembled it a moment ago and has not finished with it
        if self.ram is not None and self.ram.intact_copy(snapshot.filename, snapshot.n_bytes, snapshot.checksum):
            return None
        try:
            self._assemble(snapshot)
        except (DamagedState, OSError) as exc:  # a damaged block is quarantined by the assembly that met it
            self.restored(snapshot)
            self.last_problem = str(exc)
            return False
        return True

    def _assemble(self, snapshot: Snapshot) -> None:
        name = snapshot.filename
        if self.ram is not None:
            try:
                _, checksum = self.blocks.assemble(name, self.ram.path / name)
            except OSError as exc:  # the RAM dir has no room for it: the slot dir, through a link, as a save would
                log.warning("assembling %s in the RAM dir failed (%s): it is assembled in the slot dir", name, exc)
            else:
                _, identity = read_identity(self.ram.path / name)
                self.ram.hashes.remember(name, identity, checksum)
                return
        self.blocks.assemble(name, self.slot_dir / name)
        if self.ram is not None:
            with self._lock:
                self._on_disk.add(name)
            self.ram.link(name)

    def restored(self, snapshot: Snapshot) -> None:
        """A restore `materialize` prepared is over: the whole file assembled in the slot dir goes (a RAM dir keeps
        its copy, within its budget)."""
        if not snapshot.tail_bytes:
            return
        with self._lock:
            self._in_use[snapshot.filename] -= 1
            if self._in_use[snapshot.filename] > 0:
                return
            del self._in_use[snapshot.filename]
            if self.ram is None or snapshot.filename in self._on_disk:
                self._on_disk.discard(snapshot.filename)
                unlink_quietly(self.slot_dir / snapshot.filename)

    def prewarm(self, by_use: Iterable[Snapshot], fingerprint: str) -> int:
        """At start, in a worker thread: assemble the most recently used (first in `by_use`) states of this backend
        kept as blocks into the RAM dir, as many as fit in its PREWARM_SHARE, so that their first restores after a
        restart read memory (as a RAM copy would have before it) instead of assembling first. Returns how many."""
        if self.ram is None:
            return 0
        room = int(self.ram.budget * PREWARM_SHARE) - self.ram.usage(_any_name)[1]
        done = 0
        for snapshot in by_use:
            if room <= 0:
                break
            if (not snapshot.tail_bytes or snapshot.fingerprint != fingerprint or snapshot.n_bytes > room
                    or self.ram.in_ram(snapshot.filename)):
                continue
            with self._lock:
                if snapshot.filename in self._in_use:
                    continue  # a restore is assembling it
            target = self.ram.path / snapshot.filename
            try:
                _, checksum = self.blocks.assemble(snapshot.filename, target)
                _, identity = read_identity(target)
            except (DamagedState, OSError):
                continue  # its damaged block is quarantined; its restore will find the state unassemblable
            self.ram.hashes.remember(snapshot.filename, identity, checksum)
            room -= snapshot.n_bytes
            done += 1
        return done

    def open_whole(self, snapshot: Snapshot) -> BinaryIO:
        """The state's whole file, open for reading (a state kept as blocks is assembled into a temporary file that
        is gone when it is closed). FileNotFoundError when it is gone; DamagedState when it cannot be assembled (its
        damaged block quarantined, as for a restore: BlockStore.assemble_from)."""
        if not snapshot.tail_bytes:
            return (self.slot_dir / snapshot.filename).open("rb")
        temp = self.slot_dir / f".export-{secrets.token_hex(4)}.bin"
        self.blocks.assemble(snapshot.filename, temp)
        try:
            return temp.open("rb")
        finally:
            unlink_quietly(temp)


def _any_name(name: str) -> bool:
    return not name.startswith(".")
