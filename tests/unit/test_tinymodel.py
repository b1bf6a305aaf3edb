"""Tests for the tiny random-weight GGUF generator (llama and recurrent mamba), including real loads in the embedded
llama.cpp server and in the llama-server binary."""

from __future__ import annotations

import hashlib
import json
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import gguf
import httpx
import pytest

from slotkeeper.tinymodel import (
    ARCHS,
    IM_END,
    IM_START,
    QWEN3_TEMPLATE,
    THINK_END,
    THINK_START,
    THINKING_GRAMMAR,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TinyModelSpec,
    write_tiny_model,
)
from tests.support import Backend, llama_server_binary

_EXPECTED_KEYS = (
    "general.architecture",
    "general.name",
    "general.file_type",
    "llama.context_length",
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.rope.dimension_count",
    "llama.rope.freq_base",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.vocab_size",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.chat_template",
)

# Runs the embedded server in a child process: xllamacpp.Server has no stop method, so the child is killed instead.
# The child also exits by itself when its stdin closes, so a crashed test run leaves no server behind.
_SERVER_SCRIPT = """
import sys
import xllamacpp as xlc

p = xlc.CommonParams()
p.model.path = sys.argv[1]
p.n_ctx = 2048
p.n_parallel = 1
p.hostnames = ["127.0.0.1"]
p.port = int(sys.argv[2])
p.slot_save_path = sys.argv[3]
p.endpoint_slots = True
server = xlc.Server(p)
sys.stdin.buffer.read()
"""


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    assert field is not None, f"missing key {key}"
    return field.contents()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tinymodel") / "tiny.gguf"
    write_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def mamba_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tinymodel") / "tiny-mamba.gguf"
    write_tiny_model(path, TinyModelSpec(arch="mamba"))
    return path


@pytest.fixture(params=["llama", "mamba"])
def arch_model(request: pytest.FixtureRequest) -> pathlib.Path:
    fixture = "default_model" if request.param == "llama" else "mamba_model"
    path: pathlib.Path = request.getfixturevalue(fixture)
    return path


def test_default_llama_bytes_are_pinned(default_model: pathlib.Path) -> None:
    # Other tests and cached slot files depend on the default model: adding archs must not change its bytes.
    digest = hashlib.sha256(default_model.read_bytes()).hexdigest()
    assert digest == "3193c1809d2e2c6947d734a3d7e9c1b70814d75f002ce38d13d27da8d0e2c47b"


def test_default_names_follow_arch() -> None:
    assert TinyModelSpec().name == "tiny-random-llama"
    assert TinyModelSpec(arch="mamba").name == "tiny-random-mamba"
    assert TinyModelSpec(arch="mamba", name="x").name == "x"
    assert TinyModelSpec() == TinyModelSpec(name="tiny-random-llama")


def test_same_spec_gives_identical_bytes(tmp_path: pathlib.Path, default_model: pathlib.Path) -> None:
    again = tmp_path / "again.gguf"
    size = write_tiny_model(again, TinyModelSpec())
    assert size == again.stat().st_size
    assert hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(default_model.read_bytes()).digest()


def test_different_seed_gives_different_bytes(tmp_path: pathlib.Path, default_model: pathlib.Path) -> None:
    other = tmp_path / "other.gguf"
    write_tiny_model(other, TinyModelSpec(seed=4321))
    assert other.stat().st_size == default_model.stat().st_size
    assert other.read_bytes() != default_model.read_bytes()


def test_size_and_atomic_write(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"stale")
    size = write_tiny_model(path)
    assert size == path.stat().st_size
    assert 2_000_000 < size < 40_000_000
    assert path.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # no temp file left behind


def test_reads_back_with_expected_metadata(default_model: pathlib.Path) -> None:
    spec = TinyModelSpec()
    reader = gguf.GGUFReader(default_model)
    for key in _EXPECTED_KEYS:
        assert reader.get_field(key) is not None, f"missing key {key}"
    assert "output.weight" not in {t.name for t in reader.tensors}

    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    scores = _field(reader, "tokenizer.ggml.scores")
    n_vocab = len(tokens)
    assert _field(reader, "llama.vocab_size") == n_vocab
    assert len(types) == len(scores) == n_vocab
    assert 400 <= n_vocab <= 1000
    assert len(set(tokens)) == n_vocab
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3] == "<0x00>" and tokens[258] == "<0xFF>"
    assert tokens[-2:] == [IM_START, IM_END]
    assert types[0] == gguf.TokenType.UNKNOWN
    assert types[1] == types[2] == types[-1] == types[-2] == gguf.TokenType.CONTROL
    assert set(types[3:259]) == {gguf.TokenType.BYTE}
    assert set(types[259:-2]) == {gguf.TokenType.NORMAL}
    assert all(score < 0 for score in scores[259:-2])
    assert "\u2581the" in tokens and "\u2581" in tokens

    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "general.name") == spec.name
    assert _field(reader, "general.file_type") == 1
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    assert _field(reader, "tokenizer.ggml.bos_token_id") == 1
    assert _field(reader, "tokenizer.ggml.unknown_token_id") == 0
    assert _field(reader, "tokenizer.ggml.eos_token_id") == n_vocab - 1
    assert _field(reader, "tokenizer.ggml.eot_token_id") == n_vocab - 1
    assert _field(reader, "tokenizer.ggml.add_bos_token") is True
    assert _field(reader, "tokenizer.ggml.add_eos_token") is False
    assert _field(reader, "llama.rope.dimension_count") == spec.n_embd // spec.n_head
    assert _field(reader, "llama.context_length") == spec.context_length
    assert "<|im_start|>" in _field(reader, "tokenizer.chat_template")

    assert len(reader.tensors) == 2 + 9 * spec.n_layer
    shapes = {t.name: (tuple(int(d) for d in t.data.shape), t.tensor_type) for t in reader.tensors}
    f16, f32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    head_dim = spec.n_embd // spec.n_head
    assert shapes["token_embd.weight"] == ((n_vocab, spec.n_embd), f16)
    assert shapes["output_norm.weight"] == ((spec.n_embd,), f32)
    assert shapes["blk.0.attn_k.weight"] == ((spec.n_head_kv * head_dim, spec.n_embd), f16)
    assert shapes[f"blk.{spec.n_layer - 1}.ffn_down.weight"] == ((spec.n_embd, spec.n_ff), f16)


def test_mamba_same_spec_gives_identical_bytes(
    tmp_path: pathlib.Path, mamba_model: pathlib.Path, default_model: pathlib.Path
) -> None:
    again = tmp_path / "again.gguf"
    size = write_tiny_model(again, TinyModelSpec(arch="mamba"))
    assert size == again.stat().st_size == mamba_model.stat().st_size
    assert again.read_bytes() == mamba_model.read_bytes()
    assert mamba_model.read_bytes() != default_model.read_bytes()

    other = tmp_path / "other.gguf"
    write_tiny_model(other, TinyModelSpec(arch="mamba", seed=4321))
    assert other.stat().st_size == mamba_model.stat().st_size
    assert other.read_bytes() != mamba_model.read_bytes()


def test_mamba_reads_back_with_expected_metadata(mamba_model: pathlib.Path) -> None:
    spec = TinyModelSpec(arch="mamba")
    reader = gguf.GGUFReader(mamba_model)
    n_vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    d_inner, d_state, d_conv, dt_rank = 2 * spec.n_embd, 16, 4, spec.n_embd // 16

    assert _field(reader, "general.architecture") == "mamba"
    assert _field(reader, "general.name") == "tiny-random-mamba"
    assert _field(reader, "general.file_type") == 1
    expected = {
        "mamba.context_length": spec.context_length,
        "mamba.embedding_length": spec.n_embd,
        "mamba.block_count": spec.n_layer,
        "mamba.feed_forward_length": 0,
        "mamba.attention.head_count": 0,
        "mamba.ssm.conv_kernel": d_conv,
        "mamba.ssm.inner_size": d_inner,
        "mamba.ssm.state_size": d_state,
        "mamba.ssm.time_step_rank": dt_rank,
        "mamba.ssm.dt_b_c_rms": False,
        "mamba.vocab_size": n_vocab,
    }
    for key, value in expected.items():
        assert _field(reader, key) == value, key
    assert _field(reader, "mamba.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert not any(f.startswith("llama.") for f in reader.fields)
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    assert _field(reader, "tokenizer.ggml.eos_token_id") == n_vocab - 1
    assert "<|im_start|>" in _field(reader, "tokenizer.chat_template")

    # Numpy shapes: ggml ne (llama.cpp's create_tensor dims) reversed.
    f16, f32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    per_layer = {
        "attn_norm.weight": ((spec.n_embd,), f32),
        "ssm_in.weight": ((2 * d_inner, spec.n_embd), f16),
        "ssm_conv1d.weight": ((d_inner, d_conv), f32),
        "ssm_conv1d.bias": ((d_inner,), f32),
        "ssm_x.weight": ((dt_rank + 2 * d_state, d_inner), f16),
        "ssm_dt.weight": ((d_inner, dt_rank), f16),
        "ssm_dt.bias": ((d_inner,), f32),
        "ssm_a": ((d_inner, d_state), f32),
        "ssm_d": ((d_inner,), f32),
        "ssm_out.weight": ((spec.n_embd, d_inner), f16),
    }
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: (tuple(int(d) for d in t.data.shape), t.tensor_type) for name, t in tensors.items()}
    assert len(shapes) == 2 + len(per_layer) * spec.n_layer
    assert shapes["token_embd.weight"] == ((n_vocab, spec.n_embd), f16)
    assert shapes["output_norm.weight"] == ((spec.n_embd,), f32)
    assert "output.weight" not in shapes
    for layer in range(spec.n_layer):
        for suffix, shape in per_layer.items():
            assert shapes[f"blk.{layer}.{suffix}"] == shape, f"blk.{layer}.{suffix}"
    assert (tensors["blk.0.ssm_a"].data < 0).all()  # A = -exp(A_log)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (TinyModelSpec(n_embd=0), "n_embd"),
        (TinyModelSpec(n_layer=-1), "n_layer"),
        (TinyModelSpec(n_embd=250), "divisible by n_head"),
        (TinyModelSpec(n_head_kv=3), "divisible by n_head_kv"),
        (TinyModelSpec(arch="mamba", n_embd=200), "divisible by 16"),
        (TinyModelSpec(arch="mamba", n_layer=0), "n_layer"),
    ],
)
def test_bad_spec_raises(tmp_path: pathlib.Path, spec: TinyModelSpec, message: str) -> None:
    path = tmp_path / "bad.gguf"
    with pytest.raises(ValueError, match=message):
        write_tiny_model(path, spec)
    assert list(tmp_path.iterdir()) == []


def test_mamba_spec_ignores_attention_fields(tmp_path: pathlib.Path) -> None:
    # n_head, n_head_kv and n_ff mean nothing to mamba: shapes the llama variant rejects are fine here.
    assert write_tiny_model(tmp_path / "m.gguf", TinyModelSpec(arch="mamba", n_embd=240, n_layer=1, n_head=7)) > 0


@pytest.fixture
def embedded_server(tmp_path: pathlib.Path, arch_model: pathlib.Path) -> Iterator[str]:
    pytest.importorskip("xllamacpp")
    port = _free_port()
    log_path = tmp_path / "server.log"
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER_SCRIPT, str(arch_model), str(port), f"{slot_dir}/"],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy in time:\n{log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(0.2)
        yield base_url
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.kill()
        proc.wait(timeout=30)


def test_embedded_llama_server_loads_and_chats(embedded_server: str, arch_model: pathlib.Path) -> None:
    tokens = _field(gguf.GGUFReader(arch_model), "tokenizer.ggml.tokens")
    ids = {piece: i for i, piece in enumerate(tokens)}

    with httpx.Client(base_url=embedded_server, timeout=60) as client:
        resp = client.post("/tokenize", json={"content": f"{IM_START}user\nhello{IM_END}", "parse_special": True})
        assert resp.status_code == 200, resp.text
        got = resp.json()["tokens"]
        # SentencePiece adds a space prefix after a special token; "\n" and "hello" fall back to bytes and letters.
        expected = [ids[IM_START], ids["\u2581user"], ids["<0x0A>"], *(ids[c] for c in "hello"), ids[IM_END]]
        assert got == expected

        resp = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["prompt_tokens"] > 0
        assert body["timings"]["prompt_n"] > 0
        assert body["choices"][0]["message"]["role"] == "assistant"

        assert client.get("/slots").status_code == 200
        resp = client.post("/slots/0?action=save", json={"filename": "slot0.bin"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["n_saved"] > 0


def _chat(client: httpx.Client, messages: list[dict[str, str]]) -> dict[str, Any]:
    resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


@pytest.mark.backend
@pytest.mark.parametrize("arch", ["llama", "mamba"])
def test_binary_regenerate_after_restore(
    tmp_path: pathlib.Path, arch: str, default_model: pathlib.Path, mamba_model: pathlib.Path
) -> None:
    """Resend the same turn after save/erase/restore: a KV cache reuses all but the last prompt token, a recurrent
    state cannot roll back to before the last prompt token (its checkpoints are not in the slot file) and starts over.
    """
    llama_server_binary()  # like every binary test: a missing build fails with the command that makes it
    model = default_model if arch == "llama" else mamba_model
    backend = Backend("binary", model, tmp_path / "slots", tmp_path / "server.log", ctx_per_slot=4096, cache_ram=0)
    try:
        try:
            backend.start()
        except RuntimeError:
            pytest.fail(backend.log_path.read_text(errors="replace")[-4000:])
        messages = [{"role": "system", "content": "you are a test model"},
                    {"role": "user", "content": "hello there please write one word"}]
        with httpx.Client(base_url=backend.url, timeout=60) as client:
            first = _chat(client, messages)
            n_prompt = first["usage"]["prompt_tokens"]
            assert first["timings"]["cache_n"] == 0
            resp = client.post("/slots/0?action=save", json={"filename": "turn1.bin"})
            assert resp.status_code == 200 and resp.json()["n_saved"] > 0, resp.text
            assert client.post("/slots/0?action=erase").status_code == 200
            resp = client.post("/slots/0?action=restore", json={"filename": "turn1.bin"})
            assert resp.status_code == 200, resp.text

            again = _chat(client, messages)
        expected = n_prompt - 1 if arch == "llama" else 0
        assert again["timings"]["cache_n"] == expected
    finally:
        backend.stop()


# -- jamba, lfm2, gemma3 and the qwen3 template ---------------------------------------------------------------------

_NEW_ARCHS = ("jamba", "lfm2", "gemma3")
_F16, _F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32


@pytest.fixture(scope="module", params=_NEW_ARCHS)
def new_arch_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tinymodel") / f"tiny-{request.param}.gguf"
    write_tiny_model(path, TinyModelSpec(arch=request.param))
    return path


def _arch_of(path: pathlib.Path) -> str:
    arch: str = _field(gguf.GGUFReader(path), "general.architecture")
    return arch


def test_default_mamba_bytes_are_pinned(mamba_model: pathlib.Path) -> None:
    digest = hashlib.sha256(mamba_model.read_bytes()).hexdigest()
    assert digest == "c9a1eebcd037ed77073896ad886fbb05161d70923dc307fe754b42ae1a82a509"


def test_unset_shapes_take_the_arch_defaults() -> None:
    assert TinyModelSpec() == TinyModelSpec(n_embd=256, n_head=8, n_head_kv=4, n_ff=768, template="chatml")
    assert TinyModelSpec(arch="mamba").n_embd == 256
    for arch in _NEW_ARCHS:
        spec = TinyModelSpec(arch=arch)  # type: ignore[arg-type]
        assert (spec.n_embd, spec.n_layer, spec.n_head, spec.n_head_kv, spec.n_ff) == (128, 4, 4, 2, 256)
        assert spec.name == f"tiny-random-{arch}"
    assert TinyModelSpec(arch="gemma3", n_embd=64).n_embd == 64
    assert ARCHS == ("llama", "mamba", "jamba", "lfm2", "gemma3")


def test_new_arch_is_deterministic_and_small(tmp_path: pathlib.Path, new_arch_model: pathlib.Path) -> None:
    arch = _arch_of(new_arch_model)
    again = tmp_path / "again.gguf"
    size = write_tiny_model(again, TinyModelSpec(arch=arch))  # type: ignore[arg-type]
    assert size == again.stat().st_size == new_arch_model.stat().st_size
    assert again.read_bytes() == new_arch_model.read_bytes()
    assert 1_000_000 < size < 3_000_000

    other = tmp_path / "other.gguf"
    write_tiny_model(other, TinyModelSpec(arch=arch, seed=4321))  # type: ignore[arg-type]
    assert other.stat().st_size == size
    assert other.read_bytes() != new_arch_model.read_bytes()


def _expected_new_arch(arch: str, n_vocab: int) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], Any]]]:
    """Keys (without the arch prefix) and tensors (numpy shape, type) of a default-shaped new-arch model."""
    n_embd, n_ff, head_dim, n_kv = 128, 256, 32, 2 * 32
    d_inner, d_state, dt_rank = 2 * n_embd, 16, n_embd // 16
    keys: dict[str, Any] = {
        "context_length": 32768, "embedding_length": n_embd, "block_count": 4, "feed_forward_length": n_ff,
        "attention.head_count": 4, "vocab_size": n_vocab,
    }
    tensors: dict[str, tuple[tuple[int, ...], Any]] = {"token_embd.weight": ((n_vocab, n_embd), _F16)}
    ffn = {"ffn_gate.weight": ((n_ff, n_embd), _F16), "ffn_up.weight": ((n_ff, n_embd), _F16),
           "ffn_down.weight": ((n_embd, n_ff), _F16), "ffn_norm.weight": ((n_embd,), _F32),
           "attn_norm.weight": ((n_embd,), _F32)}
    qkvo = {"attn_q.weight": ((n_embd, n_embd), _F16), "attn_k.weight": ((n_kv, n_embd), _F16),
            "attn_v.weight": ((n_kv, n_embd), _F16), "attn_output.weight": ((n_embd, n_embd), _F16)}
    qk_norms = {"attn_q_norm.weight": ((head_dim,), _F32), "attn_k_norm.weight": ((head_dim,), _F32)}
    if arch == "jamba":
        keys |= {"attention.head_count_kv": [0, 2, 0, 2], "ssm.conv_kernel": 4, "ssm.inner_size": d_inner,
                 "ssm.state_size": d_state, "ssm.time_step_rank": dt_rank}
        tensors["output_norm.weight"] = ((n_embd,), _F32)
        recurrent = {
            "ssm_in.weight": ((2 * d_inner, n_embd), _F16), "ssm_conv1d.weight": ((d_inner, 4), _F32),
            "ssm_conv1d.bias": ((d_inner,), _F32), "ssm_x.weight": ((dt_rank + 2 * d_state, d_inner), _F16),
            "ssm_dt_norm.weight": ((dt_rank,), _F32), "ssm_dt.weight": ((d_inner, dt_rank), _F16),
            "ssm_dt.bias": ((d_inner,), _F32), "ssm_b_norm.weight": ((d_state,), _F32),
            "ssm_c_norm.weight": ((d_state,), _F32), "ssm_a": ((d_inner, d_state), _F32),
            "ssm_d": ((d_inner,), _F32), "ssm_out.weight": ((n_embd, d_inner), _F16),
        }
        layers = [ffn | (qkvo if layer % 2 else recurrent) for layer in range(4)]
    elif arch == "lfm2":
        keys |= {"attention.head_count_kv": [0, 2, 0, 2], "shortconv.l_cache": 3, "rope.freq_base": 1e6}
        tensors["token_embd_norm.weight"] = ((n_embd,), _F32)  # LFM2's output norm
        conv = {"shortconv.conv.weight": ((n_embd, 3), _F32), "shortconv.in_proj.weight": ((3 * n_embd, n_embd), _F16),
                "shortconv.out_proj.weight": ((n_embd, n_embd), _F16)}
        layers = [ffn | (qkvo | qk_norms if layer % 2 else conv) for layer in range(4)]
    else:
        keys |= {"attention.head_count_kv": 2, "attention.key_length": head_dim, "attention.value_length": head_dim,
                 "rope.freq_base": 10000.0, "attention.sliding_window": 64, "attention.sliding_window_pattern": 2}
        tensors["output_norm.weight"] = ((n_embd,), _F32)
        post = {"post_attention_norm.weight": ((n_embd,), _F32), "post_ffw_norm.weight": ((n_embd,), _F32)}
        layers = [ffn | qkvo | qk_norms | post for _ in range(4)]
    for layer, per_layer in enumerate(layers):
        tensors |= {f"blk.{layer}.{name}": shape for name, shape in per_layer.items()}
    return keys, tensors


def test_new_arch_reads_back_with_expected_keys_and_tensors(new_arch_model: pathlib.Path) -> None:
    reader = gguf.GGUFReader(new_arch_model)
    arch = _field(reader, "general.architecture")
    n_vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    keys, tensors = _expected_new_arch(arch, n_vocab)

    assert _field(reader, "general.name") == f"tiny-random-{arch}"
    assert _field(reader, "general.file_type") == 1
    for key, value in keys.items():
        assert _field(reader, f"{arch}.{key}") == pytest.approx(value), key
    assert _field(reader, f"{arch}.attention.layer_norm_rms_epsilon") > 0
    assert {f.split(".")[0] for f in reader.fields} <= {"GGUF", "general", "tokenizer", arch}
    assert "<|im_start|>" in _field(reader, "tokenizer.chat_template")

    got = {t.name: (tuple(int(d) for d in t.data.shape), t.tensor_type) for t in reader.tensors}
    assert got == tensors
    # Every name is gguf's own for the arch (blk.N.<name>), as llama.cpp looks them up.
    arch_enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    known = {gguf.TENSOR_NAMES[t].format(bid=layer) for t in gguf.MODEL_TENSORS[arch_enum] for layer in range(4)}
    for name in got:
        assert name.removesuffix(".weight").removesuffix(".bias") in known, name


def test_qwen3_template_adds_marker_tokens_only_there(tmp_path: pathlib.Path, default_model: pathlib.Path) -> None:
    path = tmp_path / "qwen3.gguf"
    write_tiny_model(path, TinyModelSpec(template="qwen3"))
    reader = gguf.GGUFReader(path)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    assert tokens[-6:] == [IM_START, IM_END, THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END]
    assert types[-4:] == [gguf.TokenType.USER_DEFINED] * 4
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokens.index(IM_END)
    assert _field(reader, "tokenizer.chat_template") == QWEN3_TEMPLATE
    assert _field(reader, "llama.vocab_size") == len(tokens)

    chatml_tokens = _field(gguf.GGUFReader(default_model), "tokenizer.ggml.tokens")
    assert tokens[:-4] == chatml_tokens
    assert THINK_START not in chatml_tokens


def test_thinking_grammar_shape() -> None:
    assert THINKING_GRAMMAR.startswith('root ::= "<think>" ')
    assert '"</think>"' in THINKING_GRAMMAR


def test_qwen3_template_renders_tools_and_drops_earlier_thinking() -> None:
    jinja2_sandbox = pytest.importorskip("jinja2.sandbox")
    env = jinja2_sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)  # as Hugging Face renders it
    template = env.from_string(QWEN3_TEMPLATE)

    earlier = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\na1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "dropped too"},
        {"role": "user", "content": "q3"},
    ]
    assert template.render(messages=earlier, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nq1<|im_end|>\n"
        "<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\na2<|im_end|>\n"
        "<|im_start|>user\nq3<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    calls = [
        {"role": "user", "content": "what time is it"},
        {"role": "assistant", "content": None, "reasoning_content": "ask the clock",
         "tool_calls": [{"type": "function", "function": {"name": "now", "arguments": {"tz": "UTC"}}},
                        {"type": "function", "function": {"name": "now", "arguments": '{"tz": "CET"}'}}]},
        {"role": "tool", "content": "12:00"},
        {"role": "tool", "content": "13:00"},
        {"role": "assistant", "content": "<think>read both</think>noon"},
    ]
    rendered = template.render(messages=calls, tools=[tool], add_generation_prompt=False)
    system, rest = rendered.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n# Tools\n")
    assert f"<tools>\n{json.dumps(tool)}\n</tools>" in system
    assert "<tool_call>" in system and "</tool_call>" in system
    assert rest == (
        "<|im_start|>user\nwhat time is it<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nask the clock\n</think>\n\n"
        '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nread both\n</think>\n\nnoon<|im_end|>\n"
    )

    with_system = template.render(messages=[{"role": "system", "content": "Be brief."}, *calls[:1]], tools=[tool],
                                  add_generation_prompt=True)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert with_system.count("<|im_start|>system") == 1
    assert with_system.endswith("<|im_start|>user\nwhat time is it<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (TinyModelSpec(arch="jamba", n_layer=1), "n_layer must be at least 2"),
        (TinyModelSpec(arch="lfm2", n_layer=1), "n_layer must be at least 2"),
        (TinyModelSpec(arch="gemma3", n_layer=1), "n_layer must be at least 2"),
        (TinyModelSpec(arch="jamba", n_embd=200, n_head=5, n_head_kv=5), "divisible by 16"),
        (TinyModelSpec(arch="gemma3", n_head_kv=3), "divisible by n_head_kv"),
        (TinyModelSpec(arch="lfm2", n_ff=0), "n_ff"),
        (TinyModelSpec(template="jinja"), "unsupported template"),  # type: ignore[arg-type]
        (TinyModelSpec(arch="qwen35"), "unsupported arch"),  # type: ignore[arg-type]
    ],
)
def test_bad_new_spec_raises(tmp_path: pathlib.Path, spec: TinyModelSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_tiny_model(tmp_path / "bad.gguf", spec)
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_the_same_bytes_as_the_api(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slotkeeper.cli import commandline as cli

    out = tmp_path / "cli.gguf"
    assert cli.main(["tiny-model", str(out), "--arch", "lfm2", "--template", "qwen3", "--seed", "7"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    api = tmp_path / "api.gguf"
    write_tiny_model(api, TinyModelSpec(arch="lfm2", template="qwen3", seed=7))
    assert out.read_bytes() == api.read_bytes()

    default = tmp_path / "default.gguf"
    assert cli.main(["tiny-model", str(default)]) == 0
    assert hashlib.sha256(default.read_bytes()).hexdigest() == (
        "3193c1809d2e2c6947d734a3d7e9c1b70814d75f002ce38d13d27da8d0e2c47b")

    parser = cli._parser()
    for arch in ARCHS:
        assert parser.parse_args(["tiny-model", "x.gguf", "--arch", arch]).arch == arch
    with pytest.raises(SystemExit):
        parser.parse_args(["tiny-model", "x.gguf", "--arch", "qwen35"])


def test_fim_adds_the_infill_tokens_after_the_vocab(tmp_path: pathlib.Path, default_model: pathlib.Path) -> None:
    fim = tmp_path / "fim.gguf"
    write_tiny_model(fim, TinyModelSpec(fim=True))
    plain_tokens = _field(gguf.GGUFReader(default_model), "tokenizer.ggml.tokens")
    reader = gguf.GGUFReader(fim)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert tokens[:len(plain_tokens)] == plain_tokens
    assert tokens[len(plain_tokens):] == ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>",
                                          "<|file_sep|>"]
    for offset, name in enumerate(("pre", "suf", "mid", "rep", "sep")):
        assert _field(reader, f"tokenizer.ggml.fim_{name}_token_id") == len(plain_tokens) + offset
    assert _field(reader, "llama.vocab_size") == len(tokens)
    assert reader.get_field("tokenizer.ggml.fim_pre_token_id") is not None
    assert gguf.GGUFReader(default_model).get_field("tokenizer.ggml.fim_pre_token_id") is None
    with pytest.raises(ValueError, match="fim"):
        write_tiny_model(tmp_path / "bad.gguf", TinyModelSpec(fim="yes"))  # type: ignore[arg-type]
