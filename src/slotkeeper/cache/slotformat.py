"""Where a llama-server slot file keeps each token's attention KV: the parser the block store splits files by.

The file (`llama_state_seq_save_file`, format "ggsq" v4, llama.cpp b11434 and b11549): u32 magic, u32 version,
u32 word count and the words of the token list (plain or packed, tokens.py), then the memory's state for the slot's
one sequence, and on b11549 the context-checkpoint appendix (capability.py). The state is a list of sections
nobody labels; the memory types write them in these orders: a KV cache (A), an iswa cache (A base, A swa), a
recurrent memory (R), a hybrid (A, R) and a hybrid iswa (A, A, R).

A (llama_kv_cache::state_write): u32 n_stream, then per stream u32 cell_count and, when not 0, per cell i32 pos,
u32 n_seq_id (1 for a sequence's save), 12 bytes of cell ext (M-RoPE, PLE models only) and the seq id; then u32
v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v; n_layer K tensors (i32 type, u64 row size, rows); then n_layer V
tensors (none for MLA models): not transposed like K, transposed as i32 type, u32 element size, u32 n_embd_v_gqa and
n_embd_v_gqa runs of cell_count elements.

R (llama_memory_recurrent::state_write): u32 cell_count, per cell i32 pos and u32 n_seq_id (0 for a sequence's
save), u32 s_trans (0), u32 n_layer (all layers), then m r tensors and m s tensors (m <= n_layer), each i32 type,
u64 row size and rows.

Whether a cache has cell ext, V tensors, how many recurrent layers and which sections there are is not in the file,
so every reading is tried: a layout is returned only when the readings that consume the file exactly agree on it.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class TokenRegion:
    """The per-token bytes of one attention tensor in a slot file: `n_outer` runs one after another from `offset`,
    each of `n_cells` cells of `cell_bytes` bytes (K rows: one run of whole rows; V stored transposed: one run per
    element of the row). Cell i holds position i."""

    offset: int
    n_outer: int
    cell_bytes: int
    type_id: int = -1  # the tensor's ggml type as the file gives it (-1: not known): f16 and bf16 rows are of one size


@dataclass(frozen=True, slots=True)
class CellMeta:
    """The cell metadata of an attention section whose regions are taken, when it says no more than that its cells
    are positions 0..n_cells-1 of the one sequence `seq_id`: per cell i32 pos = i, u32 n_seq_id = 1, i32 seq id (no
    cell ext). Its bytes follow from these numbers (`cell_meta_bytes`)."""

    offset: int
    seq_id: int


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """The regions of a slot file whose cells are positions 0..n_cells-1 of its one sequence, in file order and
    disjoint; every other byte (header, token list, cell metadata, recurrent and sliding-window states, the
    checkpoint appendix) is outside them. `meta`: the cell metadata of the sections those regions are in, where it
    follows from the positions alone."""

    n_cells: int
    regions: tuple[TokenRegion, ...]
    file_size: int
    meta: tuple[CellMeta, ...] = ()


META_CELL_BYTES = 12


def cell_meta_bytes(n_cells: int, seq_id: int) -> np.ndarray:
    """The bytes of a section's cell metadata for positions 0..n_cells-1 of the sequence `seq_id` (`CellMeta`)."""
    words = np.empty((n_cells, 3), dtype="<i4")
    words[:, 0] = np.arange(n_cells, dtype="<i4")
    words[:, 1] = 1
    words[:, 2] = seq_id
    return words.reshape(-1).view(np.uint8)


_MAGIC = 0x67677371  # "ggsq"
_VERSION = 4
_CHECKPOINT_MAGIC = 0x504B4353  # "SCKP"
_CHECKPOINT_VERSION = 1
_MAX_STREAMS = 256  # LLAMA_MAX_SEQ
_MAX_LAYERS = 1 << 16
_MAX_TYPE = 64  # ggml types are small numbers (GGML_TYPE_COUNT is about 40)
_EXT_BYTES = 12  # llama_kv_cell_ext: x, y, tok
_ORDERS = (("A",), ("A", "A"), ("R",), ("A", "R"), ("A", "A", "R"))

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_TYPED_ROW = struct.Struct("<iQ")  # a tensor's type and row size
_TYPED_EL = struct.Struct("<iII")  # a transposed V: type, element size, n_embd_v_gqa

# One reading of an attention section: (n_cells, regions, its cell metadata when that follows from the positions)
# when its cells are positions 0..n-1 of one sequence.
_Qualified = tuple[int, tuple[TokenRegion, ...], CellMeta | None] | None


class _Bad(Exception):
    """The bytes do not read as the structure tried."""


class _Reader:
    def __init__(self, data: mmap.mmap, size: int) -> None:
        self.data = data
        self.size = size

    def need(self, at: int, n: int) -> int:
        if n < 0 or at + n > self.size:
            raise _Bad
        return at + n

    def u32(self, at: int) -> int:
        self.need(at, 4)
        value: int = _U32.unpack_from(self.data, at)[0]
        return value

    def u64(self, at: int) -> int:
        self.need(at, 8)
        value: int = _U64.unpack_from(self.data, at)[0]
        return value

    def words(self, at: int, n_cells: int, width: int) -> np.ndarray:
        end = self.need(at, 4 * n_cells * width)
        return np.frombuffer(self.data[at:end], dtype="<i4").reshape(n_cells, width)


def _check_type(type_id: int) -> None:
    if not 0 <= type_id < _MAX_TYPE:
        raise _Bad


def _attention(r: _Reader, at: int, ext: bool, has_v: bool) -> tuple[int, _Qualified]:
    """One reading of an attention section from `at`: where it ends, and its regions if it qualifies."""
    n_stream = r.u32(at)
    at += 4
    if not 1 <= n_stream <= _MAX_STREAMS:
        raise _Bad
    filled: list[_Qualified] = []
    for _ in range(n_stream):
        n_cells = r.u32(at)
        at += 4
        if n_cells == 0:
            continue
        meta_at = at
        meta = r.words(at, n_cells, 6 if ext else 3)
        at += meta.nbytes
        if (meta[:, 1] != 1).any() or (meta[:, -1] < 0).any():
            raise _Bad
        ordered = bool((meta[:, 0] == np.arange(n_cells)).all() and (meta[:, -1] == meta[0, -1]).all())
        at, regions = _attention_data(r, at, n_cells, has_v)
        plain = None if ext else CellMeta(meta_at, int(meta[0, -1]))
        filled.append((n_cells, regions, plain) if ordered else None)
    return at, filled[0] if len(filled) == 1 else None


def _attention_data(r: _Reader, at: int, n_cells: int, has_v: bool) -> tuple[int, tuple[TokenRegion, ...]]:
    v_trans, n_layer = r.u32(at), r.u32(at + 4)
    at = r.need(at, 16)  # v_trans, n_layer, n_rot_k, n_rot_v
    if v_trans > 1 or not 1 <= n_layer <= _MAX_LAYERS:
        raise _Bad
    regions: list[TokenRegion] = []
    for tensor in range(2 * n_layer if has_v else n_layer):
        if tensor >= n_layer and v_trans:
            r.need(at, _TYPED_EL.size)
            type_id, el_bytes, n_embd = _TYPED_EL.unpack_from(r.data, at)
            _check_type(type_id)
            if el_bytes == 0 or n_embd == 0:
                raise _Bad
            at += _TYPED_EL.size
            regions.append(TokenRegion(at, n_embd, el_bytes, type_id))
            at = r.need(at, n_embd * n_cells * el_bytes)
            continue
        r.need(at, _TYPED_ROW.size)
        type_id, row = _TYPED_ROW.unpack_from(r.data, at)
        _check_type(type_id)
        if row == 0:
            raise _Bad
        at += _TYPED_ROW.size
        regions.append(TokenRegion(at, 1, row, type_id))
        at = r.need(at, n_cells * row)
    return at, tuple(regions)


def _recurrent(r: _Reader, at: int) -> Iterator[int]:
    """Where a recurrent section from `at` may end: after m r tensors and m s tensors, for each m that reads."""
    n_cells = r.u32(at)
    at += 4
    meta = r.words(at, n_cells, 2)
    at += meta.nbytes
    if (meta[:, 1] != 0).any():
        raise _Bad
    s_trans, n_layer = r.u32(at), r.u32(at + 4)
    at += 8
    if s_trans != 0 or not 1 <= n_layer <= _MAX_LAYERS:
        raise _Bad
    rows: list[int] = []
    while len(rows) < 2 * n_layer and at + _TYPED_ROW.size <= r.size:
        type_id, row = _TYPED_ROW.unpack_from(r.data, at)
        if not 0 <= type_id < _MAX_TYPE or at + _TYPED_ROW.size + n_cells * row > r.size:
            return
        at += _TYPED_ROW.size + n_cells * row
        rows.append(row)
        half = len(rows) // 2
        if len(rows) % 2 == 0 and len(set(rows[:half])) == 1 and len(set(rows[half:])) == 1:
            yield at


def _appendix_ends(r: _Reader, at: int) -> bool:
    """Whether nothing follows `at`, or a well-formed checkpoint appendix that ends exactly at the file's end."""
    if at == r.size:
        return True
    try:
        if r.u32(at) != _CHECKPOINT_MAGIC or r.u32(at + 4) != _CHECKPOINT_VERSION:
            return False
        count = r.u32(at + 8)
        at += 12
        for _ in range(count):
            at = r.need(at, 16)  # n_tokens, pos_min, pos_max
            for _blob in range(3):
                at = r.need(at + 8, r.u64(at))
    except _Bad:
        return False
    return at == r.size


def _readings(r: _Reader, at: int, order: tuple[str, ...]) -> Iterator[list[_Qualified]]:
    """Every reading of the sections in `order` from `at` that ends the state where the file or its appendix
    allows: per attention section, its qualification."""
    if not order:
        if _appendix_ends(r, at):
            yield []
        return
    if order[0] == "R":
        try:
            ends = list(_recurrent(r, at))
        except _Bad:
            return
        for end in ends:
            yield from _readings(r, end, order[1:])
        return
    for ext in (False, True):
        for has_v in (True, False):
            try:
                end, qualified = _attention(r, at, ext, has_v)
            except _Bad:
                continue
            for rest in _readings(r, end, order[1:]):
                yield [qualified, *rest]


def _layout(qualified: list[_Qualified], size: int) -> SlotLayout | None:
    found = [q for q in qualified if q is not None]
    if not found:
        return None
    n_cells = max(n for n, _, _ in found)  # the full cache; a sliding window holding fewer cells is left out
    regions = tuple(region for n, rs, _ in found if n == n_cells for region in rs)
    meta = tuple(m for n, _, m in found if n == n_cells and m is not None)
    return SlotLayout(n_cells, regions, size, meta)


def _parse(r: _Reader) -> SlotLayout | None:
    if r.size < 12 or r.u32(0) != _MAGIC or r.u32(4) != _VERSION:
        return None
    start = r.need(12, 4 * r.u32(8))
    layouts = {_layout(qualified, r.size) for order in _ORDERS for qualified in _readings(r, start, order)}
    return layouts.pop() if len(layouts) == 1 else None


def parse_layout(path: Path) -> SlotLayout | None:
    """The token regions of a slot file, or None when the file is not one this code reads exactly (never a guess)."""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            if size < 12:
                return None
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse(_Reader(data, size))
    except (OSError, ValueError, _Bad):
        return None
