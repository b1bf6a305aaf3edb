"""The slot-file layout parser on files the real servers write: every tiny-model architecture on the llama-server
binary (b11434) and the embedded xllamacpp server (b11549, which appends context checkpoints), and on the binary
the llama model with flash attention off (V stored transposed) and with a q8_0 KV cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from slotkeeper.cache.blocks import meta_matches
from slotkeeper.cache.blockstore import BlockStore
from slotkeeper.cache.capability import has_checkpoint_appendix
from slotkeeper.cache.slotformat import SlotLayout, TokenRegion, parse_layout
from slotkeeper.cache.tokens import read_tokens
from slotkeeper.tinymodel import ARCHS, TinyModelSpec, write_tiny_model
from tests.conftest import BACKEND_KINDS
from tests.support import Backend

pytestmark = pytest.mark.backend

# About 400 tokens with the tiny model's tokenizer: past gemma3's 64-token sliding window.
PROMPT = " ".join(f"w{i} apple" for i in range(60))
# Regions per architecture: 4 attention layers of llama (K and V each), 2 of jamba, lfm2 and gemma3 (gemma3's other
# 2 are sliding-window layers, whose cache holds only the window and is left out), none for mamba.
EXPECTED_REGIONS = {"llama": 8, "mamba": 0, "jamba": 4, "lfm2": 4, "gemma3": 4}


@pytest.fixture(scope="module", params=BACKEND_KINDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("slotformat-models")
    out = {}
    for arch in ARCHS:
        out[arch] = folder / f"tiny-{arch}.gguf"
        write_tiny_model(out[arch], TinyModelSpec(arch=arch))
    return out


def save(kind: str, model: Path, folder: Path, *extra: str) -> tuple[Path, int]:
    """One chat on a fresh server, then slot 0 saved: the file (copied out) and n_saved."""
    folder.mkdir(parents=True, exist_ok=True)
    backend = Backend(kind, model, folder / "slots", folder / "backend.log", ctx_per_slot=4096, cache_ram=0,
                      extra_args=tuple(extra))
    try:
        backend.start()
        with httpx.Client(base_url=backend.url, timeout=60) as client:
            response = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0})
            assert response.status_code == 200, response.text
            saved = client.post("/slots/0?action=save", json={"filename": "x.bin"})
            assert saved.status_code == 200, saved.text
    finally:
        backend.stop()
    path = folder / "x.bin"
    shutil.copy(folder / "slots" / "x.bin", path)
    n_saved: int = saved.json()["n_saved"]
    return path, n_saved


@pytest.fixture(scope="module")
def saves(backend_kind: str, models: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    folder = tmp_path_factory.mktemp(f"slotformat-{backend_kind}")
    return {arch: save(backend_kind, model, folder / arch) for arch, model in models.items()}


def check_regions(path: Path, layout: SlotLayout) -> None:
    """In the file, in file order and disjoint."""
    end = 0
    for region in layout.regions:
        assert region.offset >= end
        end = region.offset + region.n_outer * layout.n_cells * region.cell_bytes
    assert end <= layout.file_size == path.stat().st_size


@pytest.mark.parametrize("arch", ARCHS)
def test_regions_per_arch(backend_kind: str, saves: dict[str, tuple[Path, int]], arch: str, tmp_path: Path) -> None:
    path, n_saved = saves[arch]
    tokens = read_tokens(path)
    assert tokens is not None and tokens.size == n_saved > 300
    # b11549 appends its checkpoints for every model that needs them; b11434 writes none.
    assert has_checkpoint_appendix(path) == (backend_kind == "embedded" and arch != "llama")
    layout = parse_layout(path)
    if EXPECTED_REGIONS[arch] == 0:
        assert layout is None  # a pure recurrent model keeps no per-token state
        return
    assert layout is not None
    assert layout.n_cells == n_saved  # every token in the list has its cell (the last sampled one is in neither)
    assert len(layout.regions) == EXPECTED_REGIONS[arch]
    # f16 K and V rows of 2 heads of 64 (llama) or 32 (the others), flash attention on by default.
    row = 256 if arch == "llama" else 128
    assert [(r.n_outer, r.cell_bytes) for r in layout.regions] == [(1, row)] * EXPECTED_REGIONS[arch]
    check_regions(path, layout)
    # One attention section is cut (gemma3's sliding window is not): its cell metadata says positions alone.
    assert len(layout.meta) == 1
    cut_and_assemble(path, tmp_path)


def cut_and_assemble(path: Path, folder: Path) -> None:
    """Through the block store: every cell in blocks, the cell metadata written by the assembly, the rest in the
    tail; the assembled file is the saved one byte for byte."""
    layout = parse_layout(path)
    tokens = read_tokens(path)
    assert layout is not None and tokens is not None
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    assert all(meta_matches(data, layout, m) for m in layout.meta)
    store = BlockStore(folder / "store", 64)
    store.slot_dir.mkdir(parents=True, exist_ok=True)
    split = store.split(path, "x.bin", tokens, "fingerprint", prompt_end=int(tokens.size) - 3)
    assert split is not None and split.exact and split.cut.covered == layout.n_cells
    assert split.cut.layout.meta == layout.meta
    store.assemble("x.bin", folder / "assembled.bin")
    assert (folder / "assembled.bin").read_bytes() == path.read_bytes()


def region_array(path: Path, layout: SlotLayout, region: TokenRegion) -> np.ndarray:
    """An f16 region as [cell][element], whether stored by rows or transposed."""
    count = region.n_outer * layout.n_cells * region.cell_bytes
    raw = np.frombuffer(path.read_bytes(), dtype=np.uint8, count=count, offset=region.offset).view("<f2")
    return raw.reshape(layout.n_cells, -1) if region.n_outer == 1 else raw.reshape(region.n_outer, -1).T


def test_binary_v_transposed_and_quantized(backend_kind: str, saves: dict[str, tuple[Path, int]],
                                          models: dict[str, Path], tmp_path: Path) -> None:
    if backend_kind != "binary":
        pytest.skip("the binary takes llama-server options")
    on_path, n_saved = saves["llama"]
    on = parse_layout(on_path)
    off_path, off_saved = save("binary", models["llama"], tmp_path / "fa-off", "-fa", "off")
    off = parse_layout(off_path)
    assert on is not None and off is not None and off_saved == n_saved == off.n_cells
    assert [(r.n_outer, r.cell_bytes) for r in off.regions] == [(1, 256)] * 4 + [(128, 2)] * 4
    check_regions(off_path, off)
    cut_and_assemble(off_path, tmp_path / "fa-off-store")
    # The same prompt: the first layer's K and V do not depend on the attention kernel, so V read back from its
    # transposed runs equals V read from rows; later layers differ only by the kernels' rounding.
    for index, (a, b) in enumerate(zip(on.regions, off.regions, strict=True)):
        x, y = region_array(on_path, on, a), region_array(off_path, off, b)
        if index in (0, 4):
            assert np.array_equal(x, y)
        assert float(np.abs(x.astype(np.float32) - y.astype(np.float32)).max()) < 0.1

    q8_path, q8_saved = save("binary", models["llama"], tmp_path / "q8", "--cache-type-k", "q8_0",
                             "--cache-type-v", "q8_0", "-fa", "on")
    q8 = parse_layout(q8_path)
    assert q8 is not None and q8.n_cells == q8_saved
    # 128 elements of q8_0: 4 blocks of 34 bytes.
    assert [(r.n_outer, r.cell_bytes) for r in q8.regions] == [(1, 136)] * 8
    check_regions(q8_path, q8)
    cut_and_assemble(q8_path, tmp_path / "q8-store")
