"""Writers of the attention-only archs: llama (plain KV cache, the default and pinned model) and gemma3 (sliding
window attention on the even layers, global attention on the odd ones)."""

from __future__ import annotations

import numpy as np
from gguf import MODEL_TENSOR, GGUFWriter, LlamaFileType

from slotkeeper.tinymodel.spec import TinyModelSpec, _head_dim
from slotkeeper.tinymodel.tensors import _add_common_keys, _add_ffn, _add_qkvo, _normal, _ones, _Tensors
from slotkeeper.tinymodel.vocab import _add_vocab, _Vocab

_GEMMA3_SLIDING_WINDOW = 64
_GEMMA3_SWA_PATTERN = 2


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
    _add_vocab(writer, vocab, spec.template)

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


def _populate_gemma3(writer: GGUFWriter, spec: TinyModelSpec, vocab: _Vocab) -> None:
    """Gemma3: llama's layer plus q/k RMS norms {head_dim}, post_attention_norm and post_ffw_norm; sliding window 64
    on the even layers (pattern 2), global attention on the odd ones."""
    n_vocab = len(vocab.tokens)

    _add_common_keys(writer, spec)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_key_length(_head_dim(spec))
    writer.add_value_length(_head_dim(spec))
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(_GEMMA3_SLIDING_WINDOW)
    writer.add_sliding_window_pattern(_GEMMA3_SWA_PATTERN)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(int(LlamaFileType.MOSTLY_F16))
    _add_vocab(writer, vocab, spec.template)

    rng = np.random.default_rng(spec.seed)
    out = _Tensors(writer, spec.arch)
    out.add(MODEL_TENSOR.TOKEN_EMBD, _normal(rng, n_vocab, spec.n_embd))
    out.add(MODEL_TENSOR.OUTPUT_NORM, _ones(spec.n_embd))
    for layer in range(spec.n_layer):
        out.add(MODEL_TENSOR.ATTN_NORM, _ones(spec.n_embd), layer)
        out.add(MODEL_TENSOR.ATTN_Q_NORM, _ones(_head_dim(spec)), layer)
        out.add(MODEL_TENSOR.ATTN_K_NORM, _ones(_head_dim(spec)), layer)
        _add_qkvo(out, rng, spec, layer)
        out.add(MODEL_TENSOR.ATTN_POST_NORM, _ones(spec.n_embd), layer)
        _add_ffn(out, rng, spec, layer, MODEL_TENSOR.FFN_PRE_NORM)  # gguf's name for gemma's blk.N.ffn_norm
        out.add(MODEL_TENSOR.FFN_POST_NORM, _ones(spec.n_embd), layer)
