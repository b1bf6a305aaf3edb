"""TinyModelSpec, the shape and identity of a tiny model, with each arch's default shapes and the checks a spec
must pass; the Mamba-1 constants live here too, since the checks and the Mamba and Jamba writers share them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slotkeeper.tinymodel.templates import TEMPLATES, Template

Arch = Literal["llama", "mamba", "jamba", "lfm2", "gemma3"]
ARCHS: tuple[Arch, ...] = ("llama", "mamba", "jamba", "lfm2", "gemma3")

# Mamba-1 constants: llama.cpp only supports an expansion factor of 2 (d_inner = 2 * n_embd); the rest are the
# reference Mamba values (d_conv 4, d_state 16, dt_rank = n_embd / 16).
_MAMBA_EXPAND = 2
_MAMBA_D_CONV = 4
_MAMBA_D_STATE = 16
_MAMBA_DT_RANK_DIV = 16

# Shapes used when a TinyModelSpec leaves n_embd, n_head, n_head_kv or n_ff unset: the llama and mamba ones are the
# original defaults (the pinned files), the newer archs are smaller (about 1.5 MB).
_DEFAULT_SHAPES: dict[str, dict[str, int]] = {
    "llama": {"n_embd": 256, "n_head": 8, "n_head_kv": 4, "n_ff": 768},
    "mamba": {"n_embd": 256, "n_head": 8, "n_head_kv": 4, "n_ff": 768},
    "jamba": {"n_embd": 128, "n_head": 4, "n_head_kv": 2, "n_ff": 256},
    "lfm2": {"n_embd": 128, "n_head": 4, "n_head_kv": 2, "n_ff": 256},
    "gemma3": {"n_embd": 128, "n_head": 4, "n_head_kv": 2, "n_ff": 256},
}


@dataclass(frozen=True, init=False)
class TinyModelSpec:
    """Shape and identity of the generated model; equal specs give byte-identical files.

    n_embd, n_head, n_head_kv and n_ff left as None take the arch's defaults: 256/8/4/768 for llama and mamba (the
    original model), 128/4/2/256 for jamba, lfm2 and gemma3. ``arch="mamba"`` uses n_embd, n_layer, context_length,
    seed and name, and ignores n_head, n_head_kv and n_ff. jamba and lfm2 put attention on the odd layers and their
    Mamba or short-convolution layers on the even ones; gemma3 makes the even layers sliding-window (window 64) and
    the odd ones global. These three need n_layer >= 2. An empty name becomes ``tiny-random-<arch>``.

    ``template`` picks the chat template: ``chatml``, or ``qwen3`` (which also adds the ``<think>``, ``</think>``,
    ``<tool_call>`` and ``</tool_call>`` tokens to the vocab). ``fim=True`` adds the fill-in-the-middle tokens
    (``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>``, ``<|repo_name|>``, ``<|file_sep|>``) at the end
    of the vocab, which llama-server's ``/infill`` needs; without it the file is what it always was.
    """

    arch: Arch
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    context_length: int
    seed: int
    name: str
    template: Template
    fim: bool

    def __init__(self, arch: Arch = "llama", n_embd: int | None = None, n_layer: int = 4, n_head: int | None = None,
                 n_head_kv: int | None = None, n_ff: int | None = None, context_length: int = 32768,
                 seed: int = 1234, name: str = "", template: Template = "chatml", fim: bool = False) -> None:
        shape = _DEFAULT_SHAPES.get(arch, _DEFAULT_SHAPES["llama"])
        values = {
            "arch": arch,
            "n_embd": shape["n_embd"] if n_embd is None else n_embd,
            "n_layer": n_layer,
            "n_head": shape["n_head"] if n_head is None else n_head,
            "n_head_kv": shape["n_head_kv"] if n_head_kv is None else n_head_kv,
            "n_ff": shape["n_ff"] if n_ff is None else n_ff,
            "context_length": context_length,
            "seed": seed,
            "name": name or f"tiny-random-{arch}",
            "template": template,
            "fim": fim,
        }
        for field, value in values.items():
            object.__setattr__(self, field, value)


def _validate(spec: TinyModelSpec) -> None:
    if spec.arch not in ARCHS:
        raise ValueError(f"unsupported arch {spec.arch!r}: one of {', '.join(ARCHS)}")
    if spec.template not in TEMPLATES:
        raise ValueError(f"unsupported template {spec.template!r}: one of {', '.join(TEMPLATES)}")
    for field in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "context_length"):
        value = getattr(spec, field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"TinyModelSpec.{field} must be a positive int, got {value!r}")
    if isinstance(spec.seed, bool) or not isinstance(spec.seed, int) or spec.seed < 0:
        raise ValueError(f"TinyModelSpec.seed must be a non-negative int, got {spec.seed!r}")
    if not isinstance(spec.fim, bool):
        raise ValueError(f"TinyModelSpec.fim must be a bool, got {spec.fim!r}")
    if not isinstance(spec.name, str) or not spec.name:
        raise ValueError("TinyModelSpec.name must be a non-empty string")
    if spec.arch in ("mamba", "jamba") and spec.n_embd % _MAMBA_DT_RANK_DIV != 0:
        raise ValueError(f"{spec.arch}: n_embd ({spec.n_embd}) must be divisible by {_MAMBA_DT_RANK_DIV}")
    if spec.arch in ("jamba", "lfm2", "gemma3") and spec.n_layer < 2:
        raise ValueError(f"{spec.arch}: n_layer must be at least 2 (both kinds of layer), got {spec.n_layer}")
    if spec.arch == "mamba":
        return
    if spec.n_embd % spec.n_head != 0:
        raise ValueError(f"n_embd ({spec.n_embd}) must be divisible by n_head ({spec.n_head})")
    if spec.n_head % spec.n_head_kv != 0:
        raise ValueError(f"n_head ({spec.n_head}) must be divisible by n_head_kv ({spec.n_head_kv})")


def _head_dim(spec: TinyModelSpec) -> int:
    return spec.n_embd // spec.n_head


def _n_embd_kv(spec: TinyModelSpec) -> int:
    return spec.n_head_kv * _head_dim(spec)
