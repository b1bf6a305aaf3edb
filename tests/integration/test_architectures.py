"""Every architecture of the tiny-model generator on both real backends (the llama-server binary, b11434, and the
embedded xllamacpp server, b11549): it loads, chats, and its slot saves, erases and restores. And the qwen3 template
variant with THINKING_GRAMMAR gets its reasoning split off by the server's reasoning parser."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotkeeper.tinymodel import ARCHS, THINKING_GRAMMAR, TinyModelSpec, write_tiny_model
from tests.support import Backend

pytestmark = pytest.mark.backend

# The b11549 slot-file appendix that carries context checkpoints (u32 "SCKP"); dense models have none to write.
_CHECKPOINT_MAGIC = struct.pack("<I", 0x504B4353)


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch: str = request.param
    path = tmp_path_factory.mktemp("arch-models") / f"tiny-{arch}.gguf"
    write_tiny_model(path, TinyModelSpec(arch=arch))  # type: ignore[arg-type]
    return arch, path


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("arch-models") / "tiny-llama-qwen3.gguf"
    write_tiny_model(path, TinyModelSpec(template="qwen3"))
    return path


@contextmanager
def _started(kind: str, model: Path, tmp_path: Path) -> Iterator[Backend]:
    backend = Backend(kind, model, tmp_path / "slots", tmp_path / "backend.log", ctx_per_slot=4096, cache_ram=0)
    try:
        try:
            backend.start()
        except RuntimeError as exc:
            pytest.fail(f"{exc}\n{backend.log_path.read_text(errors='replace')[-4000:]}")
        yield backend
    finally:
        backend.stop()


def _json(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_chat_save_erase_restore(tmp_path: Path, backend_kind: str, arch_model: tuple[str, Path]) -> None:
    arch, model = arch_model
    with _started(backend_kind, model, tmp_path) as backend:
        messages = [{"role": "system", "content": "you are a test model"},
                    {"role": "user", "content": "hello there please write one word"}]
        with httpx.Client(base_url=backend.url, timeout=60) as client:
            body = _json(client.post("/v1/chat/completions",
                                     json={"messages": messages, "max_tokens": 4, "temperature": 0}))
            assert body["timings"]["prompt_n"] > 0 and body["timings"]["predicted_n"] > 0
            n_tokens = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]

            saved = _json(client.post("/slots/0?action=save", json={"filename": "x.bin"}))
            assert saved["n_saved"] > 0
            assert saved["n_saved"] <= n_tokens
            slot_file = backend.slot_dir / "x.bin"
            assert saved["n_written"] == slot_file.stat().st_size
            if backend_kind == "embedded" and arch != "llama":
                # Recurrent, hybrid and SWA models have context checkpoints; b11549 appends them to the file.
                assert _CHECKPOINT_MAGIC in slot_file.read_bytes()

            _json(client.post("/slots/0?action=erase"))
            restored = _json(client.post("/slots/0?action=restore", json={"filename": "x.bin"}))
            assert restored["n_restored"] > 0
            assert restored["n_restored"] == saved["n_saved"]
            assert restored["n_read"] > 0

            # The restored slot serves the next turn.
            again = _json(client.post("/v1/chat/completions",
                                      json={"messages": messages, "max_tokens": 4, "temperature": 0}))
            assert again["timings"]["predicted_n"] > 0
        assert backend.alive()


def test_thinking_grammar_gives_reasoning_content(tmp_path: Path, backend_kind: str, qwen3_model: Path) -> None:
    with _started(backend_kind, qwen3_model, tmp_path) as backend:
        earlier = [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": "first question"},
                   {"role": "assistant", "content": "<think>old thought</think>old answer"},
                   {"role": "user", "content": "second question"}]
        with httpx.Client(base_url=backend.url, timeout=60) as client:
            body = _json(client.post("/v1/chat/completions", json={
                "messages": earlier, "max_tokens": 64, "temperature": 0, "grammar": THINKING_GRAMMAR,
                "reasoning_format": "deepseek",
            }))
            [choice] = body["choices"]
            assert choice["finish_reason"] == "stop"
            assert len(choice["message"].get("reasoning_content") or "") > 0
            assert len(choice["message"]["content"] or "") > 0

            # The server's own Jinja engine renders the template: earlier thinking dropped, tools in the system part,
            # tool calls and results in their blocks.
            prompt = _json(client.post("/apply-template", json={"messages": earlier}))["prompt"]
            assert "old answer" in prompt and "old thought" not in prompt and "<think>" not in prompt
            assert prompt.endswith("<|im_start|>assistant\n")
            tool = {"type": "function", "function": {"name": "get_time", "description": "the time",
                                                     "parameters": {"type": "object", "properties": {}}}}
            calls = [*earlier,
                     {"role": "assistant", "content": "",
                      "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "get_time", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "noon"},
                     {"role": "user", "content": "thanks"}]
            prompt = _json(client.post("/apply-template", json={"messages": calls, "tools": [tool]}))["prompt"]
            system = prompt.split("<|im_end|>", 1)[0]
            assert system.startswith("<|im_start|>system\nbe brief\n\n# Tools") and "<tools>\n{" in system
            assert '"name": "get_time"' in system
            assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>' in prompt
            assert "<|im_start|>user\n<tool_response>\nnoon\n</tool_response><|im_end|>" in prompt
        assert backend.alive()
