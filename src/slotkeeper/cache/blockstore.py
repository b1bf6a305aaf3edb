"""The block store's files: KV blocks under `blocks/` in the slot dir, and each saved state's tail beside its name.

- `blocks/<2 hex>/<key>.blk`: one block of B tokens' KV (blocks.py says which bytes), named by its key (a chained
  hash of the tokens up to its end and the backend's fingerprint). A 32-byte header (magic, payload length,
  xxh3-128 of the payload) comes first, so every read checks size and checksum before the bytes are used. Written
  once (temp name, fsync, rename); a block that exists is never rewritten.
- `<the state's file name>.tail` (`<40 hex>-<8 hex>.bin.tail`): the tail of the state's file (its bytes outside
  every full block, in file order: it starts with the slot file's header and token list, so the tokens are read
  from it as from a whole file), then a manifest (the cut, the block keys with their checksums, the tail's
  checksum), then a trailer (the manifest's length and checksum, a magic). Written once, after every block it
  names is durable.

A state is committed to the index only after its tail is durable, so no state ever names a missing block; blocks
no state names (a save that crashed before its commit, a state evicted) are removed by `collect`. A block being
written or named by a save not yet committed is "in flight" and never collected.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from slotkeeper.cache.blocks import (
    Cut,
    block_keys,
    block_payload,
    block_writes,
    layout_from_json,
    layout_to_json,
    place_block,
    place_block_runs,
    place_tail,
    plan_cut,
    tail_pieces,
    tail_writes,
)
from slotkeeper.cache.slotformat import parse_layout
from slotkeeper.cache.tokens import Tokens
from slotkeeper.files import fsync_dir, make_private_dir, unlink_quietly

log = logging.getLogger("slotkeeper.store")

BLOCKS_DIR = "blocks"
TAIL_SUFFIX = ".tail"
_BLOCK_MAGIC = b"SKKVBLK1"
_BLOCK_HEADER = struct.Struct("<8sQ16s")
BLOCK_HEADER_BYTES = _BLOCK_HEADER.size
_TAIL_MAGIC = b"SKTAIL01"
_TRAILER = struct.Struct("<Q16s8s")
_MANIFEST_MAX = 64 << 20
# Threads writing a save's new blocks.
WRITERS = 8


class DamagedState(Exception):
    """A state's tail or one of its blocks is missing or damaged: it cannot be assembled."""

    def __init__(self, reason: str, block: str | None = None) -> None:
        super().__init__(reason)
        self.block = block


class SplitFailed(OSError):
    """Writing a save's blocks or tail failed (a full disk): the blocks it wrote are the caller's to collect."""

    def __init__(self, cause: OSError, keys: tuple[str, ...]) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.keys = keys


@dataclass(frozen=True, slots=True)
class Split:
    """What a save stored: its cut, its blocks' keys, the bytes written, and the checksum of the file its blocks and
    tail assemble into (the saved file's own, unless a block already stored came from another state with other
    float noise)."""

    cut: Cut
    keys: tuple[str, ...]
    tail_bytes: int
    new_block_bytes: int
    checksum: str
    exact: bool = True  # the blocks and tail assemble into the saved file byte for byte


@dataclass(frozen=True, slots=True)
class Manifest:
    cut: Cut
    keys: tuple[str, ...]
    sums: tuple[str, ...]
    tail_checksum: str
    checksum: str


class BlockStore:
    """Blocks and tails under one slot dir. Thread-safe: the in-flight set has its own lock; files are written under
    fresh temporary names and renamed."""

    def __init__(self, slot_dir: Path, block_tokens: int) -> None:
        self.slot_dir = slot_dir
        self.root = slot_dir / BLOCKS_DIR
        self.block_tokens = block_tokens
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()

    def block_path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.blk"

    def tail_path(self, filename: str) -> Path:
        return self.slot_dir / (filename + TAIL_SUFFIX)

    # -- saving -----------------------------------------------------------------------------------------------

    def split(self, source: Path, filename: str, tokens: Tokens | None, fingerprint: str) -> Split | None:
        """Store the slot file `source` as blocks (those the store lacks) and the tail `<filename>.tail`; None when
        the file cannot be cut (an unknown layout, no full block): then it is kept whole. The keys are in flight
        until `release`."""
        if self.block_tokens <= 0 or tokens is None:
            return None
        cut = plan_cut(parse_layout(source), int(tokens.size), self.block_tokens)
        if cut is None:
            return None
        keys = tuple(block_keys(tokens, cut.n_blocks, cut.block_tokens, fingerprint, cut.layout))
        self.hold(keys)
        try:
            return self._split(source, filename, cut, keys)
        except OSError as exc:
            self.release(keys)
            raise SplitFailed(exc, keys) from exc
        except BaseException:
            self.release(keys)
            raise

    def _split(self, source: Path, filename: str, cut: Cut, keys: tuple[str, ...]) -> Split:
        # A numpy map of the file (not an mmap closed by hand: views of it may outlive an error's traceback), read
        # through a plain array view of it, which slices without the memmap subclass's per-slice bookkeeping.
        buffer = np.memmap(source, dtype=np.uint8, mode="r").view(np.ndarray)
        if buffer.size != cut.layout.file_size:
            raise OSError(f"{source} changed while it was cut")
        sums, new_bytes, differs = self._store_blocks(buffer, cut, keys)
        pieces = list(tail_pieces(buffer, cut))
        tail_checksum = xxhash.xxh3_128_hexdigest(b"".join(pieces))
        manifest = Manifest(cut, keys, sums, tail_checksum, "")
        # A block came from another state (other float noise): the file its blocks make is then not the saved one
        # byte for byte, and its checksum is the assembled file's.
        checksum = self._assembled_checksum(manifest, pieces) if differs else xxhash.xxh3_128_hexdigest(buffer.data)
        manifest = Manifest(cut, keys, sums, tail_checksum, checksum)
        self._write_tail(filename, pieces, manifest)
        return Split(cut, keys, cut.tail_size, new_bytes, checksum, not differs)

    def _store_blocks(self, buffer: np.ndarray, cut: Cut, keys: Sequence[str]) -> tuple[tuple[str, ...], int, bool]:
        """Write the blocks the store lacks; returns every block's stored checksum, the bytes written, and whether a
        stored block differs from this file's."""
        sums, new_bytes, differs, dirs = [], 0, False, set()
        # Several writers: the file system commits their fsyncs together (measured here: 21 blocks in 5 ms instead of
        # 15), and a commit sooner is a state the next request finds. At most 2 x WRITERS payloads wait in memory.
        with ThreadPoolExecutor(max_workers=WRITERS) as writers:
            pending: deque[Future[None]] = deque()
            for b, key in enumerate(keys):
                payload = block_payload(buffer, cut, b).data
                own = xxhash.xxh3_128_digest(payload)
                stored = self._stored_sum(key)
                if stored is None:
                    pending.append(writers.submit(self._write_block, key, payload, own))
                    if len(pending) >= 2 * WRITERS:
                        pending.popleft().result()
                    dirs.add(self.block_path(key).parent)
                    new_bytes += len(payload)
                    stored = own
                differs |= stored != own
                sums.append(stored.hex())
            for future in pending:
                future.result()
        for directory in dirs:
            fsync_dir(directory)
        return tuple(sums), new_bytes, differs

    def _assembled_checksum(self, manifest: Manifest, pieces: Sequence[bytes | memoryview]) -> str:
        out = np.empty(manifest.cut.layout.file_size, dtype=np.uint8)
        place_tail(out, manifest.cut, b"".join(pieces))
        for b, (key, digest) in enumerate(zip(manifest.keys, manifest.sums, strict=True)):
            place_block(out, manifest.cut, b, self.read_block(key, digest))
        return xxhash.xxh3_128_hexdigest(out.data)

    def _stored_sum(self, key: str) -> bytes | None:
        """The checksum in a stored block's header; None when there is none (or it is not one of ours)."""
        try:
            with self.block_path(key).open("rb") as fh:
                header = fh.read(_BLOCK_HEADER.size)
        except OSError:
            return None
        if len(header) != _BLOCK_HEADER.size:
            return None
        magic, _, digest = _BLOCK_HEADER.unpack(header)
        return digest if magic == _BLOCK_MAGIC else None

    def _write_block(self, key: str, payload: memoryview, digest: bytes) -> None:
        path = self.block_path(key)
        make_private_dir(path.parent)
        _write_atomically(path, [_BLOCK_HEADER.pack(_BLOCK_MAGIC, len(payload), digest), payload])

    def _write_tail(self, filename: str, pieces: Sequence[bytes | memoryview], manifest: Manifest) -> None:
        body = json.dumps({
            "cut": layout_to_json(manifest.cut), "keys": list(manifest.keys), "sums": list(manifest.sums),
            "tail_checksum": manifest.tail_checksum, "checksum": manifest.checksum,
        }, separators=(",", ":")).encode()
        trailer = _TRAILER.pack(len(body), xxhash.xxh3_128_digest(body), _TAIL_MAGIC)
        path = self.tail_path(filename)
        _write_atomically(path, [*pieces, body, trailer])
        fsync_dir(path.parent)

    def hold(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._in_flight.update(keys)

    def release(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._in_flight.subtract(keys)
            self._in_flight += Counter()  # drops the keys no save holds any more

    # -- reading ----------------------------------------------------------------------------------------------

    def manifest(self, filename: str) -> Manifest:
        """The checked manifest of a state's tail (DamagedState when it is missing or not intact)."""
        return self.manifest_at(self.tail_path(filename))

    @staticmethod
    def manifest_at(path: Path) -> Manifest:
        """The checked manifest of the tail file at `path` (one here, or one downloaded)."""
        try:
            with path.open("rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                if size < _TRAILER.size:
                    raise DamagedState("its tail is too short")
                fh.seek(size - _TRAILER.size)
                length, digest, magic = _TRAILER.unpack(fh.read(_TRAILER.size))
                if magic != _TAIL_MAGIC or length > min(_MANIFEST_MAX, size - _TRAILER.size):
                    raise DamagedState("its tail has no manifest")
                fh.seek(size - _TRAILER.size - length)
                body = fh.read(length)
        except FileNotFoundError as exc:
            raise DamagedState("its tail is missing") from exc
        except OSError as exc:
            raise DamagedState(f"its tail cannot be read: {exc}") from exc
        if xxhash.xxh3_128_digest(body) != digest:
            raise DamagedState("its manifest's checksum does not match")
        try:
            data = json.loads(body)
            cut = layout_from_json(data["cut"])
            keys, sums = tuple(map(str, data["keys"])), tuple(map(str, data["sums"]))
            manifest = Manifest(cut, keys, sums, str(data["tail_checksum"]), str(data["checksum"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise DamagedState(f"its manifest is not one this code reads: {exc}") from exc
        if len(keys) != cut.n_blocks or len(sums) != cut.n_blocks or cut.tail_size != size - _TRAILER.size - length:
            raise DamagedState("its manifest does not match its tail")
        return manifest

    def read_block(self, key: str, digest_hex: str) -> bytes:
        """A block's payload, checked against its header and the checksum the state recorded."""
        return _checked_block(self.block_path(key), key, digest_hex)

    def has_block(self, key: str, digest_hex: str) -> bool:
        """Whether the store holds the block with this checksum (by its header; its bytes are checked on use)."""
        stored = self._stored_sum(key)
        return stored is not None and stored.hex() == digest_hex

    def adopt_block(self, key: str, digest_hex: str, source: Path) -> bool:
        """Take a downloaded block file into the store once it is checked (DamagedState if it is not); False when
        the store holds another block of that key (float noise of another state): `source` is left for the caller."""
        _checked_block(source, key, digest_hex)
        if self._stored_sum(key) is not None:
            return False
        path = self.block_path(key)
        make_private_dir(path.parent)
        with source.open("rb") as fh:
            os.fsync(fh.fileno())
        os.replace(source, path)
        fsync_dir(path.parent)
        return True

    def temp_path(self, label: str) -> Path:
        """A temporary name under the store, for a download (swept at start if a crash leaves it)."""
        directory = self.root / "incoming"
        make_private_dir(directory)
        return directory / f".tmp-{secrets.token_hex(4)}-{label}"

    def read_tail(self, manifest: Manifest, filename: str) -> bytes:
        """The tail's bytes (without the manifest), checked against the manifest's checksum."""
        return self.read_tail_at(manifest, self.tail_path(filename))

    @staticmethod
    def read_tail_at(manifest: Manifest, path: Path) -> bytes:
        with path.open("rb") as fh:
            tail = fh.read(manifest.cut.tail_size)
        if len(tail) != manifest.cut.tail_size or xxhash.xxh3_128_hexdigest(tail) != manifest.tail_checksum:
            raise DamagedState("its tail does not match its checksum")
        return tail

    def assemble(self, filename: str, target: Path) -> tuple[int, str]:
        """Write the state's whole slot file to `target` (a temporary name, then a rename), every block and the tail
        checked on the way; returns (bytes, the checksum the manifest gives the file). DamagedState when a piece is
        missing or damaged (nothing is left at `target` then)."""
        return self.assemble_from(self.tail_path(filename), target)

    def assemble_from(self, tail_path: Path, target: Path, blocks: dict[str, Path] | None = None) -> tuple[int, str]:
        """`assemble` from the tail at `tail_path`, reading the blocks named in `blocks` from those files instead of
        the store (a download whose block differs from the one stored here by float noise)."""
        manifest = self.manifest_at(tail_path)
        try:
            tail = self.read_tail_at(manifest, tail_path)
        except OSError as exc:
            raise DamagedState(f"its tail cannot be read: {exc}") from exc
        size = manifest.cut.layout.file_size
        temp = target.with_name(f".assembling-{secrets.token_hex(4)}-{target.name}")
        cut = manifest.cut
        several_runs = any(r.n_outer > 1 for r in cut.layout.regions)
        try:
            # Not synced: a copy of what the blocks hold, read back through the page cache. Rows go by pwrite (no page
            # faults of a map); a V stored transposed, a run per element, through a map of the file.
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                out = np.memmap(temp, dtype=np.uint8, mode="r+", shape=(size,)) if several_runs else None
                if out is not None:
                    place_tail(out, cut, tail)
                else:
                    _pwrite_all(fd, tail_writes(cut, tail))
                for b, (key, digest) in enumerate(zip(manifest.keys, manifest.sums, strict=True)):
                    source = (blocks or {}).get(key)
                    payload = self.read_block(key, digest) if source is None else _checked_block(source, key, digest)
                    _pwrite_all(fd, block_writes(cut, b, payload))
                    if out is not None:
                        place_block_runs(out, cut, b, payload)
                del out
            finally:
                os.close(fd)
            os.replace(temp, target)
        except BaseException:
            unlink_quietly(temp)
            raise
        return size, manifest.checksum

    # -- removing ---------------------------------------------------------------------------------------------

    def remove_tail(self, filename: str) -> None:
        unlink_quietly(self.tail_path(filename))

    def collect(self, keys: Iterable[str], referenced: Callable[[Sequence[str]], set[str]]) -> int:
        """Remove the blocks among `keys` that no state names (`referenced` says which are named) and no save holds;
        returns how many went."""
        candidates = sorted(set(keys))
        if not candidates:
            return 0
        named = referenced(candidates)
        removed = 0
        with self._lock:  # a save that holds a key before it looks for its block keeps it
            for key in candidates:
                if key not in named and not self._in_flight.get(key):
                    unlink_quietly(self.block_path(key))
                    removed += 1
        return removed

    def forget_damaged(self, key: str) -> None:
        """A damaged block goes, so that the next save of those tokens writes it again."""
        unlink_quietly(self.block_path(key))

    def stored_keys(self) -> set[str]:
        """Every block key on disk (for the start's sweep of blocks no state names)."""
        found: set[str] = set()
        try:
            with os.scandir(self.root) as dirs:
                for directory in dirs:
                    if not directory.is_dir(follow_symlinks=False):
                        continue
                    with os.scandir(directory.path) as entries:
                        for entry in entries:
                            if entry.name.startswith(".tmp-"):  # a write a crash cut short
                                unlink_quietly(Path(entry.path))
                            elif entry.name.endswith(".blk"):
                                found.add(entry.name[:-4])
        except FileNotFoundError:
            pass
        return found

    def usage(self) -> tuple[int, int]:
        """(blocks, bytes) on disk."""
        count = total = 0
        try:
            with os.scandir(self.root) as dirs:
                for directory in dirs:
                    if directory.is_dir(follow_symlinks=False):
                        with os.scandir(directory.path) as entries:
                            for entry in entries:
                                if entry.name.endswith(".blk") and not entry.name.startswith("."):
                                    count += 1
                                    total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
        return count, total


def _pwrite_all(fd: int, writes: Iterable[tuple[int, memoryview]]) -> None:
    for offset, view in writes:
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n


def _checked_block(path: Path, key: str, digest_hex: str) -> bytes:
    """The payload of the block file at `path`, checked: its header's magic and length, and its checksum against
    both its header and `digest_hex` (what the state that names it recorded)."""
    try:
        with path.open("rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise DamagedState(f"block {key} is missing", key) from exc
    if len(data) < _BLOCK_HEADER.size:
        raise DamagedState(f"block {key} is truncated", key)
    magic, length, digest = _BLOCK_HEADER.unpack_from(data)
    payload = data[_BLOCK_HEADER.size:]
    if magic != _BLOCK_MAGIC or length != len(payload):
        raise DamagedState(f"block {key} is truncated or not a block", key)
    if digest.hex() != digest_hex or xxhash.xxh3_128_digest(payload) != digest:
        raise DamagedState(f"block {key} does not match its checksum", key)
    return payload


def _write_atomically(path: Path, pieces: Iterable[bytes | memoryview]) -> None:
    """Write `pieces` to a temporary name beside `path`, fsync, and rename: a crash leaves the old state or the new
    one, never a torn file (a temporary at most, which the start's sweep removes)."""
    temp = path.with_name(f".tmp-{secrets.token_hex(4)}-{path.name}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for piece in pieces:
                view = memoryview(piece)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        unlink_quietly(temp)
        raise
