"""llama-server's own routes through slotkeeper against real llama.cpp servers (the binary and the embedded one), on
the tiny model with fill-in-the-middle tokens: llama.vim's /infill sequence kept hot and restored, /completion
unary and streamed, the routes without a slot, and the /props and /slots views.

Assertions are on token counts (timings.cache_n, counted by the backend's /tokenize) and status codes, never on text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from tests.conftest import Stack
from tests.support import Conversation, chat, turn_log, words

pytestmark = pytest.mark.backend

LLAMA_VIM = Path(__file__).resolve().parent.parent / "fixtures" / "clients" / "llama-vim.json"
# cache_n may fall short of everything shared by a few tokens at the edges of the rendered parts.
EDGE_SLACK = 8


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-fim.gguf"
    write_tiny_model(path, TinyModelSpec(fim=True))
    return path


def _requests() -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = json.loads(LLAMA_VIM.read_text())["requests"]
    return steps


def _tokens(client: httpx.Client, text: str) -> int:
    response = client.post("/tokenize", json={"content": text})
    assert response.status_code == 200, response.text
    return len(response.json()["tokens"])


def _infill_rows(keeper: Any) -> list[dict[str, str]]:
    return [row for row in turn_log(keeper, "infill") if row["api"] == "llama.infill"]


def test_llama_vim_sequence_keeps_the_file_hot_and_restores_it(stack: Stack, client_for, fim_model: Path) -> None:
    keeper = stack.slotkeeper(stack.backend(model=fim_model, parallel=1, cache_ram=0))
    client = client_for(keeper)
    warm_up, first, typing, later = _requests()
    prefix_tokens = _tokens(client, first["body"]["input_prefix"])
    assert prefix_tokens > 300  # well past --min-restore-tokens

    warmed = client.post("/infill", json=warm_up["body"])
    assert warmed.status_code == 200 and warmed.json() == {}, warmed.text  # response_fields [""]: nothing
    answered = client.post("/infill", json=first["body"])
    assert answered.status_code == 200, answered.text
    assert answered.headers["x-slotkeeper-session"] == "infill"
    assert set(answered.json()) <= set(first["body"]["response_fields"])
    assert {"content", "timings/prompt_n", "tokens_cached"} <= set(answered.json())

    hot = client.post("/infill", json=typing["body"])
    assert hot.status_code == 200 and hot.headers["x-slotkeeper-cache"] == "hot", hot.text

    # Another session's chat takes the only slot: the infill state is saved, then restored for the next request.
    Conversation(client, "chat-between", size=400).turn()
    restored = client.post("/infill", json=later["body"])
    assert restored.status_code == 200, restored.text
    assert restored.headers["x-slotkeeper-cache"] == "restored"
    assert restored.headers["x-slotkeeper-session"] == "infill"

    rows = _infill_rows(keeper)
    assert [row["cache"] for row in rows] == ["cold", "hot", "hot", "restored"], rows
    # slotkeeper saw the whole timings although the client asked for other fields only.
    hot_cache_n, restored_cache_n = int(rows[2]["cache_n"]), int(rows[3]["cache_n"])
    print(f"\n[{stack.kind}] prefix {prefix_tokens} tokens: cache_n hot {hot_cache_n}, "
          f"after another session's turn {restored_cache_n}")
    assert hot_cache_n >= prefix_tokens - EDGE_SLACK, (prefix_tokens, rows)
    assert restored_cache_n >= prefix_tokens - EDGE_SLACK, (prefix_tokens, rows)
    row = keeper.row("infill")
    assert row is not None and row["n_tokens"] > prefix_tokens


def test_warm_up_with_n_predict_0_answers_and_keeps_the_session(stack: Stack, client_for, fim_model: Path) -> None:
    keeper = stack.slotkeeper(stack.backend(model=fim_model, parallel=1, cache_ram=0))
    client = client_for(keeper)
    warm_up, first, typing, _ = _requests()
    extra_tokens = sum(_tokens(client, chunk["text"]) for chunk in warm_up["body"]["input_extra"])

    warmed = client.post("/infill", json={**warm_up["body"], "response_fields": None})
    assert warmed.status_code == 200, warmed.text
    assert warmed.headers["x-slotkeeper-session"] == "infill"
    assert "timings" in warmed.json()
    assert client.post("/infill", json=first["body"]).status_code == 200
    # A warm-up between two requests (llama.vim sends one on every buffer event): it answers, and the next request
    # is still the session's, hot, reusing the extra context the warm-up left.
    again = client.post("/infill", json=warm_up["body"])
    assert again.status_code == 200 and again.json() == {}
    after = client.post("/infill", json=typing["body"])
    assert after.status_code == 200 and after.headers["x-slotkeeper-cache"] == "hot"
    rows = _infill_rows(keeper)
    assert [row["end"] for row in rows] == ["completed"] * 4 and [row["status"] for row in rows] == ["200"] * 4
    assert int(rows[-1]["cache_n"]) >= extra_tokens, (extra_tokens, rows)


def test_completion_unary_and_streamed(stack: Stack, client_for, fim_model: Path) -> None:
    keeper = stack.slotkeeper(stack.backend(model=fim_model, parallel=1, cache_ram=0))
    client = client_for(keeper)
    prompt = words(400, 5)
    first = client.post("/completion", json={"prompt": prompt, "n_predict": 4, "id_slot": 5})
    assert first.status_code == 200, first.text
    assert first.headers["x-slotkeeper-session"] == "default"
    timings = first.json()["timings"]
    assert timings["prompt_n"] > 0 and timings["predicted_n"] > 0

    events = []
    with client.stream("POST", "/completion", json={"prompt": prompt, "n_predict": 4, "stream": True}) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.headers["x-slotkeeper-cache"] == "hot"
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    final = events[-1]
    assert final["stop"] is True and final["timings"]["predicted_n"] > 0
    assert final["timings"]["cache_n"] >= timings["prompt_n"] - 1, (timings, final["timings"])
    assert all(not e["stop"] for e in events[:-1]) and len(events) > 1

    named = client.post("/completion", json={"prompt": prompt, "n_predict": 2}, headers={"X-Session-Id": "doc"})
    assert named.status_code == 200 and named.headers["x-slotkeeper-session"] == "doc"
    assert "timings" in named.json()


def test_routes_without_a_slot_and_views_show_no_other_prompt(stack: Stack, client_for, fim_model: Path) -> None:
    backend = stack.backend(model=fim_model, parallel=1, cache_ram=0)
    keeper = stack.slotkeeper(backend)
    client = client_for(keeper)
    marker = "zulu-MARKER-7f3a9c-secret"
    assert chat(client, [{"role": "user", "content": f"{marker} {words(80, 3)}"}], "secret").status_code == 200
    # The backend's own /slots shows each slot's last request (its sampling "params"; its "prompt" too in the
    # builds that fill that field in): slotkeeper's view is its own, with counts only.
    assert httpx.get(f"{backend.url}/slots", timeout=30).status_code == 200

    props = client.get("/props", params={"autoload": "false"})
    assert props.status_code == 200, props.text
    assert marker not in props.text
    view = props.json()
    assert view["total_slots"] == 1 and view["n_ctx"] == view["default_generation_settings"]["n_ctx"] > 0
    assert {"modalities", "chat_template", "build_info"} <= set(view)
    assert client.post("/props", json={}).status_code == 405

    slots = client.get("/slots")
    assert slots.status_code == 200 and marker not in slots.text
    (slot,) = slots.json()
    assert set(slot) == {"id", "n_ctx", "is_processing", "n_tokens"}
    assert slot["id"] == 0 and slot["n_tokens"] > 0 and slot["is_processing"] is False

    tokens = client.post("/tokenize", json={"content": "hello world", "session_id": "x"})
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    text = client.post("/detokenize", json={"tokens": ids})
    assert text.status_code == 200 and "hello" in text.json()["content"]
    rendered = client.post("/apply-template", json={"messages": [{"role": "user", "content": "hi there"}]})
    assert rendered.status_code == 200 and "hi there" in rendered.json()["prompt"]
    refused = client.post("/apply-template", json={})
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
    # No --embeddings on this backend: its own 501, in its own shape.
    embedding = client.post("/embedding", json={"content": "hi"})
    assert embedding.status_code == 501 and embedding.json()["error"]["type"] == "not_supported_error"
    assert marker not in client.get("/slots").text + client.get("/props").text
