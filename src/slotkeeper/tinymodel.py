"""Deterministic generator of a tiny random-weight GGUF (llama, or recurrent Mamba-1) with a synthetic
SentencePiece-style vocab.

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

# Mamba-1 constants: llama.cpp only supports an expansion factor of 2 (d_inner = 2 * n_embd); the rest are the
# reference Mamba values (d_conv 4, d_state 16, dt_rank = n_embd / 16).
_MAMBA_EXPAND = 2
_MAMBA_D_CONV = 4
_MAMBA_D_STATE = 16
_MAMBA_DT_RANK_DIV = 16

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
    """Shape and identity of the generated model; equal specs give byte-identical files.

    ``arch="mamba"`` writes a recurrent Mamba-1 model instead: it uses n_embd, n_layer, context_length, seed and
    name, and ignores n_head, n_head_kv and n_ff. An empty name becomes ``tiny-random-<arch>``.
    """

    arch: Literal["llama", "mamba"] = "llama"
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 8
    n_head_kv: int = 4
    n_ff: int = 768
    context_length: int = 32768
    seed: int = 1234
    name: str = ""

    def __post_init__(self) -> None:
        if self.name == "":
            object.__setattr__(self, "name", f"tiny-random-{self.arch}")


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
    if spec.arch not in ("llama", "mamba"):
        raise ValueError(f"unsupported arch {spec.arch!r}: only 'llama' and 'mamba' are supported")
    for field in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "context_length"):
        value = getattr(spec, field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"TinyModelSpec.{field} must be a positive int, got {value!r}")
    if isinstance(spec.seed, bool) or not isinstance(spec.seed, int) or spec.seed < 0:
        raise ValueError(f"TinyModelSpec.seed must be a non-negative int, got {spec.seed!r}")
    if not isinstance(spec.name, str) or not spec.name:
        raise ValueError("TinyModelSpec.name must be a non-empty string")
    if spec.arch == "mamba":
        if spec.n_embd % _MAMBA_DT_RANK_DIV != 0:
            raise ValueError(f"mamba: n_embd ({spec.n_embd}) must be divisible by {_MAMBA_DT_RANK_DIV}")
        return
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


def _add_vocab(writer: GGUFWriter, vocab: _Vocab) -> None:
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


def _populate(writer: GGUFWriter, spec: TinyModelSpec, vocab: _Vocab) -> None:
    if spec.arch == "mamba":
        _populate_mamba(writer, spec, vocab)
    else:
        _populate_llama(writer, spec, vocab)


def _populate_llama(writer: GGUFWriter, spec: TinyModelSpec, vocab: _Vocab) -> None:
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
    _add_vocab(writer, vocab)

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


def _populate_mamba(writer: GGUFWriter, spec: TinyModelSpec, vocab: _Vocab) -> None:
    """Mamba-1 as llama.cpp loads it. ggml ne (llama.cpp's create_tensor dims) is the numpy shape reversed:

    ssm_in (2*d_inner, n_embd), ssm_conv1d.weight (d_inner, d_conv), ssm_x (dt_rank + 2*d_state, d_inner),
    ssm_dt.weight (d_inner, dt_rank), ssm_a (d_inner, d_state), ssm_d (d_inner,), ssm_out (n_embd, d_inner).
    The conv kernel, A and D, norms and biases stay f32 (ggml's ssm_conv and ssm_scan need f32); no output.weight,
    so the output projection is tied to token_embd as in the llama variant.
    """
    n_vocab = len(vocab.tokens)
    d_inner = _MAMBA_EXPAND * spec.n_embd
    dt_rank = spec.n_embd // _MAMBA_DT_RANK_DIV

    writer.add_name(spec.name)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_ssm_conv_kernel(_MAMBA_D_CONV)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(_MAMBA_D_STATE)
    writer.add_ssm_time_step_rank(dt_rank)
    writer.add_ssm_dt_b_c_rms(False)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(int(LlamaFileType.MOSTLY_F16))
    _add_vocab(writer, vocab)

    rng = np.random.default_rng(spec.seed)
    ones = np.ones(spec.n_embd, dtype=np.float32)
    # A = -exp(A_log) with the reference init A_log = log(1..d_state) for every channel; D = 1.
    ssm_a = -np.tile(np.arange(1, _MAMBA_D_STATE + 1, dtype=np.float32), (d_inner, 1))
    ssm_d = np.ones(d_inner, dtype=np.float32)
    writer.add_tensor("token_embd.weight", _normal(rng, n_vocab, spec.n_embd))
    writer.add_tensor("output_norm.weight", ones.copy())
    for layer in range(spec.n_layer):
        prefix = f"blk.{layer}"
        # dt = softplus(bias) lands log-uniformly in [1e-3, 1e-1] as in the reference init.
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), d_inner))
        dt_bias = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
        writer.add_tensor(f"{prefix}.attn_norm.weight", ones.copy())
        writer.add_tensor(f"{prefix}.ssm_in.weight", _normal(rng, 2 * d_inner, spec.n_embd))
        conv = (rng.standard_normal((d_inner, _MAMBA_D_CONV)) * 0.5).astype(np.float32)
        writer.add_tensor(f"{prefix}.ssm_conv1d.weight", conv)
        writer.add_tensor(f"{prefix}.ssm_conv1d.bias", np.zeros(d_inner, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ssm_x.weight", _normal(rng, dt_rank + 2 * _MAMBA_D_STATE, d_inner))
        writer.add_tensor(f"{prefix}.ssm_dt.weight", _normal(rng, d_inner, dt_rank))
        writer.add_tensor(f"{prefix}.ssm_dt.bias", dt_bias)
        writer.add_tensor(f"{prefix}.ssm_a", ssm_a.copy())
        writer.add_tensor(f"{prefix}.ssm_d", ssm_d.copy())
        writer.add_tensor(f"{prefix}.ssm_out.weight", _normal(rng, spec.n_embd, d_inner))


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
