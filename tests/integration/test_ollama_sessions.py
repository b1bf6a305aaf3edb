"""Sessions through the Ollama API against real llama.cpp servers (the binary and the embedded one): an OpenWebUI chat
reuses its cache from turn to turn, its background tasks do not take that away, and a backend that dies mid-answer
reaches the official client as an error.

Reuse is read from slotkeeper's per-request log line (`cache_n=`) and the X-Slotkeeper-Cache header, because the
Ollama answer itself only reports the whole prompt (`prompt_eval_count` = cached + new)."""

from __future__ import annotations

import json
import signal
import uuid
from typing import Any

import httpx
import ollama
import pytest

from tests.conftest import Stack
from tests.support import SYSTEM, Slotkeeper, turn_log, wait_until, words

pytestmark = pytest.mark.backend


class OllamaChat:
    """An OpenWebUI conversation over /api/chat: each turn streams the whole history plus one new user message."""

    def __init__(self, client: httpx.Client, keeper: Slotkeeper, size: int = 600) -> None:
        self.client = client
        self.keeper = keeper
        self.chat_id = str(uuid.uuid4())
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": words(size, 1)}]
        self.seed = 1
        self.requests = 0  # of this chat, turns and tasks: how many log lines to wait for

    @property
    def headers(self) -> dict[str, str]:
        return {"X-OpenWebUI-Chat-Id": self.chat_id, "X-OpenWebUI-User-Id": "u1"}

    def turn(self) -> tuple[httpx.Response, dict[str, Any], dict[str, str]]:
        """Returns the response, its final NDJSON line and slotkeeper's log line for it."""
        body = {"model": "tiny:latest", "messages": self.messages, "options": {"num_predict": 4, "temperature": 0}}
        response = self.client.post("/api/chat", json=body, headers=self.headers)
        assert response.status_code == 200, response.text
        lines = [json.loads(line) for line in response.text.splitlines()]
        final = lines[-1]
        assert final["done"] is True
        self.seed += 1
        answer = "".join(line["message"]["content"] for line in lines)
        self.messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": words(40, self.seed)}]
        self.requests += 1
        # A streamed turn's log line is written when the stream closes, just after the client has its last byte.
        assert wait_until(lambda: len(turn_log(self.keeper, self.chat_id)) == self.requests)
        return response, final, [r for r in turn_log(self.keeper, self.chat_id) if r["side"] == "no"][-1]

    def task(self, by_header: bool) -> httpx.Response:
        history = "\n".join(f"{m['role'].upper()}: {m['content'][:200]}" for m in self.messages[1:])
        prompt = (f"### Task:\nTitle this chat in a few words.\n### Chat History:\n<chat_history>\n{history}\n"
                  "</chat_history>")
        body = {"model": "tiny:latest", "messages": [{"role": "user", "content": prompt}], "stream": False,
                "options": {"num_predict": 8}}
        headers = {**self.headers, "X-OpenWebUI-Task": "title_generation"} if by_header else self.headers
        if by_header:
            body["stream"] = True  # the header alone marks it, whatever its shape
        self.requests += 1
        return self.client.post("/api/chat", json=body, headers=headers)


def test_turn_two_reuses_turn_one(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend())
    conv = OllamaChat(client_for(keeper), keeper)
    first, final1, log1 = conv.turn()
    assert first.headers["x-slotkeeper-session"] == conv.chat_id
    assert first.headers["x-slotkeeper-cache"] == "cold"
    assert final1["prompt_eval_count"] == int(log1["cache_n"]) + int(log1["prompt_n"])

    second, final2, log2 = conv.turn()
    assert second.headers["x-slotkeeper-cache"] == "hot"
    # prompt_eval_count stays the whole prompt; the backend served turn 1's part of it from the cache.
    assert final2["prompt_eval_count"] == int(log2["cache_n"]) + int(log2["prompt_n"])
    assert final2["prompt_eval_count"] > final1["prompt_eval_count"]
    assert int(log2["cache_n"]) >= final1["prompt_eval_count"], (log2, final1)
    assert int(log2["prompt_n"]) < 80  # only the new messages were prefilled


@pytest.mark.parametrize("by_header", [False, True], ids=["task-prompt", "task-header"])
def test_title_task_between_turns_does_not_cost_turn_one(stack: Stack, client_for, by_header: bool) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    conv = OllamaChat(client_for(keeper), keeper)
    _, final1, _ = conv.turn()

    task = conv.task(by_header)
    assert task.status_code == 200
    assert task.headers["x-slotkeeper-request"] == "side"
    assert task.headers["x-slotkeeper-session"] == conv.chat_id
    row = keeper.row(conv.chat_id)
    assert row is not None and row["n_tokens"] >= final1["prompt_eval_count"]  # saved before the task ran

    second, final2, log2 = conv.turn()
    assert second.headers["x-slotkeeper-cache"] == "restored"
    assert int(log2["cache_n"]) >= final1["prompt_eval_count"], (log2, final1)
    assert final2["prompt_eval_count"] == int(log2["cache_n"]) + int(log2["prompt_n"])
    assert [r["side"] for r in turn_log(keeper, conv.chat_id)] == ["no", "yes", "no"]


def test_backend_killed_mid_stream_gives_the_client_a_response_error(stack: Stack, client_for) -> None:
    backend = stack.backend()
    keeper = stack.slotkeeper(backend)
    client = ollama.Client(host=keeper.url, headers={"X-Session-Id": "doomed"}, timeout=60)
    parts = client.chat(model="tiny", messages=[{"role": "user", "content": "long"}], stream=True,
                        options={"num_predict": 3000, "temperature": 0})
    with pytest.raises(ollama.ResponseError) as info:
        for i, _ in enumerate(parts):
            if i == 2:
                backend.stop(signal.SIGKILL)
    assert "backend" in info.value.error
    # Nothing is saved from a slot whose state is unknown, and slotkeeper itself stays up.
    assert keeper.row("doomed") is None
    assert keeper.process is not None and keeper.process.poll() is None
    assert client_for(keeper).get("/health").status_code == 503
    assert wait_until(lambda: any(r["end"] == "failed" for r in turn_log(keeper, "doomed")))
