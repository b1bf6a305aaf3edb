"""Cutting a slot file into blocks of tokens and a tail, and putting it back together, byte for byte.

A slot file's attention KV is per token: in each region (slotformat.py) every run holds one cell after another, and
cell i is position i. Block b of B tokens is, for every run of every region in file order, the bytes of cells
[b*B, (b+1)*B): they depend only on the tokens up to its end and on everything the backend's fingerprint covers
(model, build, K/V types and layout, rope, adapters: fingerprint.py). So each block has a *prefix*: a chained hash
of those tokens, the fingerprint and the shape and types of the KV it holds. A prefix says which KV a block stands
for, never which bytes it is: a block is stored and named by a digest of its bytes (blockstore.py), and two saves
of one prefix with other float noise are two blocks. The tail is the file with every full block's bytes taken out:
the header and token list, the cell metadata, recurrent and sliding-window states, the checkpoint appendix, and the
cells after the last full block.

Pure functions over arrays and bytes (numpy views of an mmap for multi-gigabyte files); the files are blockstore.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from slotkeeper.cache.slotformat import SlotLayout, TokenRegion
from slotkeeper.cache.tokens import Tokens


@dataclass(frozen=True, slots=True)
class Cut:
    """How one file is cut: its layout and the count of full blocks of `block_tokens` taken out of it."""

    layout: SlotLayout
    block_tokens: int
    n_blocks: int

    @property
    def tail_size(self) -> int:
        return self.layout.file_size - self.n_blocks * self.block_bytes

    @property
    def block_bytes(self) -> int:
        """The bytes of one block: every run's share of B cells."""
        return sum(r.n_outer * r.cell_bytes for r in self.layout.regions) * self.block_tokens


def plan_cut(layout: SlotLayout | None, n_tokens: int, block_tokens: int) -> Cut | None:
    """The cut of a file with `layout` holding `n_tokens` tokens; None when no full block can be taken out (the file
    is kept whole). A block needs its cells and the tokens that key it."""
    if layout is None or block_tokens <= 0 or not layout.regions:
        return None
    n_blocks = min(layout.n_cells, n_tokens) // block_tokens
    return Cut(layout, block_tokens, n_blocks) if n_blocks > 0 else None


def block_scope(fingerprint: str, domain: str) -> str:
    """What a block's prefix is taken under: the backend's fingerprint, and the cache domain of the state it is cut
    from, so that a save of one domain never takes another domain's stored block for its own prefix. (Blocks are
    stored by their bytes: two domains' blocks of the same bytes are one file, and neither domain reuses the
    other's by it; only a prefix is ever looked up.)"""
    return f"{fingerprint}|domain={domain}" if domain else fingerprint


def block_prefixes(tokens: Tokens, n_blocks: int, block_tokens: int, fingerprint: str,
                   layout: SlotLayout) -> list[str]:
    """The prefix of each full block: a chained xxh3-128 over the fingerprint, the shape and ggml types of the KV (so
    a block is never read into another layout or type, whatever the fingerprint missed) and every token up to the
    block's end."""
    shape = ";".join(f"{r.n_outer}x{r.cell_bytes}:{r.type_id}" for r in layout.regions)
    running = xxhash.xxh3_128_digest(f"slotkeeper-kv2|{fingerprint}|{block_tokens}|{shape}".encode())
    data = np.ascontiguousarray(tokens, dtype="<i4")
    keys = []
    for b in range(n_blocks):
        running = xxhash.xxh3_128_digest(running + data[b * block_tokens:(b + 1) * block_tokens].tobytes())
        keys.append(running.hex())
    return keys


def _runs(buffer: np.ndarray, region: TokenRegion, n_cells: int) -> np.ndarray:
    """The region as a 2-D view: one row per run, n_cells * cell_bytes bytes each."""
    size = region.n_outer * n_cells * region.cell_bytes
    return buffer[region.offset:region.offset + size].reshape(region.n_outer, n_cells * region.cell_bytes)


def block_payload(buffer: np.ndarray, cut: Cut, b: int) -> np.ndarray:
    """Block b's bytes, cut out of the whole file's bytes (copied once, into an array of their own)."""
    B, n = cut.block_tokens, cut.layout.n_cells
    out = np.empty(cut.block_bytes, dtype=np.uint8)
    at = 0
    for region in cut.layout.regions:
        width = B * region.cell_bytes
        rows = _runs(buffer, region, n)[:, b * width:(b + 1) * width]
        out[at:at + rows.size].reshape(rows.shape)[...] = rows
        at += rows.size
    return out


def tail_pieces(buffer: np.ndarray, cut: Cut) -> Iterator[memoryview | bytes]:
    """The tail's bytes in order: each gap between regions, and each region's cells after the last full block."""
    at = 0
    n, taken = cut.layout.n_cells, cut.n_blocks * cut.block_tokens
    for region in cut.layout.regions:
        yield buffer[at:region.offset].data
        rest = _runs(buffer, region, n)[:, taken * region.cell_bytes:]
        if rest.size:
            yield rest.tobytes()
        at = region.offset + region.n_outer * n * region.cell_bytes
    yield buffer[at:cut.layout.file_size].data


def place_block(out: np.ndarray, cut: Cut, b: int, payload: bytes | np.ndarray) -> None:
    """Write block b's bytes into their places in the whole file's buffer."""
    if len(payload) != cut.block_bytes:
        raise ValueError(f"block {b} has {len(payload)} bytes, not {cut.block_bytes}")
    data = np.frombuffer(payload, dtype=np.uint8)
    B, n = cut.block_tokens, cut.layout.n_cells
    at = 0
    for region in cut.layout.regions:
        width = B * region.cell_bytes
        size = region.n_outer * width
        _runs(out, region, n)[:, b * width:(b + 1) * width] = data[at:at + size].reshape(region.n_outer, width)
        at += size


def place_tail(out: np.ndarray, cut: Cut, tail: bytes | np.ndarray) -> None:
    """Write the tail's bytes into their places in the whole file's buffer."""
    if len(tail) != cut.tail_size:
        raise ValueError(f"the tail has {len(tail)} bytes, not {cut.tail_size}")
    data = np.frombuffer(tail, dtype=np.uint8)
    at = read = 0
    n, taken = cut.layout.n_cells, cut.n_blocks * cut.block_tokens
    for region in cut.layout.regions:
        gap = region.offset - at
        out[at:region.offset] = data[read:read + gap]
        read += gap
        runs = _runs(out, region, n)
        rest_width = runs.shape[1] - taken * region.cell_bytes
        if rest_width:
            size = region.n_outer * rest_width
            runs[:, taken * region.cell_bytes:] = data[read:read + size].reshape(region.n_outer, rest_width)
            read += size
        at = region.offset + region.n_outer * n * region.cell_bytes
    out[at:cut.layout.file_size] = data[read:]


def tail_writes(cut: Cut, tail: bytes) -> Iterator[tuple[int, memoryview]]:
    """Where the tail's bytes go in the whole file, when every region is of one run (rows): (offset, bytes) pairs."""
    if len(tail) != cut.tail_size:
        raise ValueError(f"the tail has {len(tail)} bytes, not {cut.tail_size}")
    view = memoryview(tail)
    at = read = 0
    n, taken = cut.layout.n_cells, cut.n_blocks * cut.block_tokens
    for region in cut.layout.regions:
        assert region.n_outer == 1, "regions of several runs go through place_tail"
        yield at, view[read:read + region.offset - at]
        read += region.offset - at
        rest = (n - taken) * region.cell_bytes
        yield region.offset + taken * region.cell_bytes, view[read:read + rest]
        read += rest
        at = region.offset + n * region.cell_bytes
    yield at, view[read:]


def block_writes(cut: Cut, b: int, payload: bytes) -> Iterator[tuple[int, memoryview]]:
    """Where block b's bytes go in the whole file, for the regions of one run each (K and V rows): (offset, bytes)
    pairs, one per region. Regions of several runs (V transposed) are left to `place_block`."""
    if len(payload) != cut.block_bytes:
        raise ValueError(f"block {b} has {len(payload)} bytes, not {cut.block_bytes}")
    view, at = memoryview(payload), 0
    for region in cut.layout.regions:
        width = cut.block_tokens * region.cell_bytes
        if region.n_outer == 1:
            yield region.offset + b * width, view[at:at + width]
        at += region.n_outer * width


def place_block_runs(out: np.ndarray, cut: Cut, b: int, payload: bytes) -> None:
    """`place_block` for the regions of several runs only (those `block_writes` leaves out)."""
    data = np.frombuffer(payload, dtype=np.uint8)
    at = 0
    for region in cut.layout.regions:
        width = cut.block_tokens * region.cell_bytes
        size = region.n_outer * width
        if region.n_outer > 1:
            runs = _runs(out, region, cut.layout.n_cells)
            runs[:, b * width:(b + 1) * width] = data[at:at + size].reshape(region.n_outer, width)
        at += size


def layout_to_json(cut: Cut) -> dict[str, object]:
    return {
        "block_tokens": cut.block_tokens, "n_blocks": cut.n_blocks, "n_cells": cut.layout.n_cells,
        "file_size": cut.layout.file_size,
        "regions": [[r.offset, r.n_outer, r.cell_bytes, r.type_id] for r in cut.layout.regions],
    }


def layout_from_json(data: dict[str, object]) -> Cut:
    """The cut a manifest records; ValueError when it is not a consistent one (a manifest is checked before use)."""
    try:
        regions = tuple(TokenRegion(int(o), int(k), int(c), int(t))
                        for o, k, c, t in data["regions"])  # type: ignore[attr-defined]
        layout = SlotLayout(int(data["n_cells"]), regions, int(data["file_size"]))  # type: ignore[call-overload]
        cut = Cut(layout, int(data["block_tokens"]), int(data["n_blocks"]))  # type: ignore[call-overload]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a block layout: {exc}") from exc
    _check(cut)
    return cut


def _check(cut: Cut) -> None:
    layout = cut.layout
    if cut.block_tokens <= 0 or cut.n_blocks <= 0 or cut.n_blocks * cut.block_tokens > layout.n_cells:
        raise ValueError("blocks do not fit the cells")
    at = 0
    for region in layout.regions:
        if region.offset < at or region.n_outer <= 0 or region.cell_bytes <= 0:
            raise ValueError("regions overlap or are empty")
        at = region.offset + region.n_outer * layout.n_cells * region.cell_bytes
    if at > layout.file_size or not layout.regions:
        raise ValueError("regions run past the file")
