"""Deterministic generator of a tiny random-weight llama GGUF with a synthetic SentencePiece-style vocab.

It gives tests a real model file that llama.cpp's server loads and chats with, built offline in a second or two.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from gguf import GGUFWriter, LlamaFileType, TokenType

__all__ = ["CHATML_TEMPLATE", "IM_END", "IM_START", "TinyModelSpec", "write_tiny_model"]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_SPACE = "\u2581"  # SentencePiece's visible word-boundary marker
_WEIGHT_STD = 0.02

# Common words; each becomes "▁word" plus every "▁" prefix of it, so SentencePiece-style bigram merging,
# which only joins pairs already in the vocab, can build the whole word one character at a time.
_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if "
    "will up other about out many then them these so some her would make like him into time has look two "
    "more write go see number no way could people my than first water been call who now find long down "
    "day did get come made may part hello hi user assistant system yes please thanks model test token "
    "slot server"
)
_WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
_SINGLE_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\":;-()"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and identity of the generated model; equal specs give byte-identical files."""

    arch: Literal["llama"] = "llama"
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 8
    n_head_kv: int = 4
    n_ff: int = 768
    context_length: int = 32768
    seed: int = 1234
    name: str = "tiny-random-llama"


@dataclass(frozen=True)
class _Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int
    unk_id: int
    im_start_id: int
    im_end_id: int


def _validate(spec: TinyModelSpec) -> None:
    if spec.arch != "llama":
        raise ValueError(f"unsupported arch {spec.arch!r}: only 'llama' is supported")
    for field in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "context_length"):
        value = getattr(spec, field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"TinyModelSpec.{field} must be a positive int, got {value!r}")
    if isinstance(spec.seed, bool) or not isinstance(spec.seed, int) or spec.seed < 0:
        raise ValueError(f"TinyModelSpec.seed must be a non-negative int, got {spec.seed!r}")
    if not spec.name:
        raise ValueError("TinyModelSpec.name must be a non-empty string")
    if spec.n_embd % spec.n_head != 0:
        raise ValueError(f"n_embd ({spec.n_embd}) must be divisible by n_head ({spec.n_head})")
    if spec.n_head % spec.n_head_kv != 0:
        raise ValueError(f"n_head ({spec.n_head}) must be divisible by n_head_kv ({spec.n_head_kv})")


def _build_vocab() -> _Vocab:
    """Build the synthetic vocab: specials, 256 byte tokens, normal pieces, then the ChatML control tokens."""
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    scores: list[float] = [0.0, 0.0, 0.0]
    types: list[int] = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)]

    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        scores.append(0.0)
        types.append(int(TokenType.BYTE))

    pieces: list[str] = [_SPACE]
    for word in _WORDS:
        pieces.extend(_SPACE + word[:end] for end in range(1, len(word) + 1))
    pieces.extend(_SINGLE_CHARS)
    seen: set[str] = set()
    rank = 0
    for piece in pieces:
        if piece in seen:
            continue
        seen.add(piece)
        rank += 1
        tokens.append(piece)
        scores.append(-float(rank))
        types.append(int(TokenType.NORMAL))

    im_start_id = len(tokens)
    im_end_id = im_start_id + 1
    for special in (IM_START, IM_END):
        tokens.append(special)
        scores.append(0.0)
        types.append(int(TokenType.CONTROL))

    return _Vocab(tokens, scores, types, bos_id=1, unk_id=0, im_start_id=im_start_id, im_end_id=im_end_id)


def _normal(rng: np.random.Generator, rows: int, cols: int) -> npt.NDArray[np.float16]:
    """Numpy shape (rows, cols) is ggml ne = (cols, rows)."""
    return (rng.standard_normal((rows, cols)) * _WEIGHT_STD).astype(np.float16)


def _populate(writer: GGUFWriter, spec: TinyModelSpec, vocab: _Vocab) -> None:
    head_dim = spec.n_embd // spec.n_head
    n_embd_kv = spec.n_head_kv * head_dim
    n_vocab = len(vocab.tokens)

    writer.add_name(spec.name)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(int(LlamaFileType.MOSTLY_F16))

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.im_end_id)
    writer.add_unk_token_id(vocab.unk_id)
    writer.add_eot_token_id(vocab.im_end_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    rng = np.random.default_rng(spec.seed)
    ones = np.ones(spec.n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", _normal(rng, n_vocab, spec.n_embd))
    writer.add_tensor("output_norm.weight", ones.copy())
    for layer in range(spec.n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", ones.copy())
        writer.add_tensor(f"{prefix}.attn_q.weight", _normal(rng, spec.n_embd, spec.n_embd))
        writer.add_tensor(f"{prefix}.attn_k.weight", _normal(rng, n_embd_kv, spec.n_embd))
        writer.add_tensor(f"{prefix}.attn_v.weight", _normal(rng, n_embd_kv, spec.n_embd))
        writer.add_tensor(f"{prefix}.attn_output.weight", _normal(rng, spec.n_embd, spec.n_embd))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", ones.copy())
        writer.add_tensor(f"{prefix}.ffn_gate.weight", _normal(rng, spec.n_ff, spec.n_embd))
        writer.add_tensor(f"{prefix}.ffn_up.weight", _normal(rng, spec.n_ff, spec.n_embd))
        writer.add_tensor(f"{prefix}.ffn_down.weight", _normal(rng, spec.n_embd, spec.n_ff))


def _fsync_dir(directory: pathlib.Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_tiny_model(path: pathlib.Path, spec: TinyModelSpec = TinyModelSpec()) -> int:
    """Write the model for ``spec`` to ``path`` atomically and return the number of bytes written."""
    _validate(spec)
    path = pathlib.Path(path)
    directory = path.parent
    vocab = _build_vocab()

    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    tmp = pathlib.Path(tmp_name)
    try:
        writer = GGUFWriter(tmp, arch=spec.arch)
        try:
            _populate(writer, spec, vocab)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
            size = os.fstat(fh.fileno()).st_size
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(directory)
    return size
