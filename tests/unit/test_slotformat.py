"""The slot-file layout parser on synthetic files written here in llama.cpp's format (b11434's
llama_state_seq_save_file, b11549's checkpoint appendix): the regions it finds, and the files it refuses."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest

from slotkeeper.cache.slotformat import SlotLayout, TokenRegion, parse_layout

F16, F32 = 1, 0


def header(n_tokens: int, packed: bool = False) -> bytes:
    words = list(range(100, 100 + n_tokens))
    if packed:
        words = [-1, 1, n_tokens, *words, 0]  # marker, version, the tokens, no media keys
    return struct.pack("<III", 0x67677371, 4, len(words)) + struct.pack(f"<{len(words)}i", *words)


def cell_data(tag: int, n_cells: int, cell_bytes: int) -> bytes:
    """Rows whose every byte tells which tensor and cell they are: byte = (tag * 16 + cell) % 251."""
    return b"".join(bytes([(tag * 16 + cell) % 251]) * cell_bytes for cell in range(n_cells))


def attention(positions: list[int], n_layer: int = 2, row: int = 8, v: str = "rows", ext: bool = False,
              seq: int = 0, n_embd_v: int = 3, el: int = 2, empty_streams: int = 0, tag: int = 0) -> bytes:
    """A KV cache section (llama_kv_cache::state_write) for one sequence; v is "rows", "trans" or "none" (MLA)."""
    n = len(positions)
    out = struct.pack("<I", 1 + empty_streams) + struct.pack("<I", 0) * empty_streams + struct.pack("<I", n)
    for pos in positions:
        out += struct.pack("<iI", pos, 1) + (struct.pack("<iii", 0, 0, 7) if ext else b"") + struct.pack("<i", seq)
    out += struct.pack("<IIII", 1 if v == "trans" else 0, n_layer, 0, 0)
    for il in range(n_layer):
        out += struct.pack("<iQ", F16, row) + cell_data(tag + il, n, row)
    for il in range(n_layer if v != "none" else 0):
        if v == "trans":
            out += struct.pack("<iII", F16, el, n_embd_v)
            out += b"".join(cell_data(tag + 8 + il + j, n, el) for j in range(n_embd_v))
        else:
            out += struct.pack("<iQ", F16, row) + cell_data(tag + 8 + il, n, row)
    return out


def recurrent(last_pos: int, n_layer: int = 4, m: int = 2, r_row: int = 24, s_row: int = 40) -> bytes:
    """A recurrent section (llama_memory_recurrent::state_write): one cell, m r and m s tensors."""
    out = struct.pack("<IiI", 1, last_pos, 0) + struct.pack("<II", 0, n_layer)
    out += b"".join(struct.pack("<iQ", F32, r_row) + b"\x11" * r_row for _ in range(m))
    return out + b"".join(struct.pack("<iQ", F32, s_row) + b"\x22" * s_row for _ in range(m))


def appendix(n_checkpoints: int = 2) -> bytes:
    out = struct.pack("<III", 0x504B4353, 1, n_checkpoints)
    for i in range(n_checkpoints):
        out += struct.pack("<Qii", 10 + i, 0, 9 + i)
        for blob in (b"abc", b"", b"xyzw" * 5):
            out += struct.pack("<Q", len(blob)) + blob
    return out


def write(tmp_path: Path, *parts: bytes) -> Path:
    path = tmp_path / "slot.bin"
    path.write_bytes(b"".join(parts))
    return path


def cells_of(path: Path, layout: SlotLayout, region: TokenRegion) -> np.ndarray:
    """A region's bytes as [outer][cell][bytes]."""
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    size = region.n_outer * layout.n_cells * region.cell_bytes
    return data[region.offset:region.offset + size].reshape(region.n_outer, layout.n_cells, region.cell_bytes)


def assert_tags(path: Path, layout: SlotLayout, tags: list[list[int]]) -> None:
    """Each region's run j, cell c holds the bytes written for (tags[region][j], c)."""
    assert len(layout.regions) == len(tags)
    for region, region_tags in zip(layout.regions, tags, strict=True):
        got = cells_of(path, layout, region)
        for j, tag in enumerate(region_tags):
            expected = [(tag * 16 + c) % 251 for c in range(layout.n_cells)]
            assert (got[j] == np.array(expected, dtype=np.uint8)[:, None]).all()


def test_k_and_v_rows(tmp_path: Path) -> None:
    path = write(tmp_path, header(5), attention(list(range(5)), n_layer=3, row=8))
    layout = parse_layout(path)
    assert layout is not None and layout.n_cells == 5 and layout.file_size == path.stat().st_size
    assert [(r.n_outer, r.cell_bytes) for r in layout.regions] == [(1, 8)] * 6
    assert layout.regions[0].offset == 12 + 5 * 4 + 8 + 5 * 12 + 16 + 12
    assert_tags(path, layout, [[0], [1], [2], [8], [9], [10]])


def test_v_transposed(tmp_path: Path) -> None:
    path = write(tmp_path, header(4), attention(list(range(4)), n_layer=2, row=6, v="trans", n_embd_v=3, el=2))
    layout = parse_layout(path)
    assert layout is not None and layout.n_cells == 4
    assert [(r.n_outer, r.cell_bytes) for r in layout.regions] == [(1, 6), (1, 6), (3, 2), (3, 2)]
    assert_tags(path, layout, [[0], [1], [8, 9, 10], [9, 10, 11]])


def test_v_absent_and_cell_ext(tmp_path: Path) -> None:
    layout = parse_layout(write(tmp_path, header(3), attention([0, 1, 2], v="none", ext=True, n_layer=2)))
    assert layout is not None and len(layout.regions) == 2 and layout.n_cells == 3


def test_hybrid_attention_then_recurrent(tmp_path: Path) -> None:
    path = write(tmp_path, header(6), attention(list(range(6)), n_layer=2), recurrent(5, n_layer=4, m=2))
    layout = parse_layout(path)
    assert layout is not None and layout.n_cells == 6
    assert_tags(path, layout, [[0], [1], [8], [9]])
    assert layout.regions[-1].offset + 6 * 8 < path.stat().st_size - 100  # the recurrent state stays outside


def test_recurrent_shortconv_without_s_rows(tmp_path: Path) -> None:
    """lfm2's short convolution has no s state: its s rows are 0 bytes."""
    path = write(tmp_path, header(3), attention([0, 1, 2]), recurrent(2, m=2, s_row=0))
    layout = parse_layout(path)
    assert layout is not None and len(layout.regions) == 4


def test_iswa_window_left_out(tmp_path: Path) -> None:
    path = write(tmp_path, header(10), attention(list(range(10)), n_layer=2, tag=0),
                 attention(list(range(6, 10)), n_layer=2, tag=3))
    layout = parse_layout(path)
    assert layout is not None and layout.n_cells == 10
    assert_tags(path, layout, [[0], [1], [8], [9]])


def test_iswa_window_holding_every_cell_included(tmp_path: Path) -> None:
    path = write(tmp_path, header(4), attention(list(range(4)), tag=0), attention(list(range(4)), tag=3))
    layout = parse_layout(path)
    assert layout is not None and layout.n_cells == 4
    assert_tags(path, layout, [[0], [1], [8], [9], [3], [4], [11], [12]])


def test_hybrid_iswa(tmp_path: Path) -> None:
    path = write(tmp_path, header(8), attention(list(range(8))), attention([5, 6, 7]), recurrent(7), appendix())
    layout = parse_layout(path)
    assert layout is not None and layout.n_cells == 8 and len(layout.regions) == 4


def test_checkpoint_appendix(tmp_path: Path) -> None:
    path = write(tmp_path, header(5), attention(list(range(5))), appendix(3))
    layout = parse_layout(path)
    assert layout is not None and layout.n_cells == 5 and layout.file_size == path.stat().st_size
    assert_tags(path, layout, [[0], [1], [8], [9]])
    assert parse_layout(write(tmp_path, header(5), attention(list(range(5))), appendix(0))) is not None


def test_packed_token_list(tmp_path: Path) -> None:
    path = write(tmp_path, header(7, packed=True), attention(list(range(7))))
    layout = parse_layout(path)
    assert layout is not None and layout.n_cells == 7
    assert layout.regions[0].offset == 12 + (7 + 4) * 4 + 8 + 7 * 12 + 16 + 12


def test_empty_streams_skipped(tmp_path: Path) -> None:
    """Non-unified caches write one cell count per stream; the sequence's cells are in its own stream."""
    layout = parse_layout(write(tmp_path, header(3), attention([0, 1, 2], empty_streams=3, seq=2)))
    assert layout is not None and layout.n_cells == 3 and len(layout.regions) == 4


def two_sequences() -> bytes:
    section = bytearray(attention(list(range(4))))
    struct.pack_into("<i", section, 8 + 3 * 12 + 8, 1)  # the last cell in sequence 1
    return bytes(section)


@pytest.mark.parametrize("case", [
    "empty", "bad magic", "bad version", "trailing garbage", "bad appendix", "positions from 1", "positions swapped",
    "two sequences", "recurrent only", "swa only left", "bad type", "no state",
])
def test_refused(tmp_path: Path, case: str) -> None:
    good = header(4) + attention(list(range(4)))
    data = {
        "empty": b"",
        "bad magic": b"xxxx" + good[4:],
        "bad version": good[:4] + struct.pack("<I", 3) + good[8:],
        "trailing garbage": good + b"\0\0\0\0junk",
        "bad appendix": good + appendix()[:-1],
        "positions from 1": header(4) + attention([1, 2, 3, 4]),
        "positions swapped": header(4) + attention([0, 2, 1, 3]),
        "two sequences": header(4) + two_sequences(),
        "recurrent only": header(4) + recurrent(3),
        "swa only left": header(4) + attention([2, 3]),
        "bad type": good.replace(struct.pack("<iQ", F16, 8), struct.pack("<iQ", 999, 8)),
        "no state": header(4),
    }[case]
    assert parse_layout(write(tmp_path, data)) is None


def test_truncated_anywhere(tmp_path: Path) -> None:
    data = header(4) + attention(list(range(4)), n_layer=2, row=4) + recurrent(3) + appendix(1)
    assert parse_layout(write(tmp_path, data)) is not None
    accepted = [cut for cut in range(len(data) - 1, 0, -1) if parse_layout(write(tmp_path, data[:cut])) is not None]
    # Only where the bytes are a whole file themselves (the file does not say what model wrote it): the state without
    # its appendix; the recurrent section cut after two tensors of one row size (a model with one recurrent layer);
    # the attention section alone (a dense model); its K tensors alone (an MLA model, which has no V).
    state_end = len(data) - len(appendix(1))
    attention_end = len(header(4)) + len(attention(list(range(4)), n_layer=2, row=4))
    assert accepted == [state_end, state_end - 2 * (12 + 40), attention_end, attention_end - 2 * (12 + 4 * 4)]


def test_missing_file(tmp_path: Path) -> None:
    assert parse_layout(tmp_path / "nope.bin") is None


def test_fast_on_large_files(tmp_path: Path) -> None:
    n, n_layer, row = 4000, 48, 4
    path = write(tmp_path, header(n, packed=True), attention(list(range(n)), n_layer=n_layer, row=row, v="trans",
                                                            n_embd_v=2, el=2))
    parse_layout(path)
    started = time.perf_counter()
    layout = parse_layout(path)
    assert time.perf_counter() - started < 0.05
    assert layout is not None and layout.n_cells == n and len(layout.regions) == 2 * n_layer
