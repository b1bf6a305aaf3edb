"""Deterministic generator of tiny random-weight GGUF models with a synthetic SentencePiece-style vocab.

It gives tests a real model file that llama.cpp's server loads and chats with, built offline in a second or two.
Architectures (``TinyModelSpec.arch``), chosen for the different ways llama.cpp keeps their context:

- ``llama``: dense attention, a plain KV cache (the default model; its bytes are pinned by the tests).
- ``mamba``: recurrent Mamba-1, a fixed-size state and context checkpoints.
- ``jamba``: hybrid, Mamba-1 layers and attention layers (attention on the odd layers).
- ``lfm2``: hybrid, short-convolution layers and attention layers with q/k norms (attention on the odd layers).
- ``gemma3``: sliding-window attention: ``attention.sliding_window`` 64 with ``sliding_window_pattern`` 2, which
  llama.cpp reads as "layer i uses the window when i % 2 < 1", so the even layers are SWA and the odd ones global.
  (Without the pattern key llama.cpp assumes 6, which makes every layer of a model under 6 layers SWA.)

Chat templates (``TinyModelSpec.template``): ``chatml`` (plain ChatML, the default) or ``qwen3``, a Qwen3-style
template (``QWEN3_TEMPLATE``) with tools, ``<tool_call>`` / ``<tool_response>`` blocks and ``<think>`` reasoning
that is dropped from earlier assistant turns. The qwen3 variant appends ``<think>``, ``</think>``, ``<tool_call>`` and
``</tool_call>`` to the vocab as USER_DEFINED tokens (as real Qwen3 GGUFs have them); the chatml vocab, and so the
default llama and mamba files, are unchanged.

Making a random model "think" (``THINKING_GRAMMAR``), as checked on llama-server b11434 and xllamacpp b11549:

- ``"grammar": THINKING_GRAMMAR`` in a /v1/chat/completions or /completion body constrains the sampled *text*:
  llama.cpp matches each candidate token by its text piece, special tokens included (by their own text), so the
  grammar literal ``"<think>"`` is met by the one ``<think>`` token or by the same characters spelled out, and the
  end-of-generation token is allowed only once the grammar is complete (after at most 47 tokens here).
- ``"reasoning_format": "deepseek"`` (the same happens with the field left out) makes /v1/chat/completions split
  ``<think>...</think>`` off into ``message.reasoning_content``; ``"none"`` leaves it all in ``content``. The split
  needs a chat template that shows reasoning: llama-server renders a sample assistant message with
  ``reasoning_content`` through the model's template and takes the markers around it as the reasoning tags. So it
  works with ``qwen3`` and not with ``chatml`` (whose reply stays all ``content``).
- Token type of the markers: USER_DEFINED tokens are always rendered as text. CONTROL tokens are rendered only when
  the request's chat format lists them as preserved tokens, which the reasoning tags are on /v1/chat/completions:
  both types split there, but with CONTROL markers a raw /completion drops the ``<think>`` token from its output.
- The Jinja templates need llama-server's ``--jinja``, on by default in both builds.

Layout: ``templates`` (chat templates, marker tokens, THINKING_GRAMMAR), ``spec`` (TinyModelSpec and its checks),
``vocab`` (the synthetic vocab), ``tensors`` (helpers of the writers), and one writer module per kind of arch:
``dense`` (llama, gemma3), ``recurrent`` (mamba), ``hybrid`` (jamba, lfm2). This module writes the file.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile

from gguf import GGUFWriter

from slotkeeper.tinymodel.dense import _populate_gemma3, _populate_llama
from slotkeeper.tinymodel.hybrid import _populate_jamba, _populate_lfm2
from slotkeeper.tinymodel.recurrent import _populate_mamba
from slotkeeper.tinymodel.spec import ARCHS, TinyModelSpec, _validate
from slotkeeper.tinymodel.spec import Arch as Arch
from slotkeeper.tinymodel.templates import (
    CHATML_TEMPLATE,
    IM_END,
    IM_START,
    QWEN3_TEMPLATE,
    TEMPLATES,
    THINK_END,
    THINK_START,
    THINKING_GRAMMAR,
    TOOL_CALL_END,
    TOOL_CALL_START,
)
from slotkeeper.tinymodel.templates import Template as Template
from slotkeeper.tinymodel.vocab import _build_vocab, _Vocab

__all__ = [
    "ARCHS",
    "CHATML_TEMPLATE",
    "IM_END",
    "IM_START",
    "QWEN3_TEMPLATE",
    "TEMPLATES",
    "THINKING_GRAMMAR",
    "THINK_END",
    "THINK_START",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "TinyModelSpec",
    "write_tiny_model",
]


def _populate(writer: GGUFWriter, spec: TinyModelSpec, vocab: _Vocab) -> None:
    if spec.arch == "mamba":
        _populate_mamba(writer, spec, vocab)
    elif spec.arch == "jamba":
        _populate_jamba(writer, spec, vocab)
    elif spec.arch == "lfm2":
        _populate_lfm2(writer, spec, vocab)
    elif spec.arch == "gemma3":
        _populate_gemma3(writer, spec, vocab)
    else:
        _populate_llama(writer, spec, vocab)


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


# write_tiny_model's default. A module constant because ruff (B008) sees a frozen dataclass as immutable only in
# the module that defines it.
_DEFAULT_SPEC = TinyModelSpec()


def write_tiny_model(path: pathlib.Path, spec: TinyModelSpec = _DEFAULT_SPEC) -> int:
    """Write the model for ``spec`` to ``path`` atomically and return the number of bytes written."""
    _validate(spec)
    path = pathlib.Path(path)
    directory = path.parent
    vocab = _build_vocab(spec.template, spec.fim)

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
