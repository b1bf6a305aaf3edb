"""Helpers shared by the per-arch writers: seeded f16 random weights, f32 norms, tensors added under gguf's names
for the arch, and the attention, FFN and metadata pieces that several archs have in common."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from gguf import MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES, GGUFWriter

from slotkeeper.tinymodel.spec import TinyModelSpec, _n_embd_kv

_WEIGHT_STD = 0.02


def _normal(rng: np.random.Generator, rows: int, cols: int) -> npt.NDArray[np.float16]:
    """Numpy shape (rows, cols) is ggml ne = (cols, rows)."""
    return (rng.standard_normal((rows, cols)) * _WEIGHT_STD).astype(np.float16)


class _Tensors:
    """Adds tensors under gguf's names for the arch, refusing a tensor kind the arch does not have."""

    def __init__(self, writer: GGUFWriter, arch: str) -> None:
        self._writer = writer
        [arch_id] = [arch_id for arch_id, name in MODEL_ARCH_NAMES.items() if name == arch]
        self._kinds = frozenset(MODEL_TENSORS[arch_id])

    def add(self, kind: MODEL_TENSOR, data: npt.NDArray[np.float16] | npt.NDArray[np.float32],
            layer: int | None = None, suffix: str = "weight") -> None:
        if kind not in self._kinds:
            raise AssertionError(f"{kind.name} is not a tensor of this arch")
        name = TENSOR_NAMES[kind].format(bid=layer)
        self._writer.add_tensor(f"{name}.{suffix}" if suffix else name, data)


def _ones(n: int) -> npt.NDArray[np.float32]:
    return np.ones(n, dtype=np.float32)


def _add_ffn(out: _Tensors, rng: np.random.Generator, spec: TinyModelSpec, layer: int,
             norm: MODEL_TENSOR = MODEL_TENSOR.FFN_NORM) -> None:
    out.add(norm, _ones(spec.n_embd), layer)
    out.add(MODEL_TENSOR.FFN_GATE, _normal(rng, spec.n_ff, spec.n_embd), layer)
    out.add(MODEL_TENSOR.FFN_UP, _normal(rng, spec.n_ff, spec.n_embd), layer)
    out.add(MODEL_TENSOR.FFN_DOWN, _normal(rng, spec.n_embd, spec.n_ff), layer)


def _add_qkvo(out: _Tensors, rng: np.random.Generator, spec: TinyModelSpec, layer: int) -> None:
    out.add(MODEL_TENSOR.ATTN_Q, _normal(rng, spec.n_embd, spec.n_embd), layer)
    out.add(MODEL_TENSOR.ATTN_K, _normal(rng, _n_embd_kv(spec), spec.n_embd), layer)
    out.add(MODEL_TENSOR.ATTN_V, _normal(rng, _n_embd_kv(spec), spec.n_embd), layer)
    out.add(MODEL_TENSOR.ATTN_OUT, _normal(rng, spec.n_embd, spec.n_embd), layer)


def _add_common_keys(writer: GGUFWriter, spec: TinyModelSpec) -> None:
    writer.add_name(spec.name)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
