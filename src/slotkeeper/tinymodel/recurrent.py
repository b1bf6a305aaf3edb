"""Writer of the recurrent arch: Mamba-1, whose context llama.cpp keeps as a fixed-size state with context
checkpoints instead of a KV cache."""

from __future__ import annotations

import numpy as np
from gguf import GGUFWriter, LlamaFileType

from slotkeeper.tinymodel.spec import _MAMBA_D_CONV, _MAMBA_D_STATE, _MAMBA_DT_RANK_DIV, _MAMBA_EXPAND, TinyModelSpec
from slotkeeper.tinymodel.tensors import _normal
from slotkeeper.tinymodel.vocab import _add_vocab, _Vocab


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
    _add_vocab(writer, vocab, spec.template)

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
