"""The RAM dir: the backend's --slot-save-path on a memory file system (tmpfs), in front of the slot dir on disk.

The backend writes a slot's state into a file and reads it back by name, in the one directory it was started with.
On this project's test machine (ext4 on a virtual disk) writing 56 MiB through the page cache took about 140 ms of
CPU, and the backend's slot stays busy for all of it; into tmpfs the same write took 23 ms. So when slotkeeper has
a RAM dir (it starts the backend itself, or was told where the backend writes):

- a save lands in the RAM dir; the commit, in the background, copies it to the slot dir with direct I/O (no page
  cache, about 1 ms of CPU for those 56 MiB), hashing it on the way, and then keeps the RAM file under the
  snapshot's final name as a copy for the next restores;
- the copies are bounded by the RAM budget: the least recently used are replaced by symlinks to their file in the
  slot dir, atomically, so that a restore that already chose the name still finds it;
- a snapshot without a copy is reached through a symlink, made before it is restored; so every name the backend is
  given resolves in the RAM dir, and the slot dir stays the one place where snapshots are kept.

The RAM dir holds nothing that is not also on disk (apart from a save being committed), so it may be emptied at any
time: slotkeeper removes it at a clean exit, and a reboot does the same.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from slotkeeper.cache.hashmemo import HashMemo, fine_timestamps, read_identity
from slotkeeper.files import file_checksum, unlink_quietly

log = logging.getLogger("slotkeeper.store")

# A save goes to RAM only with this much room beyond twice the largest snapshot seen, so that the tmpfs is not filled.
_HEADROOM = 64 * 1024 * 1024


class RamDir:
    """The directory the backend reads and writes, with copies of recent snapshots and symlinks to the others.
    Thread-safe; the store calls it from worker threads."""

    def __init__(self, path: Path, slot_dir: Path, budget: int) -> None:
        self.path = path
        self.slot_dir = slot_dir
        self.budget = budget
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.hashes = HashMemo(fine_timestamps(path))
        self._lock = threading.Lock()
        self._largest = 0

    # -- saving -----------------------------------------------------------------------------------------------

    def prepare_save(self, name: str) -> bool:
        """Get `name` ready for the backend to save into: True when the save goes into RAM; False when the RAM dir
        lacks room, and `name` was made a symlink to the file in the slot dir, where the backend then writes."""
        try:
            st = os.statvfs(self.path)
            room = st.f_bavail * st.f_frsize
        except OSError:
            room = 0
        if room >= 2 * self._largest + _HEADROOM:
            return True
        self.link(name)
        return False

    def in_ram(self, name: str) -> bool:
        """Whether `name` is a file here (a save that landed in RAM, or a copy), not a symlink to the slot dir."""
        try:
            return stat.S_ISREG(os.lstat(self.path / name).st_mode)
        except OSError:
            return False

    def keep_copy(self, temp_name: str, final_name: str, checksum: str) -> None:
        """After the commit: the saved file stays here as the copy of snapshot `final_name`."""
        target = self.path / final_name
        os.replace(self.path / temp_name, target)
        _, identity = read_identity(target)
        self.hashes.remember(final_name, identity, checksum)

    def saw(self, n_bytes: int) -> None:
        """A snapshot of `n_bytes` was saved: a save goes to RAM only with room for twice the largest one."""
        with self._lock:
            self._largest = max(self._largest, n_bytes)

    # -- restoring --------------------------------------------------------------------------------------------

    def intact_copy(self, name: str, n_bytes: int, checksum: str) -> bool:
        """Whether the backend may restore `name` from the copy here: it is a file of the right size and content
        (hashed again only when its identity moved since it was last hashed). A copy that is not is replaced by a
        symlink to the slot dir (False)."""
        path = self.path / name
        try:
            st, identity = read_identity(path)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        if st.st_size == n_bytes:
            if self.hashes.checksum(name, identity) == checksum:
                return True
            if file_checksum(path) == checksum:
                self.hashes.remember(name, identity, checksum)
                return True
        log.warning("the RAM copy of %s does not match its snapshot: the file on disk is used instead", name)
        self.link(name)
        return False

    def link(self, name: str) -> None:
        """Make `name` here a symlink to the file of that name in the slot dir, replacing whatever it was in one
        step (a restore reading it gets either the old file or the new link). Nothing is written when it is that
        link already (every restore from disk, and every prefix lookup's candidate, asks for it)."""
        target = self.slot_dir / name
        try:
            if os.readlink(self.path / name) == str(target):
                return
        except OSError:
            pass  # missing, or a file (a copy or a save) to be replaced
        temp = self.path / f".link-{secrets.token_hex(4)}"
        os.symlink(target, temp)
        try:
            os.replace(temp, self.path / name)
        except BaseException:
            unlink_quietly(temp)
            raise
        self.hashes.forget(name)

    def remove(self, name: str) -> None:
        self.hashes.forget(name)
        unlink_quietly(self.path / name)

    # -- the budget -----------------------------------------------------------------------------------------

    def copies(self, own: Callable[[str], bool]) -> dict[str, int]:
        """The copies here (files, not links) whose names `own` accepts, with their sizes."""
        out: dict[str, int] = {}
        for entry in os.scandir(self.path):
            if own(entry.name) and entry.is_file(follow_symlinks=False):
                try:
                    out[entry.name] = entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
        return out

    def trim(self, copies: dict[str, int], oldest_first: Iterable[str]) -> int:
        """Replace copies by links, in the order given, until the rest fit the budget; returns how many went."""
        total = sum(copies.values())
        dropped = 0
        for name in oldest_first:
            if total <= self.budget:
                break
            if name in copies:
                self.link(name)
                total -= copies[name]
                dropped += 1
        return dropped

    def usage(self, own: Callable[[str], bool]) -> tuple[int, int]:
        """(copies, bytes) held here."""
        copies = self.copies(own)
        return len(copies), sum(copies.values())

    # -- start and exit ---------------------------------------------------------------------------------------

    def remove_all(self) -> None:
        """Empty and remove the RAM dir (at exit, once every save was committed): everything in it is on disk."""
        shutil.rmtree(self.path, ignore_errors=True)
