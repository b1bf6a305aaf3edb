"""Cutting a slot file into blocks of tokens and a tail, and putting it back together, byte for byte.

A slot file's attention KV is per token: in each region (slotformat.py) every run holds one cell after another, and
cell i is position i. A block is the cells [s, e) of every run of every region in file order: its bytes depend only
on the tokens up to e and on everything the backend's fingerprint covers (model, build, K/V types and layout, rope,
adapters: fingerprint.py). So each block has a *key*, a hash of those tokens, the fingerprint, the shape and types
of the KV it holds, and where it starts. A key says which KV a block stands for, never which bytes it is: a block
is stored and named by a digest of its bytes (blockstore.py), and two saves of one key with other float noise are
two blocks. The tail is the file with every block's bytes taken out: the header and token list, the cell metadata
(but where it says only that the cells are positions 0..n-1 of one sequence: the manifest says that, and the
assembly writes it), recurrent and sliding-window states, the checkpoint appendix, and the cells past the last
block.

Where blocks end (a `Cut`'s `ends`): on a grid of B tokens (`--block-tokens`), at the end of the prompt of the turn
saved (the client sends that back; the tokens generated after it, it may not), and where a block stored before
ends between two grid lines with the same tokens (`follow_ends`): a conversation's next save then names the blocks
its last save wrote, up to where the client's history leaves that save, and writes only the cells after it.
Positions are keyed the same way whatever the cut (`Positions`), so two states' blocks of one span and tokens have
one key.

Pure functions over arrays and bytes (numpy views of an mmap for multi-gigabyte files); the files are blockstore.py's.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import xxhash

from slotkeeper.cache.slotformat import META_CELL_BYTES, CellMeta, SlotLayout, TokenRegion, cell_meta_bytes
from slotkeeper.cache.tokens import Tokens

_POSITION = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Cut:
    """How one file is cut: its layout, the grid (`block_tokens`) and where each block ends; block b holds the cells
    [ends[b-1], ends[b]) (the first from 0). The cells past the last end stay in the tail."""

    layout: SlotLayout
    block_tokens: int
    ends: tuple[int, ...]

    @property
    def n_blocks(self) -> int:
        return len(self.ends)

    @property
    def covered(self) -> int:
        """The cells the blocks hold: 0..covered-1."""
        return self.ends[-1] if self.ends else 0

    def span(self, b: int) -> tuple[int, int]:
        return (self.ends[b - 1] if b else 0), self.ends[b]

    @property
    def cell_bytes(self) -> int:
        """The bytes of one cell across every run of every region."""
        return sum(r.n_outer * r.cell_bytes for r in self.layout.regions)

    def block_bytes(self, b: int) -> int:
        """The bytes of block b: every run's share of its cells."""
        start, end = self.span(b)
        return self.cell_bytes * (end - start)

    @property
    def meta_bytes(self) -> int:
        """The bytes of the cell metadata the assembly writes (`layout.meta`)."""
        return len(self.layout.meta) * META_CELL_BYTES * self.layout.n_cells

    @property
    def tail_size(self) -> int:
        return self.layout.file_size - self.covered * self.cell_bytes - self.meta_bytes


def cut_limit(layout: SlotLayout | None, n_tokens: int, block_tokens: int) -> int:
    """How many cells of a file with `layout` holding `n_tokens` tokens blocks may take (a block needs its cells and
    the tokens that key it); 0 when none is taken: the file is then kept whole (an unknown layout, blocks off, or
    fewer cells than one grid step)."""
    if layout is None or block_tokens <= 0 or not layout.regions:
        return 0
    limit = min(layout.n_cells, n_tokens)
    return limit if limit >= block_tokens else 0


def grid_ends(limit: int, block_tokens: int, prompt_end: int = 0) -> tuple[int, ...]:
    """Blocks on the grid alone (and at the prompt's end): every B tokens, then the cells up to `limit`."""
    return follow_ends(limit, block_tokens, lambda start: (), prompt_end)


def follow_ends(limit: int, block_tokens: int, stored: Callable[[int], Iterable[int]],
                prompt_end: int = 0) -> tuple[int, ...]:
    """Where the blocks of the cells 0..limit-1 end. From each block's start, the block runs to the next grid line,
    `prompt_end` or `limit`, whichever comes first, unless a stored block of the same tokens starts there and ends
    before it (`stored(start)`: the ends of such blocks): then it ends where the stored one does, the longest such,
    so that a state saved again with more tokens names its last save's blocks whole and writes only what comes
    after."""
    ends: list[int] = []
    start = 0
    while start < limit:
        grid = min((start // block_tokens + 1) * block_tokens, limit)
        if start < prompt_end < grid:
            grid = prompt_end
        start = max((end for end in stored(start) if start < end <= grid), default=grid)
        ends.append(start)
    return tuple(ends)


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block a save stored from a position (the index's row of it): how many cells it holds, its key (the
    `Positions.block_key` of its start and end) and the digest of its bytes."""

    n_cells: int
    key: str
    digest: str


class Positions:
    """Keys of positions in one token list, the same whatever the cut: position p's key hashes every token before it,
    the fingerprint, the grid and the KV's shape and ggml types (so a block is never read into another layout or
    type, whatever the fingerprint missed). A chain over the grid lines, and one more hash for a position between
    two of them."""

    def __init__(self, tokens: Tokens, limit: int, block_tokens: int, fingerprint: str, layout: SlotLayout) -> None:
        shape = ";".join(f"{r.n_outer}x{r.cell_bytes}:{r.type_id}" for r in layout.regions)
        running = xxhash.xxh3_128_digest(f"slotkeeper-kv3|{fingerprint}|{block_tokens}|{shape}".encode())
        self._data = np.ascontiguousarray(tokens[:limit], dtype="<i4")
        self._block_tokens = block_tokens
        self._grid = [running]
        for g in range(limit // block_tokens):
            running = xxhash.xxh3_128_digest(running + self._data[g * block_tokens:(g + 1) * block_tokens].tobytes())
            self._grid.append(running)

    def at(self, position: int) -> bytes:
        line, rest = divmod(position, self._block_tokens)
        if not rest:
            return self._grid[line]
        start = line * self._block_tokens
        return xxhash.xxh3_128_digest(self._grid[line] + self._data[start:position].tobytes()
                                      + _POSITION.pack(position))

    def opens(self, position: int) -> str:
        """The key of a block starting at `position`: what a stored block is looked up by."""
        return self.at(position).hex()

    def block_key(self, start: int, end: int) -> str:
        """The key of the block of cells [start, end): its tokens (all up to its end) and its span."""
        return xxhash.xxh3_128_hexdigest(self.at(end) + _POSITION.pack(start))

    @cached_property
    def grid_opens(self) -> list[str]:
        """`opens` of every grid line up to the limit."""
        return [key.hex() for key in self._grid]


def block_scope(fingerprint: str, domain: str) -> str:
    """What a block's key is taken under: the backend's fingerprint, and the cache domain of the state it is cut
    from, so that a save of one domain never takes another domain's stored block for its own key. (Blocks are
    stored by their bytes: two domains' blocks of the same bytes are one file, and neither domain reuses the
    other's by it; only a key is ever looked up.)"""
    return f"{fingerprint}|domain={domain}" if domain else fingerprint


def _runs(buffer: np.ndarray, region: TokenRegion, n_cells: int) -> np.ndarray:
    """The region as a 2-D view: one row per run, n_cells * cell_bytes bytes each."""
    size = region.n_outer * n_cells * region.cell_bytes
    return buffer[region.offset:region.offset + size].reshape(region.n_outer, n_cells * region.cell_bytes)


def block_payload(buffer: np.ndarray, cut: Cut, b: int) -> np.ndarray:
    """Block b's bytes, cut out of the whole file's bytes (copied once, into an array of their own)."""
    start, end = cut.span(b)
    n = cut.layout.n_cells
    out = np.empty(cut.block_bytes(b), dtype=np.uint8)
    at = 0
    for region in cut.layout.regions:
        rows = _runs(buffer, region, n)[:, start * region.cell_bytes:end * region.cell_bytes]
        out[at:at + rows.size].reshape(rows.shape)[...] = rows
        at += rows.size
    return out


def _gaps(cut: Cut, start: int, stop: int) -> Iterator[tuple[int, int]]:
    """The tail's ranges of the file's bytes between `start` and `stop` (outside every region): all of them but the
    cell metadata the assembly writes."""
    size = META_CELL_BYTES * cut.layout.n_cells
    for meta in cut.layout.meta:
        if start <= meta.offset < stop:
            yield start, meta.offset
            start = meta.offset + size
    yield start, stop


def meta_writes(cut: Cut) -> Iterator[tuple[int, memoryview]]:
    """The cell metadata the tail leaves out: (offset, bytes) pairs."""
    for meta in cut.layout.meta:
        yield meta.offset, cell_meta_bytes(cut.layout.n_cells, meta.seq_id).data


def tail_pieces(buffer: np.ndarray, cut: Cut) -> Iterator[memoryview | bytes]:
    """The tail's bytes in order: each gap between regions (but the cell metadata the assembly writes), and each
    region's cells past the last block."""
    at = 0
    n, taken = cut.layout.n_cells, cut.covered
    for region in cut.layout.regions:
        for start, stop in _gaps(cut, at, region.offset):
            yield buffer[start:stop].data
        rest = _runs(buffer, region, n)[:, taken * region.cell_bytes:]
        if rest.size:
            yield rest.tobytes()
        at = region.offset + region.n_outer * n * region.cell_bytes
    for start, stop in _gaps(cut, at, cut.layout.file_size):
        yield buffer[start:stop].data


def meta_matches(buffer: np.ndarray, layout: SlotLayout, meta: CellMeta) -> bool:
    """Whether the file's cell metadata at `meta` is the one `cell_meta_bytes` writes, byte for byte."""
    size = META_CELL_BYTES * layout.n_cells
    return bool(np.array_equal(buffer[meta.offset:meta.offset + size], cell_meta_bytes(layout.n_cells, meta.seq_id)))


def _check_payload(cut: Cut, b: int, payload: bytes | np.ndarray) -> None:
    if len(payload) != cut.block_bytes(b):
        raise ValueError(f"block {b} has {len(payload)} bytes, not {cut.block_bytes(b)}")


def place_block(out: np.ndarray, cut: Cut, b: int, payload: bytes | np.ndarray) -> None:
    """Write block b's bytes into their places in the whole file's buffer."""
    _check_payload(cut, b, payload)
    data = np.frombuffer(payload, dtype=np.uint8)
    start, end = cut.span(b)
    at = 0
    for region in cut.layout.regions:
        width = (end - start) * region.cell_bytes
        size = region.n_outer * width
        runs = _runs(out, region, cut.layout.n_cells)
        runs[:, start * region.cell_bytes:end * region.cell_bytes] = data[at:at + size].reshape(region.n_outer, width)
        at += size


def place_tail(out: np.ndarray, cut: Cut, tail: bytes | np.ndarray) -> None:
    """Write the tail's bytes into their places in the whole file's buffer."""
    if len(tail) != cut.tail_size:
        raise ValueError(f"the tail has {len(tail)} bytes, not {cut.tail_size}")
    data = np.frombuffer(tail, dtype=np.uint8)
    at = read = 0
    n, taken = cut.layout.n_cells, cut.covered
    for offset, meta in meta_writes(cut):
        out[offset:offset + len(meta)] = np.frombuffer(meta, dtype=np.uint8)
    for region in cut.layout.regions:
        for start, stop in _gaps(cut, at, region.offset):
            out[start:stop] = data[read:read + stop - start]
            read += stop - start
        runs = _runs(out, region, n)
        rest_width = runs.shape[1] - taken * region.cell_bytes
        if rest_width:
            size = region.n_outer * rest_width
            runs[:, taken * region.cell_bytes:] = data[read:read + size].reshape(region.n_outer, rest_width)
            read += size
        at = region.offset + region.n_outer * n * region.cell_bytes
    for start, stop in _gaps(cut, at, cut.layout.file_size):
        out[start:stop] = data[read:read + stop - start]
        read += stop - start


def tail_writes(cut: Cut, tail: bytes) -> Iterator[tuple[int, memoryview]]:
    """Where the tail's bytes go in the whole file, when every region is of one run (rows), and the cell metadata it
    leaves out: (offset, bytes) pairs."""
    if len(tail) != cut.tail_size:
        raise ValueError(f"the tail has {len(tail)} bytes, not {cut.tail_size}")
    view = memoryview(tail)
    at = read = 0
    n, taken = cut.layout.n_cells, cut.covered
    yield from meta_writes(cut)
    for region in cut.layout.regions:
        assert region.n_outer == 1, "regions of several runs go through place_tail"
        for start, stop in _gaps(cut, at, region.offset):
            yield start, view[read:read + stop - start]
            read += stop - start
        rest = (n - taken) * region.cell_bytes
        yield region.offset + taken * region.cell_bytes, view[read:read + rest]
        read += rest
        at = region.offset + n * region.cell_bytes
    for start, stop in _gaps(cut, at, cut.layout.file_size):
        yield start, view[read:read + stop - start]
        read += stop - start


def block_writes(cut: Cut, b: int, payload: bytes) -> Iterator[tuple[int, memoryview]]:
    """Where block b's bytes go in the whole file, for the regions of one run each (K and V rows): (offset, bytes)
    pairs, one per region. Regions of several runs (V transposed) are left to `place_block_runs`."""
    _check_payload(cut, b, payload)
    start, end = cut.span(b)
    view, at = memoryview(payload), 0
    for region in cut.layout.regions:
        width = (end - start) * region.cell_bytes
        if region.n_outer == 1:
            yield region.offset + start * region.cell_bytes, view[at:at + width]
        at += region.n_outer * width


def place_block_runs(out: np.ndarray, cut: Cut, b: int, payload: bytes) -> None:
    """`place_block` for the regions of several runs only (those `block_writes` leaves out)."""
    data = np.frombuffer(payload, dtype=np.uint8)
    start, end = cut.span(b)
    at = 0
    for region in cut.layout.regions:
        width = (end - start) * region.cell_bytes
        size = region.n_outer * width
        if region.n_outer > 1:
            runs = _runs(out, region, cut.layout.n_cells)
            runs[:, start * region.cell_bytes:end * region.cell_bytes] = data[at:at + size].reshape(region.n_outer,
                                                                                                  width)
        at += size


def layout_to_json(cut: Cut) -> dict[str, object]:
    return {
        "block_tokens": cut.block_tokens, "ends": list(cut.ends), "n_cells": cut.layout.n_cells,
        "file_size": cut.layout.file_size,
        "regions": [[r.offset, r.n_outer, r.cell_bytes, r.type_id] for r in cut.layout.regions],
        "meta": [[m.offset, m.seq_id] for m in cut.layout.meta],
    }


def layout_from_json(data: dict[str, object]) -> Cut:
    """The cut a manifest records; ValueError when it is not a consistent one (a manifest is checked before use).
    A manifest from before cuts followed stored blocks gives a count of blocks on the grid instead of their ends."""
    try:
        regions = tuple(TokenRegion(int(o), int(k), int(c), int(t))
                        for o, k, c, t in data["regions"])  # type: ignore[attr-defined]
        meta = tuple(CellMeta(int(o), int(q)) for o, q in data.get("meta", ()))  # type: ignore[attr-defined]
        layout = SlotLayout(int(data["n_cells"]), regions, int(data["file_size"]), meta)  # type: ignore[call-overload]
        block_tokens = int(data["block_tokens"])  # type: ignore[call-overload]
        if "ends" in data:
            ends = tuple(int(e) for e in data["ends"])  # type: ignore[attr-defined]
        else:
            ends = tuple(block_tokens * (b + 1) for b in range(int(data["n_blocks"])))  # type: ignore[call-overload]
        cut = Cut(layout, block_tokens, ends)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a block layout: {exc}") from exc
    _check(cut)
    return cut


def _check(cut: Cut) -> None:
    layout = cut.layout
    if cut.block_tokens <= 0 or not cut.ends or cut.covered > layout.n_cells or \
            any(b <= a for a, b in zip((0, *cut.ends), cut.ends, strict=False)):
        raise ValueError("blocks do not fit the cells")
    if not layout.regions or any(r.n_outer <= 0 or r.cell_bytes <= 0 for r in layout.regions):
        raise ValueError("regions overlap or are empty")
    spans = sorted([(r.offset, r.n_outer * layout.n_cells * r.cell_bytes) for r in layout.regions]
                   + [(m.offset, META_CELL_BYTES * layout.n_cells) for m in layout.meta])
    at = 0
    for offset, size in spans:
        if offset < at:
            raise ValueError("regions overlap or are empty")
        at = offset + size
    if at > layout.file_size:
        raise ValueError("regions run past the file")
    if [m.offset for m in layout.meta] != sorted(m.offset for m in layout.meta):
        raise ValueError("cell metadata out of order")
