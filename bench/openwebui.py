"""An OpenWebUI-like chat for the `agent` scenario: streamed turns on /v1/chat/completions under the chat's id
(`X-OpenWebUI-Chat-Id`), and the background tasks OpenWebUI sends under the same id after a reply: a title and tags
after the first one, follow-up suggestions after each. Tasks are not streamed and are one user message starting
with `### Task:` that quotes the latest messages (OpenWebUI's templates use `{{MESSAGES:END:2}}` for the title and
`{{MESSAGES:END:6}}` for tags and follow-ups; here each quoted message is cut to 500 characters)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support import words

CHAT_HEADER = "X-OpenWebUI-Chat-Id"
TASKS = {
    "title": ("Generate a concise, 3-5 word title with an emoji summarizing the chat history.", 2),
    "tags": ("Generate 1-3 broad tags categorizing the main themes of the chat history.", 6),
    "follow_ups": ("Suggest 3-5 relevant follow-up questions the user might naturally ask next.", 6),
}


@dataclass
class Chat:
    """The chat's history; `turn_messages` is what the next streamed turn sends."""

    chat_id: str
    document_tokens: int
    seed: int
    messages: list[dict[str, str]] = field(default_factory=list)

    def next_turn(self) -> list[dict[str, str]]:
        if not self.messages:
            text = f"Please review this document. {words(self.document_tokens, self.seed)} What stands out?"
        else:
            text = words(60, self.seed + len(self.messages))
        self.messages.append({"role": "user", "content": text})
        return list(self.messages)

    def answered(self) -> None:
        """The assistant's reply as the next request carries it (fixed text, the same for every target)."""
        self.messages.append({"role": "assistant", "content": words(40, self.seed + 500 + len(self.messages))})

    def tasks_after_reply(self) -> list[str]:
        return ["title", "tags", "follow_ups"] if len(self.messages) == 2 else ["follow_ups"]

    def task_messages(self, task: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": task_content(task, self.messages)}]


def task_content(task: str, said: list[dict[str, Any]]) -> str:
    """The one user message of an OpenWebUI task: its instruction, then the last messages of `said` (the chat's
    messages without its system prompt) that the task's template quotes."""
    instruction, last = TASKS[task]
    history = "\n".join(f"{m['role'].upper()}: {m['content'][:500]}" for m in said[-last:])
    return f"### Task:\n{instruction}\n### Chat History:\n<chat_history>\n{history}\n</chat_history>"


@dataclass(frozen=True, slots=True)
class UnaryResult:
    total_ms: float
    prompt_n: int
    cache_n: int
    cache_header: str | None
    request_kind: str | None  # X-Slotkeeper-Request: "side" when slotkeeper took it for a side task


def side_task(client: httpx.Client, url: str, messages: list[dict[str, str]], chat_id: str,
              max_tokens: int) -> UnaryResult:
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "stream": False, "temperature": 0}
    started = time.perf_counter()
    response = client.post(f"{url}/v1/chat/completions", json=body, headers={CHAT_HEADER: chat_id})
    total = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
    timings = response.json().get("timings") or {}
    return UnaryResult(total, int(timings.get("prompt_n", -1)), int(timings.get("cache_n", -1)),
                       response.headers.get("x-slotkeeper-cache"), response.headers.get("x-slotkeeper-request"))
