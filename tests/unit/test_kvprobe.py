"""The KV probe (cache/kvprobe.py) on synthetic slot files: types and layout are told apart exactly, values within
float noise, and a change of the values' order of magnitude (a rope base, an adapter) is another setting; the
index numbers the settings it has seen per model and layout. The probe of real servers under real settings is
tested in tests/integration/test_kv_settings.py."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from slotkeeper.cache.index import SnapshotIndex
from slotkeeper.cache.kvprobe import PROBE_TOKENS, KvProbe, probe_tokens, read_probe
from slotkeeper.upstream.launchargs import kv_arguments


def _slot_file(path: Path, values: np.ndarray, type_id: int = 1) -> Path:
    """A one-layer KV cache slot file (format v4) of PROBE_TOKENS cells holding `values` as K and V rows."""
    n = values.shape[0]
    data = values.astype("<f2") if type_id == 1 else values.astype("<f4")
    out = struct.pack("<III", 0x67677371, 4, n) + np.arange(n, dtype="<i4").tobytes()
    out += struct.pack("<II", 1, n)  # one stream, n cells
    out += b"".join(struct.pack("<iII", i, 1, 0) for i in range(n))  # pos, one seq id, seq 0
    out += struct.pack("<IIII", 0, 1, 0, 0)  # v_trans, n_layer, n_rot_k, n_rot_v
    row = data.shape[1] * data.itemsize
    out += struct.pack("<iQ", type_id, row) + data.tobytes()  # K
    out += struct.pack("<iQ", type_id, row) + data.tobytes()  # V
    path.write_bytes(out)
    return path


@pytest.fixture()
def values() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(PROBE_TOKENS, 32)).astype(np.float32)


def test_probes_of_one_setting_agree_within_float_noise_and_others_do_not(tmp_path: Path,
                                                                          values: np.ndarray) -> None:
    base = read_probe(_slot_file(tmp_path / "a.bin", values))
    assert base.layout.startswith(f"{PROBE_TOKENS}|1x64:1") and base.values.size > 0
    noisy = read_probe(_slot_file(tmp_path / "b.bin", values * (1 + 1e-3)))
    assert base.same_setting(noisy)
    rotated = values.copy()
    rotated[1:] = np.roll(values[1:], 1, axis=1)  # every position but the first changed: another rope
    assert not base.same_setting(read_probe(_slot_file(tmp_path / "c.bin", rotated)))
    other_type = read_probe(_slot_file(tmp_path / "d.bin", values, type_id=0))
    assert not base.same_setting(other_type) and "1x128:0" in other_type.layout
    assert base.same_setting(KvProbe.stored(base.layout, base.values_bytes(), base.exact))


def test_the_index_names_each_setting_once_and_alike_on_every_host(tmp_path: Path, values: np.ndarray) -> None:
    index = SnapshotIndex(tmp_path / "index.db")
    first = read_probe(_slot_file(tmp_path / "a.bin", values))
    other = read_probe(_slot_file(tmp_path / "b.bin", values * 3))
    noisy = read_probe(_slot_file(tmp_path / "c.bin", values * (1 + 1e-3)))
    a, b = index.kv_setting("model-a", first), index.kv_setting("model-a", other)
    assert a == first.name and b == other.name and a != b
    assert index.kv_setting("model-a", noisy) == a  # float noise: the setting seen before, after a restart
    index.close()
    again = SnapshotIndex(tmp_path / "index.db")
    assert again.kv_setting("model-a", other) == b
    again.close()
    # Another host (another index) whose probe is byte for byte the same names the setting alike.
    elsewhere = SnapshotIndex(tmp_path / "other.db")
    assert elsewhere.kv_setting("model-a", read_probe(_slot_file(tmp_path / "d.bin", values))) == a
    elsewhere.close()


def test_the_probe_prompt_stays_within_the_vocabulary() -> None:
    for n_vocab in (2, 582, 32000, 151936):
        tokens = probe_tokens(n_vocab)
        assert len(tokens) == PROBE_TOKENS and all(1 <= t < max(n_vocab, 2) for t in tokens)


def test_the_launch_options_that_change_the_kv_are_read_with_their_files(tmp_path: Path) -> None:
    adapter = tmp_path / "style.gguf"
    adapter.write_bytes(b"x" * 10)
    words = ["-m", "model.gguf", "-ctk", "q8_0", "--cache-type-v=q8_0", "-fa", "on", "-t", "8",
             "--rope-freq-base", "500000", "--lora-scaled", str(adapter), "0.5", "--swa-full", "-ngl", "99",
             "--control-vector-layer-range", "10", "20"]
    found = kv_arguments(words)
    assert found[:4] == ("--cache-type-k q8_0", "--cache-type-v q8_0", "--flash-attn on", "--rope-freq-base 500000")
    assert found[4].startswith(f"--lora-scaled {adapter}@10:") and found[4].endswith(" 0.5")
    assert found[5:] == ("--swa-full", "--control-vector-layer-range 10 20")
    assert kv_arguments(["-m", "model.gguf", "-t", "8", "-ngl", "99"]) == ()  # threads and offload: noise only
