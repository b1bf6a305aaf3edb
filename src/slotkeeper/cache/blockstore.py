"""The block store's files: KV blocks under `blocks/` in the slot dir, and each saved state's tail beside its name.

- `blocks/<2 hex>/<digest>.blk`: one block of tokens' KV (blocks.py says which bytes), named by its *digest*, the
  xxh3-128 of its bytes. A name is its content: a block is written once (temp name, fsync, rename) and never
  rewritten, and a block whose bytes do not hash to its name is damaged, whoever wrote it. A 32-byte header (magic,
  payload length, the digest again) comes first, so every read checks size and digest before the bytes are used.
- `<the state's file name>.tail` (`<40 hex>-<8 hex>.bin.tail`): the tail of the state's file (its bytes outside
  every block, in file order, but the cell metadata that says only which positions the cells hold: it starts with
  the slot file's header and token list, so the tokens are read from it as from a whole file), then a manifest (the
  cut, each block's key and digest, the tail's checksum), then a trailer (the manifest's length and checksum, a
  magic). Written once, after every block it names is durable.

A block's *key* (blocks.py: its tokens, its span, the fingerprint, the KV's shape and types) says which KV it stands
for. The index keeps, for the states this host saved itself, which blocks start at each position's key and which
digest each block key was stored as (`split`'s `stored`): a later save cuts its blocks where those end (a
conversation's next save names its last save's blocks, the last one too, and writes only the cells after them), and
names a stored block rather than storing its own float noise of the same key again. States brought from elsewhere
(an import, the shared tier) name their blocks by digest only, and their blocks are offered to no other state: a
block shared by key is always one this host's backend wrote.

What is alive is decided in one place, under one lock: the blocks named by committed states (the index's rows) and
the blocks held by work in flight (a save between its split and its commit, an upload, a download before its
import). `collect` reads the rows and removes blocks under that lock, and `release` takes it too, after the commit:
so a block a commit names is either still held or already named when a collection looks at it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import xxhash

from slotkeeper.cache.blocks import (
    Cut,
    Positions,
    StoredBlock,
    block_payload,
    block_writes,
    cut_limit,
    follow_ends,
    grid_ends,
    layout_from_json,
    layout_to_json,
    meta_matches,
    place_block,
    place_block_runs,
    place_tail,
    tail_pieces,
    tail_writes,
)
from slotkeeper.cache.quarantine import move_aside
from slotkeeper.cache.slotformat import SlotLayout, parse_layout
from slotkeeper.cache.tokens import Tokens
from slotkeeper.files import fsync_dir, make_private_dir, unlink_quietly

log = logging.getLogger("slotkeeper.store")

BLOCKS_DIR = "blocks"
TAIL_SUFFIX = ".tail"
_BLOCK_MAGIC = b"SKKVBLK2"
_BLOCK_HEADER = struct.Struct("<8sQ16s")
BLOCK_HEADER_BYTES = _BLOCK_HEADER.size
_TAIL_MAGIC = b"SKTAIL03"
_TAIL_MAGICS = (_TAIL_MAGIC, b"SKTAIL02")  # 02: blocks on the grid only (a count of blocks, not their ends)
_TRAILER = struct.Struct("<Q16s8s")
_MANIFEST_MAX = 64 << 20
_HEX32 = frozenset("0123456789abcdef")
# Threads writing a save's new blocks.
WRITERS = 8
# A temporary under `blocks/` is named `.tmp-<pid>.<host>.<nonce>-<name>`, after the process writing it. The start's
# sweep removes at once those of this host's processes that are gone (a crash, a kill -9 just before this start).
# Those of a live process or another host go only once they are older than this before the store was opened: a write
# in flight is never that old (file times run up to a clock tick behind the wall clock).
TEMP_MARGIN_SECONDS = 5.0
_HOST = xxhash.xxh3_64_hexdigest(socket.gethostname().encode())[:8]

# The blocks this host's own saves stored from each position asked (its key, `Positions.opens`), from the index.
Stored = Callable[[Sequence[str]], Mapping[str, Sequence[StoredBlock]]]


def is_digest(text: str) -> bool:
    """Whether `text` is a block digest (or a prefix): 32 lowercase hex digits."""
    return len(text) == 32 and _HEX32.issuperset(text)


class DamagedState(Exception):
    """A state's tail or one of its blocks is missing or damaged: it cannot be assembled."""

    def __init__(self, reason: str, block: str | None = None) -> None:
        super().__init__(reason)
        self.block = block


class SplitFailed(OSError):
    """Storing a save's blocks or tail failed (a full disk, a block that went bad under it): the blocks it wrote are
    the caller's to collect."""

    def __init__(self, cause: Exception, digests: tuple[str, ...]) -> None:
        errno = cause.errno if isinstance(cause, OSError) else None
        super().__init__(errno, (cause.strerror if isinstance(cause, OSError) else None) or str(cause))
        self.digests = digests


@dataclass(frozen=True, slots=True)
class Split:
    """What a save stored: its cut, each block's key, the key of the position it starts at, and its digest, the bytes
    written, and the checksum of the file its blocks and tail assemble into (the saved file's own, unless a block
    stored for a key earlier holds other float noise). Its digests are held until the caller's `release`."""

    cut: Cut
    prefixes: tuple[str, ...]
    opens: tuple[str, ...]
    digests: tuple[str, ...]
    tail_bytes: int
    new_block_bytes: int
    checksum: str
    exact: bool = True  # the blocks and tail assemble into the saved file byte for byte


@dataclass(frozen=True, slots=True)
class Manifest:
    cut: Cut
    prefixes: tuple[str, ...]
    digests: tuple[str, ...]
    tail_checksum: str
    checksum: str


class BlockStore:
    """Blocks and tails under one slot dir. Thread-safe: what is alive has one lock; files are written under fresh
    temporary names and renamed."""

    def __init__(self, slot_dir: Path, block_tokens: int) -> None:
        self.slot_dir = slot_dir
        self.root = slot_dir / BLOCKS_DIR
        self.block_tokens = block_tokens
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()
        self._opened_ns = time.time_ns()

    def block_path(self, digest: str) -> Path:
        return self.root / digest[:2] / f"{digest}.blk"

    def tail_path(self, filename: str) -> Path:
        return self.slot_dir / (filename + TAIL_SUFFIX)

    # -- saving -----------------------------------------------------------------------------------------------

    def split(self, source: Path, filename: str, tokens: Tokens | None, fingerprint: str,
              stored: Stored | None = None, prompt_end: int = 0) -> Split | None:
        """Store the slot file `source` as blocks (those the store lacks) and the tail `<filename>.tail`; None when
        the file cannot be cut (an unknown layout, fewer cells than a block): then it is kept whole. Blocks end where
        blocks of the same tokens that `stored` names end (blocks.py `follow_ends`), else on the grid and at
        `prompt_end` (the prompt's token count, 0: not known); a block whose
        key `stored` offers a digest for is named by that block instead of this file's own bytes, if that block is
        intact. The digests are held until `release`."""
        if self.block_tokens <= 0 or tokens is None:
            return None
        layout = parse_layout(source)
        limit = cut_limit(layout, int(tokens.size), self.block_tokens)
        if layout is None or not limit:
            return None
        # A numpy map of the file (not an mmap closed by hand: views of it may outlive an error's traceback), read
        # through a plain array view of it, which slices without the memmap subclass's per-slice bookkeeping.
        buffer = np.memmap(source, dtype=np.uint8, mode="r").view(np.ndarray)
        if buffer.size != layout.file_size:
            raise SplitFailed(OSError(f"{source} changed while it was cut"), ())
        layout = _exact_meta(buffer, layout)
        positions = Positions(tokens, limit, self.block_tokens, fingerprint, layout)
        ends, offered = _plan(positions, limit, self.block_tokens, stored, prompt_end)
        cut = Cut(layout, self.block_tokens, ends)
        spans = [cut.span(b) for b in range(cut.n_blocks)]
        prefixes = tuple(positions.block_key(start, end) for start, end in spans)
        opens = tuple(positions.opens(start) for start, _ in spans)
        held: list[str] = []
        try:
            return self._split(buffer, filename, cut, prefixes, opens, offered, held)
        except Exception as exc:
            self.release(held)
            raise SplitFailed(exc, tuple(held)) from exc
        except BaseException:
            self.release(held)
            raise

    def _split(self, buffer: np.ndarray, filename: str, cut: Cut, prefixes: tuple[str, ...],
               opens: tuple[str, ...], offered: Mapping[str, str], held: list[str]) -> Split:
        digests, new_bytes, differs = self._store_blocks(buffer, cut, prefixes, offered, held)
        pieces = list(tail_pieces(buffer, cut))
        tail_checksum = xxhash.xxh3_128_hexdigest(b"".join(pieces))
        manifest = Manifest(cut, prefixes, digests, tail_checksum, "")
        # A block stored for a prefix earlier (other float noise): the file its blocks make is then not the saved one
        # byte for byte, and its checksum is the assembled file's.
        checksum = self._assembled_checksum(manifest, pieces) if differs else xxhash.xxh3_128_hexdigest(buffer.data)
        manifest = Manifest(cut, prefixes, digests, tail_checksum, checksum)
        self._write_tail(filename, pieces, manifest)
        return Split(cut, prefixes, opens, digests, cut.tail_size, new_bytes, checksum, not differs)

    def _store_blocks(self, buffer: np.ndarray, cut: Cut, prefixes: Sequence[str], offered: Mapping[str, str],
                      held: list[str]) -> tuple[tuple[str, ...], int, bool]:
        """Write the blocks the store lacks, each held before it is looked for; returns every block's digest, the
        bytes written, and whether a block stored for a prefix earlier was named instead of this file's bytes."""
        digests, new_bytes, differs, dirs = [], 0, False, set()
        # Several writers: the file system commits their fsyncs together (measured here: 21 blocks in 5 ms instead of
        # 15), and a commit sooner is a state the next request finds. At most 2 x WRITERS payloads wait in memory.
        with ThreadPoolExecutor(max_workers=WRITERS) as writers:
            pending: deque[Future[None]] = deque()
            for b, prefix in enumerate(prefixes):
                payload = block_payload(buffer, cut, b).data
                own = xxhash.xxh3_128_digest(payload)
                other = offered.get(prefix)
                if other is not None and other != own.hex() and self._usable(other, held):
                    digests.append(other)
                    differs = True
                    continue
                digest = own.hex()
                self.hold((digest,))
                held.append(digest)
                if not self._present(digest, len(payload)):
                    pending.append(writers.submit(self._write_block, digest, payload, own))
                    if len(pending) >= 2 * WRITERS:
                        pending.popleft().result()
                    dirs.add(self.block_path(digest).parent)
                    new_bytes += len(payload)
                digests.append(digest)
            for future in pending:
                future.result()
        for directory in dirs:
            fsync_dir(directory)
        return tuple(digests), new_bytes, differs

    def _usable(self, digest: str, held: list[str]) -> bool:
        """Hold the block `digest` and read it whole: True when it is intact (a damaged one is moved aside, and the
        save stores its own bytes instead)."""
        self.hold((digest,))
        held.append(digest)
        try:
            self.read_block(digest)
        except DamagedState:
            self.forget_damaged(digest)
            return False
        return True

    def _present(self, digest: str, payload_bytes: int) -> bool:
        """Whether the block is stored, by its size (its bytes are checked against its name on every read)."""
        try:
            size = self.block_path(digest).stat().st_size
        except OSError:
            return False
        return size == _BLOCK_HEADER.size + payload_bytes

    def _assembled_checksum(self, manifest: Manifest, pieces: Sequence[bytes | memoryview]) -> str:
        out = np.empty(manifest.cut.layout.file_size, dtype=np.uint8)
        place_tail(out, manifest.cut, b"".join(pieces))
        for b, digest in enumerate(manifest.digests):
            place_block(out, manifest.cut, b, self.read_block(digest))
        return xxhash.xxh3_128_hexdigest(out.data)

    def _write_block(self, digest: str, payload: memoryview, raw: bytes) -> None:
        path = self.block_path(digest)
        make_private_dir(path.parent)
        _write_atomically(path, [_BLOCK_HEADER.pack(_BLOCK_MAGIC, len(payload), raw), payload],
                          path.with_name(_owned_temp_name(path.name)))

    def _write_tail(self, filename: str, pieces: Sequence[bytes | memoryview], manifest: Manifest) -> None:
        body = json.dumps({
            "cut": layout_to_json(manifest.cut), "prefixes": list(manifest.prefixes),
            "digests": list(manifest.digests), "tail_checksum": manifest.tail_checksum,
            "checksum": manifest.checksum,
        }, separators=(",", ":")).encode()
        trailer = _TRAILER.pack(len(body), xxhash.xxh3_128_digest(body), _TAIL_MAGIC)
        path = self.tail_path(filename)
        _write_atomically(path, [*pieces, body, trailer])
        fsync_dir(path.parent)

    def hold(self, digests: Iterable[str]) -> None:
        """Keep these blocks alive (never collected) until `release`: work in flight names them."""
        with self._lock:
            self._in_flight.update(digests)

    def release(self, digests: Iterable[str]) -> None:
        """End a `hold`; a commit's blocks are released only once its rows name them."""
        with self._lock:
            self._in_flight.subtract(digests)
            self._in_flight += Counter()  # drops the digests no work holds any more

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
                if magic not in _TAIL_MAGICS or length > min(_MANIFEST_MAX, size - _TRAILER.size):
                    raise DamagedState("its tail has no manifest this code reads")
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
            prefixes, digests = tuple(map(str, data["prefixes"])), tuple(map(str, data["digests"]))
            manifest = Manifest(cut, prefixes, digests, str(data["tail_checksum"]), str(data["checksum"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise DamagedState(f"its manifest is not one this code reads: {exc}") from exc
        if len(prefixes) != cut.n_blocks or len(digests) != cut.n_blocks or \
                cut.tail_size != size - _TRAILER.size - length or not all(map(is_digest, (*prefixes, *digests))):
            raise DamagedState("its manifest does not match its tail")
        return manifest

    def read_block(self, digest: str) -> bytes:
        """A block's payload, checked against its name."""
        return _checked_block(self.block_path(digest), digest)

    def checked_file(self, digest: str) -> bytes:
        """A block's whole file (header and payload), for an upload, once its bytes are checked against its name: a
        block damaged here is moved into the quarantine and never put anywhere (DamagedState)."""
        try:
            payload = self.read_block(digest)
        except DamagedState:
            self.forget_damaged(digest)
            raise
        return _BLOCK_HEADER.pack(_BLOCK_MAGIC, len(payload), bytes.fromhex(digest)) + payload

    def has_block(self, digest: str) -> bool:
        """Whether the store holds the block (by its header; its bytes are checked on use)."""
        try:
            with self.block_path(digest).open("rb") as fh:
                header = fh.read(_BLOCK_HEADER.size)
        except OSError:
            return False
        if len(header) != _BLOCK_HEADER.size:
            return False
        magic, _, raw = _BLOCK_HEADER.unpack(header)
        return bool(magic == _BLOCK_MAGIC and raw.hex() == digest)

    def adopt_block(self, digest: str, source: Path) -> bool:
        """Take a downloaded block file into the store once its bytes are checked against its name (DamagedState if
        they are not); False when the store holds it already (`source` is then left for the caller)."""
        _checked_block(source, digest)
        if self.has_block(digest):
            return False
        path = self.block_path(digest)
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
        return directory / _owned_temp_name(label)

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

    def assemble_from(self, tail_path: Path, target: Path) -> tuple[int, str]:
        """`assemble` from the tail at `tail_path` (one here, or one downloaded). A block found damaged on the way is
        moved into the quarantine (`forget_damaged`), whoever assembles: the next save of its bytes, or the next
        download naming it, writes it again instead of naming the damaged one once more."""
        try:
            return self._assemble_from(tail_path, target)
        except DamagedState as exc:
            if exc.block is not None:
                self.forget_damaged(exc.block)
            raise

    def _assemble_from(self, tail_path: Path, target: Path) -> tuple[int, str]:
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
                for b, digest in enumerate(manifest.digests):
                    payload = self.read_block(digest)
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

    def collect(self, digests: Iterable[str], referenced: Callable[[Sequence[str]], set[str]]) -> int:
        """Remove the blocks among `digests` that no committed state names (`referenced` says which are named) and
        no work in flight holds; returns how many went. Both are read under the one lock `release` takes, so a
        commit that names a block cannot slip between them."""
        candidates = sorted(set(digests))
        if not candidates:
            return 0
        removed = 0
        with self._lock:
            named = referenced(candidates)
            for digest in candidates:
                if digest not in named and not self._in_flight.get(digest):
                    unlink_quietly(self.block_path(digest))
                    removed += 1
        return removed

    def forget_damaged(self, digest: str) -> None:
        """A block found damaged is moved into the quarantine (if it is still damaged: never a good block another
        save wrote since), so that the next save of those tokens writes it again. A missing one needs nothing."""
        path = self.block_path(digest)
        try:
            _checked_block(path, digest)
        except DamagedState:
            if path.exists():
                move_aside(self.slot_dir, path, f"{digest}.blk")
                log.warning("block %s was damaged: it is quarantined, and the next save of its tokens writes it again",
                            digest)

    def stored_digests(self) -> set[str]:
        """Every block on disk (for the start's sweep of blocks no state names)."""
        found: set[str] = set()
        for directory in self._block_dirs():
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name.endswith(".blk") and is_digest(entry.name[:-4]):
                        found.add(entry.name[:-4])
        return found

    def sweep_temporaries(self) -> int:
        """Remove the temporaries a crash left (block writes, downloads): those of this host's processes that are
        gone, and any other older than this store's opening (no write in flight is). Returns how many went."""
        cutoff = self._opened_ns - int(TEMP_MARGIN_SECONDS * 1e9)
        removed = 0
        for directory in self._block_dirs():
            with os.scandir(directory) as entries:
                for entry in entries:
                    if not entry.name.startswith(".tmp-"):
                        continue
                    try:
                        old = entry.stat(follow_symlinks=False).st_mtime_ns < cutoff
                    except OSError:
                        continue
                    if old or _writer_gone(entry.name):
                        unlink_quietly(Path(entry.path))
                        removed += 1
        return removed

    def _block_dirs(self) -> list[str]:
        try:
            with os.scandir(self.root) as dirs:
                return [d.path for d in dirs if d.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return []

    def usage(self) -> tuple[int, int]:
        """(blocks, bytes) on disk."""
        count = total = 0
        for directory in self._block_dirs():
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name.endswith(".blk") and not entry.name.startswith("."):
                        count += 1
                        total += entry.stat(follow_symlinks=False).st_size
        return count, total


def _exact_meta(buffer: np.ndarray, layout: SlotLayout) -> SlotLayout:
    """`layout` with the cell metadata the assembly is to write only where the file's bytes (`buffer`) hold it byte
    for byte (the parser read it so; checked again, so that a file is never assembled otherwise than it was saved)."""
    if not layout.meta:
        return layout
    kept = tuple(m for m in layout.meta if meta_matches(buffer, layout, m))
    return layout if kept == layout.meta else replace(layout, meta=kept)


def _plan(positions: Positions, limit: int, block_tokens: int, stored: Stored | None,
          prompt_end: int) -> tuple[tuple[int, ...], dict[str, str]]:
    """Where a save's blocks end, and the digest stored for each block key found on the way. The blocks stored from
    every grid line are asked at once; those from a position between two lines (where an earlier save ended) as the
    cut reaches it."""
    offered: dict[str, str] = {}
    if stored is None:
        return grid_ends(limit, block_tokens, prompt_end), offered
    known: dict[str, Sequence[StoredBlock]] = dict.fromkeys(positions.grid_opens, ())
    known.update(stored(positions.grid_opens))

    def ends_from(start: int) -> list[int]:
        key = positions.opens(start)
        if key not in known:
            known[key] = stored([key]).get(key, ())
        found = []
        for block in known[key]:
            end = start + block.n_cells
            if block.n_cells > 0 and end <= limit and positions.block_key(start, end) == block.key:
                found.append(end)
                offered.setdefault(block.key, block.digest)
        return found

    return follow_ends(limit, block_tokens, ends_from, prompt_end), offered


def _pwrite_all(fd: int, writes: Iterable[tuple[int, memoryview]]) -> None:
    for offset, view in writes:
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n


def _checked_block(path: Path, digest: str) -> bytes:
    """The payload of the block file at `path`, checked: its header's magic and length, and its bytes against its
    name `digest` (the header's copy of it too)."""
    try:
        with path.open("rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise DamagedState(f"block {digest} is missing", digest) from exc
    if len(data) < _BLOCK_HEADER.size:
        raise DamagedState(f"block {digest} is truncated", digest)
    magic, length, raw = _BLOCK_HEADER.unpack_from(data)
    payload = data[_BLOCK_HEADER.size:]
    if magic != _BLOCK_MAGIC or length != len(payload):
        raise DamagedState(f"block {digest} is truncated or not a block", digest)
    if raw.hex() != digest or xxhash.xxh3_128_hexdigest(payload) != digest:
        raise DamagedState(f"block {digest} does not match its name", digest)
    return payload


def _owned_temp_name(label: str) -> str:
    return f".tmp-{os.getpid()}.{_HOST}.{secrets.token_hex(4)}-{label}"


def _writer_gone(name: str) -> bool:
    """Whether the temporary `name` (`.tmp-<pid>.<host>.<nonce>-...`) was written by a process of this host that no
    longer runs. False when unsure: another host's, a live process's (which may be this one), a name not ours."""
    owner = name[len(".tmp-"):].split("-", 1)[0].split(".")
    if len(owner) != 3 or owner[1] != _HOST or not owner[0].isdigit():
        return False
    pid = int(owner[0])
    if pid == os.getpid() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _write_atomically(path: Path, pieces: Iterable[bytes | memoryview], temp: Path | None = None) -> None:
    """Write `pieces` to a temporary name beside `path` (`temp`, or a fresh one), fsync, and rename: a crash leaves
    the old state or the new one, never a torn file (a temporary at most, which a start's sweep removes)."""
    temp = temp or path.with_name(f".tmp-{secrets.token_hex(4)}-{path.name}")
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
