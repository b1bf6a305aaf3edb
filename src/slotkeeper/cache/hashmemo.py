"""The checksums this process already computed, keyed by the file's stat identity, so that a restore re-hashes a
snapshot file only when something may have changed it since.

A file's identity is (inode, size, mtime, ctime) as lstat reads it. Every write, truncation, utime, chmod or rename
onto the name moves ctime, which no program can set back, so an unchanged identity means unchanged content, with one
gap: a kernel that stamps files from a coarse clock (Linux before 6.13, most file systems) gives a change made in the
same clock tick as the lstat the same ctime. `fine_timestamps` finds out once whether the slot directory has that
gap; where it does, an identity counts only if its ctime was already a tick older than the moment it was read, so
no change after the read can carry the same stamp. (A change the hash missed can only come after the lstat: the
hash is taken after it.)
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

# How stale a coarse ctime must be, when read, to tell every later change apart: above the longest kernel tick
# (10 ms at HZ=100); a file system that keeps whole seconds only gets whole seconds, and two of them.
_COARSE_TICK_NS = 20_000_000
_WHOLE_SECOND_TICK_NS = 2_000_000_000
# Files remembered at most: far more than the snapshots a slot directory holds between two starts that matter.
_REMEMBERED = 8192


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What lstat said about a file, and when (wall clock, the clock file stamps come from) it was asked."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    read_at_ns: int

    @classmethod
    def of(cls, st: os.stat_result, read_at_ns: int) -> FileIdentity:
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, read_at_ns)

    def same_file_state(self, other: FileIdentity) -> bool:
        return (self.ino, self.size, self.mtime_ns, self.ctime_ns) == (
            other.ino, other.size, other.mtime_ns, other.ctime_ns)

    def settled(self) -> bool:
        """Whether, with coarse timestamps, any change after this reading is sure to get another ctime."""
        tick = _WHOLE_SECOND_TICK_NS if self.ctime_ns % 1_000_000_000 == 0 else _COARSE_TICK_NS
        return self.ctime_ns + tick <= self.read_at_ns


def read_identity(path: Path) -> tuple[os.stat_result, FileIdentity]:
    """lstat `path` (raises OSError) and the identity it gives; the time is taken first, so it is never late."""
    read_at = time.time_ns()
    st = path.lstat()
    return st, FileIdentity.of(st, read_at)


def fine_timestamps(directory: Path, trials: int = 3) -> bool:
    """Whether a change right after an lstat gets a new ctime in `directory` (multigrain timestamps, Linux 6.13+ on
    ext4, xfs, btrfs and tmpfs). False when that cannot be found out: the careful answer."""
    probe = directory / f".slotkeeper-clock-probe-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for i in range(trials):
                before = os.fstat(fd).st_ctime_ns
                os.pwrite(fd, bytes([i]), 0)
                if os.fstat(fd).st_ctime_ns == before:
                    return False
        finally:
            os.close(fd)
            probe.unlink()
    except OSError:
        return False
    return True


class HashMemo:
    """File name -> (identity, checksum) of files whose whole content this process hashed. Thread-safe."""

    def __init__(self, fine: bool, limit: int = _REMEMBERED) -> None:
        self._fine = fine
        self._limit = limit
        self._lock = threading.Lock()
        self._known: OrderedDict[str, tuple[FileIdentity, str]] = OrderedDict()

    def checksum(self, name: str, now: FileIdentity) -> str | None:
        """The checksum hashed from this file when its identity was the one read `now`; None when it must be
        hashed again (never hashed, changed since, or read too close to a change to be sure of it)."""
        with self._lock:
            entry = self._known.get(name)
        if entry is None:
            return None
        then, checksum = entry
        if not then.same_file_state(now) or not (self._fine or then.settled()):
            return None
        return checksum

    def remember(self, name: str, identity: FileIdentity, checksum: str) -> None:
        """`checksum` is of the whole file, hashed after `identity` was read."""
        with self._lock:
            self._known[name] = (identity, checksum)
            self._known.move_to_end(name)
            while len(self._known) > self._limit:
                self._known.popitem(last=False)

    def forget(self, name: str) -> None:
        with self._lock:
            self._known.pop(name, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._known)
