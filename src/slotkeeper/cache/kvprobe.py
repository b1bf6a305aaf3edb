"""What a backend's KV looks like for one fixed prompt: the part of the fingerprint no setting we can read gives.

A saved state is valid only where every input of its KV bytes is the same (model, build, K/V types and V's layout,
rope and YaRN, LoRA adapters and their scales, control vectors, ...). slotkeeper reads what it can (the launch
command, `/lora-adapters`, the slot file's own header), but an attached llama-server's rope or control vectors are
not reported anywhere. So at start, and after the backend restarts, the backend prefills the same short prompt into
a slot and saves it; the probe is that file's K and V: the ggml types and shape of every tensor exactly, and a
sample of the values decoded to floats, compared within float noise (another thread count may round otherwise).
Two probes that agree are one KV setting; a probe that agrees with none seen before under the same model and
layout is a new one, named by a digest of its bytes, and the fingerprint takes the setting's name (index.py keeps the
probes). A name from the bytes, not a count, so that two backends or hosts whose probes are alike byte for byte (the
same build on the same kind of machine) name the setting alike and share what they save.

Pure: parsing the probe's file and comparing two probes; the requests that make it are discovery's (backend.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from slotkeeper.cache.slotformat import parse_layout

# Prompt length and how many values of each tensor are kept (a 16-token prompt of an 80-layer model: 160 tensors).
PROBE_TOKENS = 16
_SAMPLES_PER_TENSOR = 256
# Relative distance (L2 of the difference over L2 of the values) below which two probes are one setting: float
# noise between thread counts is about 1e-3 for f16; a changed rope base, adapter or type is of order 1.
SAME_WITHIN = 0.01
# ggml types decoded to floats; others are compared byte for byte (a quantized KV: noise there costs a prefill).
_F32, _F16, _BF16 = 0, 1, 30
_HEADER = struct.Struct("<III")


def probe_tokens(n_vocab: int) -> list[int]:
    """The probe's prompt: fixed token ids spread over the vocabulary (never 0, often a special token)."""
    span = max(n_vocab - 1, 1)
    return [1 + (i * 7919 + 104729) % span for i in range(PROBE_TOKENS)]


@dataclass(frozen=True, slots=True)
class KvProbe:
    """The probe of one backend: `layout` (each tensor's runs, bytes per cell and ggml type: exact), `values`
    (sampled floats of the tensors of a float type) and `exact` (a hash of every other byte that holds KV)."""

    layout: str
    values: np.ndarray
    exact: str

    def same_setting(self, other: KvProbe) -> bool:
        if self.layout != other.layout or self.exact != other.exact or self.values.shape != other.values.shape:
            return False
        if not self.values.size:
            return True
        scale = float(np.linalg.norm(self.values)) or 1.0
        return float(np.linalg.norm(self.values - other.values)) / scale < SAME_WITHIN

    def values_bytes(self) -> bytes:
        return self.values.astype("<f4").tobytes()

    @property
    def name(self) -> str:
        """The setting's name when this probe is the first of it: 16 hex digits of its bytes."""
        return xxhash.xxh3_128_hexdigest(f"{self.layout}|{self.exact}|".encode() + self.values_bytes())[:16]

    @classmethod
    def stored(cls, layout: str, values: bytes, exact: str) -> KvProbe:
        return cls(layout, np.frombuffer(values, dtype="<f4").copy(), exact)


def read_probe(path: Path) -> KvProbe:
    """The probe of a slot file the backend saved after prefilling `probe_tokens`. A file whose attention KV this
    code cannot place (a recurrent model's state) is taken as floats where it can be (recurrent states are f32) after
    its token list."""
    data = np.fromfile(path, dtype=np.uint8)
    layout = parse_layout(path)
    if layout is None or not layout.regions:
        _, _, n_words = _HEADER.unpack_from(data.tobytes()[:12])
        state = data[12 + 4 * n_words:]
        usable = state[:state.size - state.size % 4]
        return KvProbe(f"whole:{state.size}", _sample(usable.view("<f4")), "")
    shapes, samples, exact = [], [], xxhash.xxh3_128()
    for region in layout.regions:
        shapes.append(f"{region.n_outer}x{region.cell_bytes}:{region.type_id}")
        size = region.n_outer * layout.n_cells * region.cell_bytes
        raw = data[region.offset:region.offset + size]
        decoded = _decode(raw, region.type_id)
        if decoded is None:
            exact.update(raw.tobytes())
        else:
            samples.append(_sample(decoded))
    values = np.concatenate(samples) if samples else np.zeros(0, dtype=np.float32)
    return KvProbe(f"{layout.n_cells}|" + ";".join(shapes), values, exact.hexdigest())


def _decode(raw: np.ndarray, type_id: int) -> np.ndarray | None:
    if type_id == _F32 and raw.size % 4 == 0:
        return raw.view("<f4").astype(np.float32)
    if type_id == _F16 and raw.size % 2 == 0:
        return raw.view("<f2").astype(np.float32)
    if type_id == _BF16 and raw.size % 2 == 0:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return None


def _sample(values: np.ndarray) -> np.ndarray:
    """At most _SAMPLES_PER_TENSOR values, evenly spread (every cell and run of a small tensor)."""
    values = np.nan_to_num(values.astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    if values.size <= _SAMPLES_PER_TENSOR:
        return values
    return values[np.linspace(0, values.size - 1, _SAMPLES_PER_TENSOR).astype(np.int64)]
