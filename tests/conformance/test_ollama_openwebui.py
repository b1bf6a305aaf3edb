"""Requests shaped as OpenWebUI (0.9-0.12) sends them to an Ollama connection, against slotkeeper on a real
llama-server: the model-list calls, the chat page's main request, the background tasks and the unload button."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest

from tests.support import Slotkeeper, turn_log, wait_until

pytestmark = pytest.mark.backend

MODEL = "tiny:latest"


@pytest.fixture
def client(keeper: Slotkeeper) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keeper.url, timeout=120) as c:
        yield c


def user_headers() -> dict[str, str]:
    """What ENABLE_FORWARD_USER_INFO_HEADERS adds to every request."""
    return {"X-OpenWebUI-User-Name": "Jane%20Doe", "X-OpenWebUI-User-Id": str(uuid.uuid4()),
            "X-OpenWebUI-User-Email": "jane@example.org", "X-OpenWebUI-User-Role": "user",
            "X-OpenWebUI-Auth-Type": "password"}


def chat_headers(chat_id: str) -> dict[str, str]:
    return {**user_headers(), "X-OpenWebUI-Chat-Id": chat_id}


def builtin_tools(n: int = 36) -> list[dict[str, Any]]:
    """The page attaches its built-in tool definitions to every chat, whatever the model can do."""
    return [{"type": "function", "function": {
        "name": f"builtin_tool_{i}", "description": f"Built-in tool number {i}: searches, fetches or computes.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer", "description": "how many results"}}, "required": ["query"]}}}
        for i in range(n)]


def history_block(messages: list[dict[str, str]]) -> str:
    lines = [f"{m['role'].upper()}: {m['content']}" for m in messages]
    return "<chat_history>\n" + "\n".join(lines) + "\n</chat_history>"


def task_prompt(kind: str, messages: list[dict[str, str]]) -> str:
    goals = {
        "title": "Write a short title (three to five words, one emoji) for the conversation below.",
        "tags": "Suggest one to three broad tags and two to four specific ones for the conversation below.",
        "follow_ups": "Propose three to five questions the user might ask next, as a JSON list.",
    }
    return (f"### Task:\n{goals[kind]}\n### Guidelines:\n- Answer in the conversation's language.\n"
            f"- Keep it short.\n### Output:\nA JSON object and nothing else.\n### Chat History:\n"
            f"{history_block(messages)}")


def task_body(kind: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": task_prompt(kind, messages)}],
                            "stream": False}
    # The title task's max_tokens arrives as options.num_predict; the other tasks send none (see BOUNDED).
    return {**body, "options": {"num_predict": 1000}} if kind == "title" else {**body, **BOUNDED}


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    # OpenWebUI json.loads each line of the body.
    return [json.loads(line) for line in response.text.splitlines() if line]


CONVERSATION = [{"role": "user", "content": "How do I keep basil alive on a windowsill?"}]
# OpenWebUI sends no options unless the user set chat parameters; the random test model almost never ends on its own
# (it would write until the context is full), so requests without a limit get this one here.
BOUNDED: dict[str, Any] = {"options": {"num_predict": 24}}


def test_model_list_calls(client: httpx.Client) -> None:
    tags = client.get("/api/tags", headers=user_headers())
    assert tags.status_code == 200
    models = {m["model"]: m for m in tags.json()["models"] if "model" in m}  # keyed by `model`, as it does
    assert list(models) == [MODEL] and models[MODEL]["name"] == MODEL
    ps = client.get("/api/ps", headers=user_headers()).json()
    for entry in ps["models"]:
        datetime.fromisoformat(entry["expires_at"])  # its parse; a failure would only be logged, but still
    version = client.get("/api/version").json()["version"]
    assert tuple(map(int, re.sub(r"^v|-.*", "", version).split(".")))


def test_main_chat_request_with_builtin_tools(client: httpx.Client, keeper: Slotkeeper) -> None:
    chat_id = str(uuid.uuid4())
    body = {"model": MODEL, "messages": CONVERSATION, "stream": True, "tools": builtin_tools(), **BOUNDED}
    response = client.post("/api/chat", json=body, headers=chat_headers(chat_id))
    assert response.status_code == 200, response.text
    assert response.headers["x-slotkeeper-session"] == chat_id
    assert "x-slotkeeper-request" not in response.headers  # the conversation itself, not a side task
    lines = ndjson(response)
    assert lines[-1]["done"] is True and all(not line["done"] for line in lines[:-1])
    assert all(line["message"]["role"] == "assistant" for line in lines)


def test_main_chat_request_with_chat_parameters(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": CONVERSATION, "stream": True, "tools": builtin_tools(3),
            "options": {"num_predict": 8, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 3,
                        "num_ctx": 16384, "stop": ["\n\n\n"]},
            "keep_alive": "10m"}
    response = client.post("/api/chat", json=body, headers=chat_headers(str(uuid.uuid4())))
    assert response.status_code == 200
    assert response.headers["x-slotkeeper-ignored-options"] == "num_ctx"
    final = ndjson(response)[-1]
    assert final["done"] and final["eval_count"] <= 8


def test_root_level_num_predict_from_the_payload_converter(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": CONVERSATION, "stream": False, "num_predict": 3,
            "options": {"temperature": 0}}
    answer = client.post("/api/chat", json=body, headers=chat_headers(str(uuid.uuid4()))).json()
    assert answer["eval_count"] == 3


@pytest.mark.parametrize("kind", ["title", "tags", "follow_ups"])
def test_background_tasks_run_as_side_requests(client: httpx.Client, keeper: Slotkeeper, kind: str) -> None:
    chat_id = str(uuid.uuid4())
    history = [*CONVERSATION, {"role": "assistant", "content": "Give it sun and water it when dry."}]
    response = client.post("/api/chat", json=task_body(kind, history), headers=chat_headers(chat_id))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-slotkeeper-request"] == "side"
    assert response.headers["x-slotkeeper-session"] == chat_id
    answer = response.json()
    assert answer["done"] is True and answer["message"]["role"] == "assistant"
    assert wait_until(lambda: turn_log(keeper, chat_id))
    assert turn_log(keeper, chat_id)[0]["side"] == "yes"


def test_task_header_marks_a_side_request(client: httpx.Client) -> None:
    """The recommended connection headers: X-Session-Id: {{CHAT_ID}} and X-OpenWebUI-Task: {{TASK}}."""
    chat_id = str(uuid.uuid4())
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Autocomplete: how do I"}], "stream": False,
            "options": {"num_predict": 4}}
    response = client.post("/api/chat", json=body,
                           headers={"X-Session-Id": chat_id, "X-OpenWebUI-Task": "autocomplete_generation"})
    assert response.status_code == 200
    assert response.headers["x-slotkeeper-request"] == "side"
    assert response.headers["x-slotkeeper-session"] == chat_id
    main = client.post("/api/chat", json={**body, "stream": True}, headers={"X-Session-Id": chat_id,
                                                                            "X-OpenWebUI-Task": ""})
    assert main.status_code == 200 and "x-slotkeeper-request" not in main.headers


def test_title_task_alongside_the_first_message(client: httpx.Client, keeper: Slotkeeper) -> None:
    """On a new chat the title request arrives just before the main request and runs alongside it."""
    chat_id = str(uuid.uuid4())
    results: dict[str, int] = {}

    def send(name: str, body: dict[str, Any]) -> None:
        with httpx.Client(base_url=keeper.url, timeout=120) as c:
            response = c.post("/api/chat", json=body, headers=chat_headers(chat_id))
            results[name] = response.status_code
            if name == "main":
                assert ndjson(response)[-1]["done"] is True

    # The title's 1000-token limit is exercised above; here a smaller one keeps the test quick on a loaded machine.
    title_body = {**task_body("title", CONVERSATION), "options": {"num_predict": 64}}
    title = threading.Thread(target=send, args=("title", title_body))
    main = threading.Thread(target=send, args=("main", {"model": MODEL, "messages": CONVERSATION, "stream": True,
                                                        "tools": builtin_tools(), "options": {"num_predict": 8}}))
    title.start()
    main.start()
    title.join(120)
    main.join(120)
    assert results == {"title": 200, "main": 200}


def test_unload_button(client: httpx.Client, keeper: Slotkeeper) -> None:
    before = keeper.log_text().count("INFO slotkeeper.turn:")
    response = client.post("/api/generate", json={"model": MODEL, "keep_alive": 0, "prompt": ""},
                           headers=user_headers())
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    body = json.loads(response.text)  # one object, not a stream
    assert body["done"] is True and body["done_reason"] == "unload"
    assert keeper.log_text().count("INFO slotkeeper.turn:") == before


def test_errors_are_read_as_a_string_under_error(client: httpx.Client) -> None:
    response = client.post("/api/chat", json={"model": "gone:latest", "messages": CONVERSATION, "stream": True},
                           headers=chat_headers(str(uuid.uuid4())))
    assert not response.is_success
    assert response.json()["error"] == "model 'gone:latest' not found"
