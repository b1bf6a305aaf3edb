"""The block store on synthetic slot files: cutting and assembling byte for byte, blocks shared between states and
stored once, reference counts, and every damage it must catch (a missing or damaged block, a torn tail, a crash
between writing blocks and committing). The parser itself is tested in test_slotformat.py; here the layout is
given."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotkeeper.cache import blockstore as blockstore_module
from slotkeeper.cache.blocks import (
    Cut,
    Positions,
    StoredBlock,
    block_payload,
    cut_limit,
    follow_ends,
    grid_ends,
    place_block,
    place_tail,
    tail_pieces,
)
from slotkeeper.cache.blockstore import TAIL_SUFFIX, BlockStore, DamagedState
from slotkeeper.cache.slotformat import CellMeta, SlotLayout, TokenRegion, cell_meta_bytes
from slotkeeper.cache.store import QUARANTINE_DIR, SnapshotStore
from slotkeeper.cache.tokens import as_tokens
from slotkeeper.errors import SnapshotError
from slotkeeper.types import SessionKey, SnapshotKind

FINGERPRINT = "f" * 16


def _file(n_cells: int, regions: list[tuple[int, int]], gap: int = 24, seed: int = 0,
          tokens: list[int] | None = None, shared_cells: int = 0, base: np.ndarray | None = None,
          ) -> tuple[bytes, SlotLayout, np.ndarray]:
    """A slot-file-like buffer: a header with the token list (as llama-server writes it), then per region a gap and
    n_outer runs of n_cells cells; returns the bytes, the layout and the tokens."""
    rng = np.random.default_rng(seed)
    toks = np.asarray(tokens if tokens is not None else rng.integers(0, 1000, n_cells), dtype=np.int32)
    header = struct.pack("<III", 0x67677371, 4, toks.size) + toks.astype("<i4").tobytes()
    out = bytearray(header)
    layout_regions = []
    for i, (n_outer, cell_bytes) in enumerate(regions):
        out += rng.integers(0, 256, gap, dtype=np.uint8).tobytes()
        data = rng.integers(0, 256, (n_outer, n_cells * cell_bytes), dtype=np.uint8)
        if base is not None and shared_cells:
            # The same prefix as another file: the same bytes for its first cells.
            other = base[i]
            data[:, :shared_cells * cell_bytes] = other[:, :shared_cells * cell_bytes]
        layout_regions.append(TokenRegion(len(out), n_outer, cell_bytes))
        out += data.tobytes()
    out += b"SCKP-appendix-like-trailer"
    return bytes(out), SlotLayout(n_cells, tuple(layout_regions), len(out)), toks


def _regions_of(data: bytes, layout: SlotLayout) -> list[np.ndarray]:
    buf = np.frombuffer(data, dtype=np.uint8)
    return [buf[r.offset:r.offset + r.n_outer * layout.n_cells * r.cell_bytes]
            .reshape(r.n_outer, layout.n_cells * r.cell_bytes) for r in layout.regions]


@settings(max_examples=60, deadline=None)
@given(n_cells=st.integers(1, 300), block=st.sampled_from([4, 16, 64]),
       regions=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 9)), min_size=1, max_size=4),
       stored=st.sets(st.integers(1, 300), max_size=12), n_tokens=st.integers(1, 300))
def test_cutting_and_placing_back_gives_the_same_bytes(n_cells: int, block: int, regions: list[tuple[int, int]],
                                                       stored: set[int], n_tokens: int) -> None:
    """Any cut, on the grid or following stored blocks that end anywhere, cells left in the tail or not."""
    data, layout, _ = _file(n_cells, regions)
    limit = cut_limit(layout, n_tokens, block)
    if min(n_cells, n_tokens) < block:
        assert limit == 0
        return
    assert limit == min(n_cells, n_tokens)
    cut = Cut(layout, block, follow_ends(limit, block, lambda start: stored))
    assert cut.covered == limit
    buffer = np.frombuffer(data, dtype=np.uint8)
    tail = b"".join(bytes(p) for p in tail_pieces(buffer, cut))
    assert len(tail) == cut.tail_size == len(data) - sum(map(cut.block_bytes, range(cut.n_blocks)))
    out = np.zeros(len(data), dtype=np.uint8)
    place_tail(out, cut, tail)
    for b in range(cut.n_blocks):
        place_block(out, cut, b, block_payload(buffer, cut, b))
    assert out.tobytes() == data


def _keys(tokens: list[int], layout: SlotLayout, fingerprint: str = FINGERPRINT) -> list[str]:
    positions = Positions(as_tokens(tokens), len(tokens), 128, fingerprint, layout)
    return [positions.block_key(0, 128), positions.block_key(128, 256), positions.block_key(100, 200),
            positions.opens(100), positions.opens(128)]


def test_keys_hash_every_token_before_them_the_span_the_fingerprint_and_the_kv_types() -> None:
    _, layout, _ = _file(8, [(1, 2)])
    a = _keys(list(range(256)), layout)
    b = _keys([*range(255), 9999], layout)
    c = _keys([7, *range(1, 256)], layout)
    d = _keys([*range(150), 9999, *range(151, 256)], layout)
    assert a[0] == b[0] and a[2:] == b[2:] and a[1] != b[1]  # only the keys that reach the last token differ
    assert not set(a) & set(c)  # a change in the first token changes every key
    assert a[0] == d[0] and a[3:] == d[3:] and a[1] != d[1] and a[2] != d[2]
    assert len(set(a)) == len(a)  # spans and positions never share a key
    # A position's key is the same whatever the cut: it depends on the tokens before it, not on where blocks end.
    short = Positions(as_tokens(range(140)), 140, 128, FINGERPRINT, layout)
    assert short.opens(100) == a[3] and short.opens(128) == a[4] and short.grid_opens[1] == a[4]
    assert not set(_keys(list(range(256)), layout, "other")) & set(a)
    # f16 (type 1) and bf16 (type 30) rows are of one size: the types alone tell them apart.
    f16 = SlotLayout(8, (TokenRegion(10, 1, 2, 1),), 100)
    bf16 = SlotLayout(8, (TokenRegion(10, 1, 2, 30),), 100)
    assert not set(_keys(list(range(256)), f16)) & set(_keys(list(range(256)), bf16))


_GRID = (16, 32, 48, 64, 80, 96)


@pytest.mark.parametrize(("limit", "stored", "ends"), [
    (100, {}, (*_GRID, 100)),  # the grid, and the cells after its last line
    (16, {}, (16,)),
    (100, {96: [100]}, (*_GRID, 100)),  # the last save ended at 100, and this one too: its last block
    (150, {96: [100]}, (*_GRID, 100, 112, 128, 144, 150)),  # then to the grid from where it ended
    (150, {96: [98, 100, 99]}, (*_GRID, 100, 112, 128, 144, 150)),  # the longest stored block
    (99, {96: [100]}, (*_GRID, 99)),  # a stored block past the limit is not this state's
    (150, {0: [10], 10: [16], 64: [70]}, (10, 16, 32, 48, 64, 70, 80, 96, 112, 128, 144, 150)),
    (150, {96: [100], 100: [105]}, (*_GRID, 100, 105, 112, 128, 144, 150)),  # two saves ended in one step
    (150, {96: [113]}, (*_GRID, 112, 128, 144, 150)),  # never across a grid line
])
def test_a_cut_follows_the_blocks_stored_before_and_else_the_grid(limit: int, stored: dict[int, list[int]],
                                                                 ends: tuple[int, ...]) -> None:
    assert follow_ends(limit, 16, lambda start: stored.get(start, ())) == ends


@pytest.mark.parametrize(("limit", "prompt_end", "stored", "ends"), [
    (150, 100, {}, (*_GRID, 100, 112, 128, 144, 150)),  # a block ends where the prompt does
    (150, 96, {}, (*_GRID, 112, 128, 144, 150)),  # on a grid line: nothing more
    (150, 0, {}, (*_GRID, 112, 128, 144, 150)),  # not known
    (150, 150, {}, (*_GRID, 112, 128, 144, 150)),  # nothing generated
    (150, 100, {96: [98]}, (*_GRID, 98, 100, 112, 128, 144, 150)),
    # The next turn: the last save's prompt (100) is sent back, its answer (100-130) not as it was generated.
    (200, 160, {96: [100]}, (*_GRID, 100, 112, 128, 144, 160, 176, 192, 200)),
])
def test_a_block_ends_where_the_prompt_does_so_that_the_next_save_names_it(
        limit: int, prompt_end: int, stored: dict[int, list[int]], ends: tuple[int, ...]) -> None:
    assert follow_ends(limit, 16, lambda start: stored.get(start, ()), prompt_end) == ends


@pytest.fixture()
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BlockStore:
    return BlockStore(tmp_path / "slots", 16)


def _use_layout(monkeypatch: pytest.MonkeyPatch, layouts: dict[str, SlotLayout]) -> None:
    monkeypatch.setattr(blockstore_module, "parse_layout", lambda path: layouts.get(path.name))


def test_a_split_state_assembles_byte_for_byte(store: BlockStore, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    data, layout, toks = _file(100, [(1, 8), (3, 2), (1, 8)])
    store.slot_dir.mkdir(parents=True)
    (store.slot_dir / "a.bin.src").write_bytes(data)
    _use_layout(monkeypatch, {"a.bin.src": layout})
    split = store.split(store.slot_dir / "a.bin.src", "a.bin", toks, FINGERPRINT)
    assert split is not None and split.exact
    store.release(split.digests)
    # 6 blocks on the grid and the 4 cells after it: every cell in a block.
    assert split.cut.ends == (16, 32, 48, 64, 80, 96, 100) and split.new_block_bytes == 100 * (8 + 6 + 8)
    assert split.tail_bytes == len(data) - split.new_block_bytes
    n, checksum = store.assemble("a.bin", tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data and n == len(data) and checksum == split.checksum


def _with_meta(n_cells: int, regions: list[tuple[int, int]], seq_id: int, wrong_cell: int | None = None
               ) -> tuple[bytes, SlotLayout, np.ndarray]:
    """A slot-file-like buffer whose attention section has its cell metadata before its regions, as llama-server
    writes it (positions 0..n-1 of `seq_id`); `wrong_cell`: that cell's position is off by one."""
    rng = np.random.default_rng(seq_id)
    toks = rng.integers(0, 1000, n_cells).astype("<i4")
    out = bytearray(struct.pack("<III", 0x67677371, 4, toks.size) + toks.tobytes() + b"\x01\x00\x00\x00")
    meta_at = len(out)
    meta = cell_meta_bytes(n_cells, seq_id).copy()
    if wrong_cell is not None:
        meta.view("<i4")[3 * wrong_cell] += 1
    out += meta.tobytes() + rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
    layout_regions = []
    for n_outer, cell_bytes in regions:
        out += rng.integers(0, 256, 12, dtype=np.uint8).tobytes()
        layout_regions.append(TokenRegion(len(out), n_outer, cell_bytes))
        out += rng.integers(0, 256, n_outer * n_cells * cell_bytes, dtype=np.uint8).tobytes()
    out += b"appendix"
    return bytes(out), SlotLayout(n_cells, tuple(layout_regions), len(out), (CellMeta(meta_at, seq_id),)), toks


@pytest.mark.parametrize("regions", [[(1, 8), (1, 4)], [(1, 8), (3, 2)]])  # rows; and runs (V transposed)
def test_cell_metadata_of_positions_alone_is_written_by_the_assembly_and_left_out_of_the_tail(
        store: BlockStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, regions: list[tuple[int, int]]) -> None:
    cell = sum(k * c for k, c in regions)
    store.slot_dir.mkdir(parents=True)
    for seq_id, wrong, left_out in ((3, None, 12 * 90), (4, 17, 0)):  # metadata that says more stays in the tail
        data, layout, toks = _with_meta(90, regions, seq_id, wrong)
        source = store.slot_dir / f"{seq_id}.src"
        source.write_bytes(data)
        _use_layout(monkeypatch, {source.name: layout})
        split = store.split(source, f"{seq_id}.bin", toks, FINGERPRINT)
        assert split is not None and split.exact and split.cut.covered == 90
        assert split.tail_bytes == len(data) - 90 * cell - left_out, seq_id
        assert len(split.cut.layout.meta) == (1 if left_out else 0)
        assert store.manifest(f"{seq_id}.bin").cut == split.cut
        store.assemble(f"{seq_id}.bin", tmp_path / "out.bin")
        assert (tmp_path / "out.bin").read_bytes() == data, seq_id
        store.release(split.digests)


def test_a_shared_prefix_is_stored_once(store: BlockStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, layout_a, toks_a = _file(160, [(1, 8), (2, 4)], seed=1)
    base = _regions_of(first, layout_a)
    second, layout_b, _ = _file(160, [(1, 8), (2, 4)], seed=2, tokens=[*toks_a[:100].tolist(), *range(60)],
                                shared_cells=100, base=base)
    store.slot_dir.mkdir(parents=True)
    (store.slot_dir / "a.src").write_bytes(first)
    (store.slot_dir / "b.src").write_bytes(second)
    _use_layout(monkeypatch, {"a.src": layout_a, "b.src": layout_b})
    a = store.split(store.slot_dir / "a.src", "a.bin", as_tokens(toks_a), FINGERPRINT)
    b = store.split(store.slot_dir / "b.src", "b.bin", as_tokens([*toks_a[:100].tolist(), *range(60)]), FINGERPRINT)
    assert a is not None and b is not None
    assert a.prefixes[:6] == b.prefixes[:6] and a.prefixes[6:] != b.prefixes[6:]  # 100 shared tokens: 6 blocks
    assert a.digests[:6] == b.digests[:6] and a.digests[6:] != b.digests[6:]
    assert b.new_block_bytes == (10 - 6) * 16 * (8 + 8) and b.exact
    store.assemble("b.bin", tmp_path / "b.out")
    assert (tmp_path / "b.out").read_bytes() == second


def test_damage_is_caught_before_any_byte_is_used(store: BlockStore, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    data, layout, toks = _file(64, [(2, 4)])
    store.slot_dir.mkdir(parents=True)
    (store.slot_dir / "a.src").write_bytes(data)
    _use_layout(monkeypatch, {"a.src": layout})
    split = store.split(store.slot_dir / "a.src", "a.bin", toks, FINGERPRINT)
    assert split is not None
    block = store.block_path(split.digests[1])
    good = block.read_bytes()
    # A flipped byte in a block.
    block.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(DamagedState) as caught:
        store.assemble("a.bin", tmp_path / "out.bin")
    assert caught.value.block == split.digests[1] and not (tmp_path / "out.bin").exists()
    assert not block.exists()  # moved into the quarantine by the assembly that met it
    # A truncated block; a missing block.
    block.write_bytes(good[:-5])
    with pytest.raises(DamagedState):
        store.assemble("a.bin", tmp_path / "out.bin")
    block.unlink(missing_ok=True)
    with pytest.raises(DamagedState, match="missing"):
        store.assemble("a.bin", tmp_path / "out.bin")
    block.write_bytes(good)
    # A damaged tail: its bytes, then its manifest.
    tail = store.tail_path("a.bin")
    whole = tail.read_bytes()
    tail.write_bytes(b"\x00" + whole[1:])
    with pytest.raises(DamagedState, match="tail"):
        store.assemble("a.bin", tmp_path / "out.bin")
    tail.write_bytes(whole[:-40] + bytes(40))
    with pytest.raises(DamagedState):
        store.manifest("a.bin")
    tail.write_bytes(whole)
    store.assemble("a.bin", tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data


def test_blocks_in_flight_or_named_are_never_collected(store: BlockStore, monkeypatch: pytest.MonkeyPatch) -> None:
    data, layout, toks = _file(32, [(1, 4)])
    store.slot_dir.mkdir(parents=True)
    (store.slot_dir / "a.src").write_bytes(data)
    _use_layout(monkeypatch, {"a.src": layout})
    split = store.split(store.slot_dir / "a.src", "a.bin", toks, FINGERPRINT)
    assert split is not None
    # Not released yet: in flight, so not collected though nothing names them.
    assert store.collect(split.digests, lambda digests: set()) == 0
    store.release(split.digests)
    assert store.collect(split.digests, lambda digests: {split.digests[0]}) == 1
    assert store.block_path(split.digests[0]).exists() and not store.block_path(split.digests[1]).exists()


# -- through the snapshot store ---------------------------------------------------------------------------------


def _snapshot_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layouts: dict[str, SlotLayout]
                    ) -> SnapshotStore:
    monkeypatch.setattr(blockstore_module, "parse_layout", lambda path: layouts.get(path.name.split(".tmp-")[0]))
    return SnapshotStore(tmp_path / "slots", tmp_path / "index.db", block_tokens=16)


def _save(store: SnapshotStore, key: SessionKey, data: bytes) -> str:
    temp = store.temp_name(key, FINGERPRINT)
    (store.slot_dir / temp).write_bytes(data)
    return temp


def test_states_share_blocks_and_a_block_goes_with_the_last_state_naming_it(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    first, layout, toks = _file(64, [(1, 8)], seed=3)
    second, layout2, _ = _file(64, [(1, 8)], seed=4, tokens=toks.tolist(), shared_cells=64,
                               base=_regions_of(first, layout))
    a, b = SessionKey("m", "a"), SessionKey("m", "b")
    stem_a, stem_b = a.file_stem(FINGERPRINT, _kind()), b.file_stem(FINGERPRINT, _kind())
    store = _snapshot_store(tmp_path, monkeypatch, {stem_a: layout, stem_b: layout2})
    snap_a = store.commit(a, _save(store, a, first), FINGERPRINT, 64)
    snap_b = store.commit(b, _save(store, b, second), FINGERPRINT, 64)
    assert snap_a.tail_bytes and snap_b.tail_bytes
    assert not list(store.slot_dir.glob("*.bin"))  # no whole file is kept
    assert store.blocks.usage()[0] == 4  # 64 tokens in blocks of 16, once for both
    assert store.tokens_of(snap_b) is not None
    with store.open_whole(snap_b) as fh:
        assert fh.read() == second
    store.delete(a)
    assert store.blocks.usage()[0] == 4
    store.delete(b)
    assert store.blocks.usage() == (0, 0)
    assert not list(store.slot_dir.glob("*" + TAIL_SUFFIX))


def test_a_state_saved_again_with_more_tokens_writes_only_the_cells_after_its_last_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn after turn, the index offers each save the blocks the last one stored: it names them, the one that ended
    between two grid lines too, and writes only its new cells, in blocks up to the next grid line and on from there.
    Every turn's state assembles byte for byte."""
    regions, cell = [(1, 8), (3, 2)], 8 + 3 * 2
    full, full_layout, toks = _file(130, regions, seed=20)
    key = SessionKey("m", "a")
    layouts: dict[str, SlotLayout] = {}
    store = _snapshot_store(tmp_path, monkeypatch, layouts)
    before = (0, 0)
    # (tokens, the blocks this save adds): 40 = 16 + 16 + 8; 75 = the 8 to the grid line, 16, 11; then 5 + 10; 6 + 16
    # + 16 + 2.
    for turn, (n, new_blocks) in enumerate([(40, 3), (75, 3), (90, 2), (130, 4)]):
        data, layout, _ = _file(n, regions, seed=21 + turn, tokens=toks[:n].tolist(), shared_cells=n,
                                base=_regions_of(full, full_layout))
        layouts[key.file_stem(FINGERPRINT, _kind())] = layout
        snapshot = store.commit(key, _save(store, key, data), FINGERPRINT, n)
        count, n_bytes = store.blocks.usage()
        added = (count - before[0], n_bytes - before[1])
        cells = n - (before[1] - before[0] * blockstore_module.BLOCK_HEADER_BYTES) // cell
        assert added == (new_blocks, new_blocks * blockstore_module.BLOCK_HEADER_BYTES + cells * cell), turn
        assert cells == n - (0, 40, 75, 90)[turn]
        before = (count, n_bytes)
        with store.open_whole(snapshot) as fh:
            assert fh.read() == data
    assert len(list(store.slot_dir.glob("*" + TAIL_SUFFIX))) == 1  # each save replaced the one before


def test_a_tail_written_before_cuts_followed_stored_blocks_still_assembles(store: BlockStore, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest of the grid-only format (SKTAIL02: a count of full blocks, the cells after them in the tail)."""
    import json

    import xxhash

    data, layout, toks = _file(64, [(1, 8), (2, 4)], seed=30)
    store.slot_dir.mkdir(parents=True)
    (store.slot_dir / "a.src").write_bytes(data)
    _use_layout(monkeypatch, {"a.src": layout})
    split = store.split(store.slot_dir / "a.src", "a.bin", toks, FINGERPRINT)
    assert split is not None and split.cut.ends == (16, 32, 48, 64)
    manifest = store.manifest("a.bin")
    tail = store.read_tail(manifest, "a.bin")
    cut = json.loads(json.dumps(blockstore_module.layout_to_json(split.cut)))
    del cut["ends"]
    cut["n_blocks"] = 4
    body = json.dumps({"cut": cut, "prefixes": list(manifest.prefixes), "digests": list(manifest.digests),
                       "tail_checksum": manifest.tail_checksum, "checksum": manifest.checksum}).encode()
    trailer = blockstore_module._TRAILER.pack(len(body), xxhash.xxh3_128_digest(body), b"SKTAIL02")
    store.tail_path("a.bin").write_bytes(tail + body + trailer)
    assert store.manifest("a.bin").cut == split.cut
    store.assemble("a.bin", tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data


def test_a_restore_gets_an_assembled_file_and_a_damaged_block_sends_the_state_to_quarantine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data, layout, _ = _file(48, [(2, 4)], seed=5)
    key = SessionKey("m", "a")
    store = _snapshot_store(tmp_path, monkeypatch, {key.file_stem(FINGERPRINT, _kind()): layout})
    snapshot = store.commit(key, _save(store, key, data), FINGERPRINT, 48)
    checked = store.checked_snapshot(key, FINGERPRINT)
    assert checked is not None and store.materialize(checked)
    assert (store.slot_dir / snapshot.filename).read_bytes() == data
    store.restored(checked)
    assert not (store.slot_dir / snapshot.filename).exists()  # the assembled file goes after the restore
    next(store.blocks.root.rglob("*.blk")).write_bytes(b"junk")
    assert not store.materialize(checked)
    assert store.get(key) is None and not (store.slot_dir / snapshot.filename).exists()


def test_a_crash_between_the_blocks_and_the_commit_leaves_nothing_named_and_the_sweep_removes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data, layout, _ = _file(48, [(2, 4)], seed=6)
    key = SessionKey("m", "a")
    store = _snapshot_store(tmp_path, monkeypatch, {key.file_stem(FINGERPRINT, _kind()): layout})
    kept = store.commit(key, _save(store, key, data), FINGERPRINT, 48)
    # Another save stored its blocks and tail, and the process died before the index row.
    other = SessionKey("m", "b")
    data2, layout2, toks2 = _file(48, [(2, 4)], seed=7)
    (store.slot_dir / "x.src").write_bytes(data2)
    monkeypatch.setattr(blockstore_module, "parse_layout", lambda path: layout2)
    split = store.blocks.split(store.slot_dir / "x.src", other.file_stem(FINGERPRINT, _kind()) + "-00000000.bin",
                               toks2, FINGERPRINT)
    assert split is not None
    # And a block write cut short (a temporary of the block's shape, which must not pass for a block).
    torn = store.blocks.block_path(split.digests[0]).with_name(f".tmp-0badc0de-{split.digests[0]}.blk")
    torn.write_bytes(b"torn")
    os.utime(torn, (time.time() - 60, time.time() - 60))  # written before the crash, a minute ago
    store.close()
    again = SnapshotStore(tmp_path / "slots", tmp_path / "index.db", block_tokens=16)
    again.reconcile()
    assert again.sweep_blocks() == 3
    assert again.blocks.usage()[0] == 3 and not torn.exists()
    assert not again.blocks.tail_path(other.file_stem(FINGERPRINT, _kind()) + "-00000000.bin").exists()
    checked = again.checked_snapshot(key, FINGERPRINT)
    assert checked is not None and checked.filename == kept.filename and again.materialize(checked)
    assert (again.slot_dir / kept.filename).read_bytes() == data


def _kind() -> SnapshotKind:
    return SnapshotKind.SESSION


def test_a_cut_needs_a_grid_step_of_cells_and_tokens() -> None:
    _, layout, _ = _file(40, [(1, 4)])
    assert cut_limit(layout, 40, 64) == 0
    assert cut_limit(layout, 10, 8) == 10 and grid_ends(10, 8) == (8, 10)
    assert cut_limit(layout, 100, 8) == 40  # the cells a file holds
    assert cut_limit(None, 100, 8) == 0


def test_the_disk_budget_counts_a_shared_block_once_and_frees_what_only_the_evicted_state_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slotkeeper.cache.budget import DiskBudget

    first, layout, toks = _file(64, [(1, 8)], seed=8)
    second, layout2, _ = _file(64, [(1, 8)], seed=9, tokens=[*toks[:32].tolist(), *range(32)], shared_cells=32,
                               base=_regions_of(first, layout))
    a, b = SessionKey("m", "a"), SessionKey("m", "b")
    store = _snapshot_store(tmp_path, monkeypatch, {a.file_stem(FINGERPRINT, _kind()): layout,
                                                    b.file_stem(FINGERPRINT, _kind()): layout2})
    snap_a = store.commit(a, _save(store, a, first), FINGERPRINT, 64)
    snap_b = store.commit(b, _save(store, b, second), FINGERPRINT, 64)
    count, block_bytes = store.blocks.usage()
    assert count == 6  # 2 shared, 2 of a's own, 2 of b's own
    on_disk = block_bytes + sum(p.stat().st_size - 0 for p in store.slot_dir.glob("*.tail"))
    tails_payload = snap_a.tail_bytes + snap_b.tail_bytes
    assert store._index.total_bytes() == block_bytes + tails_payload
    assert on_disk >= store._index.total_bytes()  # the tails' manifests are not counted: small
    one_block = block_bytes // 6
    # A budget that one state's eviction meets: the least recently used (a) goes, freeing its tail and its own 2.
    budget = DiskBudget(max_bytes=store._index.total_bytes() - 1)
    evicted = store.enforce_budget(budget)
    assert [e.snapshot.session_id for e in evicted] == ["a"]
    assert evicted[0].snapshot.n_bytes == snap_a.tail_bytes + 2 * one_block
    assert store.blocks.usage()[0] == 4 and store._index.total_bytes() == 4 * one_block + snap_b.tail_bytes


@pytest.mark.parametrize("regions", [[(1, 8), (1, 4), (1, 8)], [(1, 8), (5, 2)], [(4, 2)]])
def test_rows_and_runs_assemble_byte_for_byte_through_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                regions: list[tuple[int, int]]) -> None:
    data, layout, toks = _file(77, regions, seed=12)
    store = BlockStore(tmp_path / "slots", 16)
    store.slot_dir.mkdir(parents=True)
    (store.slot_dir / "a.src").write_bytes(data)
    _use_layout(monkeypatch, {"a.src": layout})
    split = store.split(store.slot_dir / "a.src", "a.bin", toks, FINGERPRINT)
    assert split is not None
    store.assemble("a.bin", tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data


def test_after_a_restart_the_most_recent_states_are_assembled_into_the_ram_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slotkeeper.cache.ramdir import RamDir

    data, layout, _ = _file(48, [(1, 8)], seed=13)
    other, layout2, _ = _file(48, [(1, 8)], seed=14)
    a, b = SessionKey("m", "a"), SessionKey("m", "b")
    layouts = {a.file_stem(FINGERPRINT, _kind()): layout, b.file_stem(FINGERPRINT, _kind()): layout2}
    store = _snapshot_store(tmp_path, monkeypatch, layouts)
    snap_a = store.commit(a, _save(store, a, data), FINGERPRINT, 48)
    snap_b = store.commit(b, _save(store, b, other), FINGERPRINT, 48)
    store.close()
    ram_path = tmp_path / "ram"
    # Room for one (half the budget): the most recently used (b) is assembled, a is not.
    again = SnapshotStore(tmp_path / "slots", tmp_path / "index.db",
                          RamDir(ram_path, tmp_path / "slots", 2 * len(other) + 1), block_tokens=16)
    again.reconcile()
    assert again.prewarm_ram("another fingerprint") == 0
    assert again.prewarm_ram(FINGERPRINT) == 1
    assert (ram_path / snap_b.filename).read_bytes() == other and not (ram_path / snap_a.filename).exists()
    assert again.prewarm_ram(FINGERPRINT) == 0  # in RAM already, and no room for a
    checked = again.checked_snapshot(b, FINGERPRINT)
    assert checked is not None and again.materialize(checked)
    again.restored(checked)
    assert (ram_path / snap_b.filename).read_bytes() == other


def test_a_full_disk_during_a_save_keeps_the_previous_state_and_leaves_no_block_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    first, layout, toks = _file(64, [(1, 8)], seed=15)
    second, layout2, _ = _file(96, [(1, 8)], seed=16, tokens=[*toks.tolist(), *range(32)], shared_cells=64,
                               base=_regions_of(first, layout))
    key = SessionKey("m", "a")
    stem = key.file_stem(FINGERPRINT, _kind())
    store = _snapshot_store(tmp_path, monkeypatch, {stem: layout})
    kept = store.commit(key, _save(store, key, first), FINGERPRINT, 64)
    assert store.blocks.usage()[0] == 4
    monkeypatch.setattr(blockstore_module, "parse_layout", lambda path: layout2)
    real = blockstore_module._write_atomically
    writes = []

    def full_after_one(path: Path, pieces: object, temp: Path | None = None) -> None:
        writes.append(path)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, pieces, temp)  # type: ignore[arg-type]

    monkeypatch.setattr(blockstore_module, "_write_atomically", full_after_one)
    with pytest.raises(SnapshotError, match="No space left"):
        store.commit(key, _save(store, key, second), FINGERPRINT, 96)
    assert store.get(key) == kept  # the previous state stands, whole
    assert store.blocks.usage()[0] == 4  # the one new block written before the disk filled went at once
    assert not list(store.slot_dir.glob(".tmp-*")) and not list(store.slot_dir.glob("*.tmp-*"))
    checked = store.checked_snapshot(key, FINGERPRINT)
    assert checked is not None and store.materialize(checked)


# -- issue 37: what a block's name says, and what is alive ------------------------------------------------------


def test_two_saves_of_one_prefix_with_other_float_noise_name_the_first_block_and_assemble_intact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, layout, toks = _file(64, [(1, 8)], seed=20)
    noisy, _, _ = _file(64, [(1, 8)], seed=21, tokens=toks.tolist())  # the same tokens, other bytes
    a, b = SessionKey("m", "a"), SessionKey("m", "b")
    store = _snapshot_store(tmp_path, monkeypatch, {a.file_stem(FINGERPRINT, _kind()): layout,
                                                    b.file_stem(FINGERPRINT, _kind()): layout})
    store.commit(a, _save(store, a, first), FINGERPRINT, 64)
    snap_b = store.commit(b, _save(store, b, noisy), FINGERPRINT, 64)
    assert store.blocks.usage()[0] == 4  # b names a's blocks by their prefixes: its own noise is not stored
    with store.open_whole(snap_b) as fh:
        assembled = fh.read()
    # a's KV for those tokens (b's own header and metadata), every byte checked on the way.
    assert [r.tobytes() for r in _regions_of(assembled, layout)] == [r.tobytes() for r in _regions_of(first, layout)]
    assert snap_b.checksum != store.get(a).checksum  # type: ignore[union-attr]


def test_an_imported_states_blocks_are_never_offered_to_another_state(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from slotkeeper.version import Version

    foreign, layout, toks = _file(64, [(1, 8)], seed=22)
    own, _, _ = _file(64, [(1, 8)], seed=23, tokens=toks.tolist())
    imported, local = SessionKey("m", "imported"), SessionKey("m", "local")
    store = _snapshot_store(tmp_path, monkeypatch, {imported.file_stem(FINGERPRINT, _kind()): layout,
                                                    local.file_stem(FINGERPRINT, _kind()): layout})
    store.commit(imported, _save(store, imported, foreign), FINGERPRINT, 64, version=Version(1, 1))
    snap = store.commit(local, _save(store, local, own), FINGERPRINT, 64)
    assert store.blocks.usage()[0] == 8  # this host's save stored its own bytes beside the import's
    with store.open_whole(snap) as fh:
        assert fh.read() == own


def test_a_collection_cannot_delete_the_blocks_of_a_commit_that_lands_while_it_reads_the_index(
        store: BlockStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Confirmed at 99614b5: `collect` read which blocks are named before it took the lock, so a commit (its rows
    written, then its hold released) in between lost its blocks."""
    data, layout, toks = _file(32, [(1, 4)])
    store.slot_dir.mkdir(parents=True)
    (store.slot_dir / "a.src").write_bytes(data)
    _use_layout(monkeypatch, {"a.src": layout})
    split = store.split(store.slot_dir / "a.src", "a.bin", toks, FINGERPRINT)
    assert split is not None
    named: set[str] = set()

    def commit() -> None:  # the save's commit: its rows, then the release of its hold
        named.update(split.digests)
        store.release(split.digests)

    committer = threading.Thread(target=commit)

    def stale_read(digests: object) -> set[str]:
        seen = set(named)  # what the index holds when the collection reads it: not the commit yet
        committer.start()
        committer.join(timeout=0.5)  # the commit lands now, if nothing holds it back
        return seen

    store.collect(split.digests, stale_read)
    committer.join()
    assert all(store.block_path(d).exists() for d in split.digests)


def test_the_start_sweep_leaves_temporaries_a_live_save_or_download_is_writing(tmp_path: Path) -> None:
    """Confirmed at 99614b5: the sweep of blocks no state names, which runs while requests are served, removed every
    `.tmp-*` under `blocks/`, a save's and a download's in flight among them."""
    store = SnapshotStore(tmp_path / "slots", tmp_path / "index.db", block_tokens=16)
    live_download = store.blocks.temp_path("block")
    live_download.write_bytes(b"half a download")
    live_block = store.blocks.root / "ab" / f".tmp-00000000-{'ab' * 16}.blk"
    live_block.parent.mkdir(parents=True)
    live_block.write_bytes(b"half a block")
    crashed = store.blocks.root / "ab" / f".tmp-11111111-{'ab' * 16}.blk"
    crashed.write_bytes(b"left by a crash")
    os.utime(crashed, (time.time() - 3600, time.time() - 3600))
    store.sweep_blocks()
    assert live_download.exists() and live_block.exists() and not crashed.exists()


def test_the_start_sweep_removes_at_once_what_a_killed_process_of_this_host_was_writing(tmp_path: Path) -> None:
    """Seen in CI at fd0822e: a kill -9 and a start a second later left the killed process's block temporaries,
    younger than the sweep's margin, until the next start. A temporary names its writer: one of a process of this
    host that is gone goes at once; a live process's (this one's, another's) and another host's stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store = SnapshotStore(tmp_path / "slots", tmp_path / "index.db", block_tokens=16)
    host = blockstore_module._HOST
    folder = store.blocks.root / "ab"
    folder.mkdir(parents=True)
    digest = "ab" * 16
    killed = folder / f".tmp-{dead.pid}.{host}.00000000-{digest}.blk"
    killed_download = store.blocks.temp_path("block").with_name(f".tmp-{dead.pid}.{host}.00000001-block")
    mine = store.blocks.temp_path("block")
    parent = folder / f".tmp-{os.getppid()}.{host}.00000002-{digest}.blk"
    elsewhere = folder / f".tmp-{dead.pid}.0f0f0f0f.00000003-{digest}.blk"
    for path in (killed, killed_download, mine, parent, elsewhere):
        path.write_bytes(b"half a block")
    assert store.blocks.sweep_temporaries() == 2
    assert not killed.exists() and not killed_download.exists()
    assert mine.exists() and parent.exists() and elsewhere.exists()


def test_a_damaged_block_costs_a_prefill_once_and_the_next_save_writes_it_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Confirmed at 99614b5: a damaged stored block made every later save of its prefix raise (DamagedState was not
    caught), leaving its temporaries behind."""
    first, layout, toks = _file(64, [(1, 8)], seed=24)
    noisy, _, _ = _file(64, [(1, 8)], seed=25, tokens=toks.tolist())
    a, b, c = SessionKey("m", "a"), SessionKey("m", "b"), SessionKey("m", "c")
    store = _snapshot_store(tmp_path, monkeypatch, {k.file_stem(FINGERPRINT, _kind()): layout for k in (a, b, c)})
    snap_a = store.commit(a, _save(store, a, first), FINGERPRINT, 64)
    damaged = store.blocks.manifest(snap_a.filename).digests[1]
    path = store.blocks.block_path(damaged)
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    # A save of the same tokens with other noise is offered the damaged block: it stores its own instead.
    snap_b = store.commit(b, _save(store, b, noisy), FINGERPRINT, 64)
    assert not list(store.slot_dir.rglob(".tmp-*")) and not list(store.slot_dir.glob("*.tmp-*"))
    assert not path.exists()  # quarantined
    with store.open_whole(snap_b) as fh:
        assembled = fh.read()
    assert _regions_of(assembled, layout)[0][:, 16 * 8:32 * 8].tobytes() == \
        _regions_of(noisy, layout)[0][:, 16 * 8:32 * 8].tobytes()  # b's own bytes where a's block was damaged
    checked = store.checked_snapshot(b, FINGERPRINT)
    assert checked is not None and store.materialize(checked)
    store.restored(checked)
    # a named the damaged block: its restore fails once (a cold prefill), and it is quarantined.
    checked_a = store.checked_snapshot(a, FINGERPRINT)
    assert checked_a is not None and not store.materialize(checked_a)
    assert store.get(a) is None
    # A later save of those tokens names intact blocks only.
    store.commit(c, _save(store, c, first), FINGERPRINT, 64)
    checked_c = store.checked_snapshot(c, FINGERPRINT)
    assert checked_c is not None and store.materialize(checked_c)


def test_a_damaged_block_met_by_an_export_is_removed_so_that_the_next_save_of_its_bytes_writes_it_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault-run seed 920808289 (CI, embedded): a session moving off a backend met a damaged block while its state
    was copied out; the state went to quarantine but the block stayed, so the state the session brought back there
    later (the same bytes, so the same digest, present by its size) named it again and lost a second turn."""
    data, layout, _ = _file(64, [(1, 8)], seed=26)
    a, b = SessionKey("m", "a"), SessionKey("m", "b")
    store = _snapshot_store(tmp_path, monkeypatch, {k.file_stem(FINGERPRINT, _kind()): layout for k in (a, b)})
    snap_a = store.commit(a, _save(store, a, data), FINGERPRINT, 64)
    damaged = store.blocks.manifest(snap_a.filename).digests[1]
    path = store.blocks.block_path(damaged)
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size: present, by what a save looks at
    with pytest.raises(DamagedState):
        store.open_whole(snap_a)
    assert not path.exists()  # moved into the quarantine
    assert any(p.name.startswith(damaged) for p in (store.slot_dir / QUARANTINE_DIR).iterdir())
    # The same bytes come back (a copy of the state from another backend): the block is written again, intact.
    snap_b = store.commit(b, _save(store, b, data), FINGERPRINT, 64)
    assert path.read_bytes() == good
    checked = store.checked_snapshot(b, FINGERPRINT)
    assert checked is not None and store.materialize(checked)
    store.restored(checked)
    with store.open_whole(snap_b) as fh:
        assert fh.read() == data


def test_an_index_from_before_cuts_followed_stored_blocks_gains_their_columns_and_offers_its_old_blocks_by_none(
        tmp_path: Path) -> None:
    """Its rows stay (their blocks still dedupe by digest); only rows with a position key are offered to a save."""
    import sqlite3

    from slotkeeper.cache.index import BlockRef, SnapshotIndex

    path = tmp_path / "index.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE block_refs (filename TEXT NOT NULL, position INTEGER NOT NULL, digest TEXT NOT NULL,
            prefix TEXT, PRIMARY KEY (filename, position)) WITHOUT ROWID;
        CREATE INDEX block_refs_by_prefix ON block_refs (prefix) WHERE prefix IS NOT NULL;
        INSERT INTO block_refs (filename, position, digest, prefix) VALUES ('old.bin', 0, 'd0', 'p0');
    """)
    db.commit()
    db.close()
    index = SnapshotIndex(path)
    try:
        assert index.stored_from(["p0", "o1"]) == {}
        index.replace(SessionKey("m", "a"), SnapshotKind.SESSION, "a.bin", FINGERPRINT, 40, 1000, "c",
                      block_refs=[BlockRef("d1", "k1", 500, "o1", 16), BlockRef("d2", "k2", 300, "o2", 9),
                                  BlockRef("d3", None, 200)])
        assert index.stored_from(["o1", "o2", "o3"]) == {"o1": [StoredBlock(16, "k1", "d1")],
                                                         "o2": [StoredBlock(9, "k2", "d2")]}
        assert index.referenced(["d0", "d1", "d3", "dx"]) == {"d0", "d1", "d3"}
    finally:
        index.close()
    # The index saves no longer read (by key alone) is gone; the one they read (by position) is there.
    db = sqlite3.connect(path)
    names = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    db.close()
    assert "block_refs_by_prefix" not in names and "block_refs_by_opens" in names
