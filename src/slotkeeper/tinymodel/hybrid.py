"""Writers of the hybrid archs, attention on the odd layers and a recurrent kind on the even ones: jamba (Mamba-1
layers) and lfm2 (gated short-convolution layers, attention with q/k norms)."""

from __future__ import annotations

import numpy as np
from gguf import MODEL_TENSOR, GGUFWriter, LlamaFileType

from slotkeeper.tinymodel.spec import (
    _MAMBA_D_CONV,
    _MAMBA_D_STATE,
    _MAMBA_DT_RANK_DIV,
    _MAMBA_EXPAND,
    TinyModelSpec,
    _head_dim,
)
from slotkeeper.tinymodel.tensors import _add_common_keys, _add_ffn, _add_qkvo, _normal, _ones, _Tensors
from slotkeeper.tinymodel.vocab import _add_vocab, _Vocab

_LFM2_L_CACHE = 3  # the short convolution's kernel length (LFM2's own value); llama.cpp needs > 1


def _is_attention_layer(layer: int) -> bool:
    """jamba and lfm2: attention on the odd layers, the recurrent kind (Mamba, short convolution) on the even ones."""
    return layer % 2 == 1


def _populate_jamba(writer: GGUFWriter, spec: TinyModelSpec, vocab: _Vocab) -> None:
    """Jamba: the Mamba-1 layer of the mamba variant plus dt/B/C norms, llama attention (no rope, no q/k norms) on
    the odd layers, an FFN on every layer. head_count_kv is a per-layer array whose 0 marks a Mamba layer. ggml ne:
    ssm_dt_norm {dt_rank}, ssm_b_norm and ssm_c_norm {d_state}, the rest as in the mamba variant."""
    n_vocab = len(vocab.tokens)
    d_inner = _MAMBA_EXPAND * spec.n_embd
    dt_rank = spec.n_embd // _MAMBA_DT_RANK_DIV

    _add_common_keys(writer, spec)
    writer.add_head_count_kv([spec.n_head_kv if _is_attention_layer(i) else 0 for i in range(spec.n_layer)])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_ssm_conv_kernel(_MAMBA_D_CONV)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(_MAMBA_D_STATE)
    writer.add_ssm_time_step_rank(dt_rank)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(int(LlamaFileType.MOSTLY_F16))
    _add_vocab(writer, vocab, spec.template)

    rng = np.random.default_rng(spec.seed)
    out = _Tensors(writer, spec.arch)
    ssm_a = -np.tile(np.arange(1, _MAMBA_D_STATE + 1, dtype=np.float32), (d_inner, 1))
    out.add(MODEL_TENSOR.TOKEN_EMBD, _normal(rng, n_vocab, spec.n_embd))
    out.add(MODEL_TENSOR.OUTPUT_NORM, _ones(spec.n_embd))
    for layer in range(spec.n_layer):
        out.add(MODEL_TENSOR.ATTN_NORM, _ones(spec.n_embd), layer)
        if _is_attention_layer(layer):
            _add_qkvo(out, rng, spec, layer)
        else:
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), d_inner))
            dt_bias = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
            conv = (rng.standard_normal((d_inner, _MAMBA_D_CONV)) * 0.5).astype(np.float32)
            out.add(MODEL_TENSOR.SSM_IN, _normal(rng, 2 * d_inner, spec.n_embd), layer)
            out.add(MODEL_TENSOR.SSM_CONV1D, conv, layer)
            out.add(MODEL_TENSOR.SSM_CONV1D, np.zeros(d_inner, dtype=np.float32), layer, "bias")
            out.add(MODEL_TENSOR.SSM_X, _normal(rng, dt_rank + 2 * _MAMBA_D_STATE, d_inner), layer)
            out.add(MODEL_TENSOR.SSM_DT_NORM, _ones(dt_rank), layer)
            out.add(MODEL_TENSOR.SSM_DT, _normal(rng, d_inner, dt_rank), layer)
            out.add(MODEL_TENSOR.SSM_DT, dt_bias, layer, "bias")
            out.add(MODEL_TENSOR.SSM_B_NORM, _ones(_MAMBA_D_STATE), layer)
            out.add(MODEL_TENSOR.SSM_C_NORM, _ones(_MAMBA_D_STATE), layer)
            out.add(MODEL_TENSOR.SSM_A, ssm_a.copy(), layer, "")
            out.add(MODEL_TENSOR.SSM_D, np.ones(d_inner, dtype=np.float32), layer, "")
            out.add(MODEL_TENSOR.SSM_OUT, _normal(rng, spec.n_embd, d_inner), layer)
        _add_ffn(out, rng, spec, layer)


def _populate_lfm2(writer: GGUFWriter, spec: TinyModelSpec, vocab: _Vocab) -> None:
    """LFM2: gated short-convolution layers (ggml ne: shortconv.conv {l_cache, n_embd} f32, shortconv.in_proj
    {n_embd, 3*n_embd}, shortconv.out_proj {n_embd, n_embd}) and, on the odd layers, attention with q/k RMS norms
    {head_dim} (NEOX rope); an FFN on every layer; the output norm is named token_embd_norm. head_count_kv is a
    per-layer array whose 0 marks a convolution layer. No sliding window."""
    n_vocab = len(vocab.tokens)

    _add_common_keys(writer, spec)
    writer.add_head_count_kv([spec.n_head_kv if _is_attention_layer(i) else 0 for i in range(spec.n_layer)])
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_shortconv_l_cache(_LFM2_L_CACHE)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(int(LlamaFileType.MOSTLY_F16))
    _add_vocab(writer, vocab, spec.template)

    rng = np.random.default_rng(spec.seed)
    out = _Tensors(writer, spec.arch)
    out.add(MODEL_TENSOR.TOKEN_EMBD, _normal(rng, n_vocab, spec.n_embd))
    out.add(MODEL_TENSOR.TOKEN_EMBD_NORM, _ones(spec.n_embd))
    for layer in range(spec.n_layer):
        out.add(MODEL_TENSOR.ATTN_NORM, _ones(spec.n_embd), layer)
        if _is_attention_layer(layer):
            out.add(MODEL_TENSOR.ATTN_Q_NORM, _ones(_head_dim(spec)), layer)
            out.add(MODEL_TENSOR.ATTN_K_NORM, _ones(_head_dim(spec)), layer)
            _add_qkvo(out, rng, spec, layer)
        else:
            conv = (rng.standard_normal((spec.n_embd, _LFM2_L_CACHE)) * 0.5).astype(np.float32)
            out.add(MODEL_TENSOR.SHORTCONV_CONV, conv, layer)
            out.add(MODEL_TENSOR.SHORTCONV_INPROJ, _normal(rng, 3 * spec.n_embd, spec.n_embd), layer)
            out.add(MODEL_TENSOR.SHORTCONV_OUTPROJ, _normal(rng, spec.n_embd, spec.n_embd), layer)
        _add_ffn(out, rng, spec, layer)
