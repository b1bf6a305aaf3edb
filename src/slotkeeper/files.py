"""File helpers of the snapshot store and the RAM dir: whole-file checksums, durable copies, quiet removal."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import mmap
import os
from pathlib import Path

import xxhash

log = logging.getLogger("slotkeeper.store")

_CHUNK = 4 * 1024 * 1024
# Direct I/O wants buffers, offsets and lengths in whole blocks of the device; 4 KiB is a multiple of every common one.
_BLOCK = 4096


def file_checksum(path: Path) -> str:
    """xxh3-128 of a whole file: fast enough to run on every restore of a multi-gigabyte snapshot."""
    digest = xxhash.xxh3_128()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def copy_durably(source: Path, target: Path) -> tuple[int, str]:
    """Copy `source` to a new file `target` and fsync it; returns (bytes, xxh3-128 of them).

    The target is written with O_DIRECT where the file system allows it: the bytes go from our buffer to the disk,
    not into the page cache (which costs CPU and memory a running model would rather keep). Elsewhere (tmpfs, some
    network file systems) it is an ordinary write. The digest is of the bytes that were written.
    """
    try:
        return _copy(source, target, direct=True)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        unlink_quietly(target)
        return _copy(source, target, direct=False)


def _copy(source: Path, target: Path, direct: bool) -> tuple[int, str]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
    digest = xxhash.xxh3_128()
    buffer = mmap.mmap(-1, _CHUNK)  # page-aligned, as direct I/O wants
    view = memoryview(buffer)
    total = 0
    try:
        with source.open("rb", buffering=0) as src:
            fd = os.open(target, flags, 0o600)
            try:
                while n := _fill(src, view):
                    digest.update(view[:n])
                    length = n
                    if direct and n % _BLOCK:  # the last piece: padded to a whole block, cut back below
                        length = n + _BLOCK - n % _BLOCK
                        view[n:length] = bytes(length - n)
                    if os.write(fd, view[:length]) != length:
                        raise OSError(errno.ENOSPC, "short write")
                    total += n
                if direct:
                    os.ftruncate(fd, total)
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        unlink_quietly(target)
        raise
    finally:
        view.release()
        with contextlib.suppress(BufferError):  # a slice still held by a traceback: the collector closes it
            buffer.close()
    return total, digest.hexdigest()


def _fill(src: io.RawIOBase, view: memoryview) -> int:
    """Read into `view` until it is full or the file ends (a short read in between would misalign the next write)."""
    filled = 0
    while filled < len(view):
        n = src.readinto(view[filled:])
        if not n:
            break
        filled += n
    return filled


def unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.error("could not remove %s: %s", path, exc)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_dir(path: Path) -> None:
    """The directory, made (with its parents) readable by this user only if it is new."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
