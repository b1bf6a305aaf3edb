"""Anthropic-shaped requests for the `system` and `agent` scenarios: a Claude-Code-like system prompt (system blocks,
tools, `<system-reminder>` instruction blocks in front of the first user message), one timed streamed
`POST /v1/messages`, and llama-server's own prefill counters.

llama-server answers /v1/messages itself, so every target gets the same Anthropic request. The generated model's
ChatML template does not render tools: they take part in slotkeeper's system-prompt key but cost no tokens, so the
system text carries the prompt's size."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support import words


@dataclass(frozen=True, slots=True)
class SystemPart:
    """What every conversation of one agent shares: system blocks, tools and the leading instruction blocks."""

    system: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    reminders: list[dict[str, Any]]

    def first_user(self, text: str) -> dict[str, Any]:
        return {"role": "user", "content": [*self.reminders, {"type": "text", "text": text}]}

    def prewarm_body(self) -> dict[str, Any]:
        """The file `slotkeeper prewarm` reads: the same system part, with a placeholder for the conversation."""
        return {"system": self.system, "tools": self.tools, "messages": [self.first_user(".")]}


# The generated model's tokenizer makes about 0.84 tokens of `words()` filler per character.
CHARS_PER_TOKEN = 1.19


def system_part(tokens: int, seed: int) -> SystemPart:
    """About `tokens` tokens of system prompt (90%) and reminders (10%), plus four tools."""
    chars = tokens * CHARS_PER_TOKEN
    system = [{"type": "text", "text": f"You are coding agent {seed}. " + words(int(chars * 0.9), seed),
               "cache_control": {"type": "ephemeral"}}]
    tools = [{"name": name, "description": f"{name}: " + words(200, seed + i),
              "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}
             for i, name in enumerate(("read_file", "edit_file", "run_command", "search"))]
    reminders = [{"type": "text", "text": f"<system-reminder>{words(int(chars * 0.05), seed + 10 + i)}"
                  "</system-reminder>"} for i in range(2)]
    return SystemPart(system, tools, reminders)


def messages_body(part: SystemPart, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {"model": "bench", "system": part.system, "tools": part.tools, "messages": messages,
            "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True}


@dataclass(frozen=True, slots=True)
class MessagesResult:
    """One streamed /v1/messages answer as the client saw it. `prefilled` and `reused` are the prompt tokens the
    backend evaluated and took from its cache (Anthropic's input_tokens and cache_read_input_tokens)."""

    ttft_ms: float
    total_ms: float
    deltas: int
    text: str
    prefilled: int
    reused: int
    cache_header: str | None


def stream_messages(client: httpx.Client, url: str, body: dict[str, Any], session: str | None = None) -> MessagesResult:
    """POST a streamed /v1/messages; TTFT is the first content_block_delta (the end of the stream if none came).

    llama-server reports the prompt's counts in message_start (sent after the prefill); slotkeeper sends
    message_start before the prefill and the counts in message_delta, so the last counts seen are taken."""
    t0 = time.perf_counter()
    first: float | None = None
    deltas, text, usage = 0, [], {}
    headers = {"X-Session-Id": session} if session else {}
    with client.stream("POST", f"{url}/v1/messages", json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
        header = response.headers.get("x-slotkeeper-cache")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event.get("type")
            if kind == "error":
                raise RuntimeError(f"{url}: error event {event}")
            if kind == "content_block_delta":
                deltas += 1
                first = first or time.perf_counter()
                text.append(str(event["delta"].get("text", "")))
            found = event.get("usage") or (event.get("message") or {}).get("usage") or {}
            if "input_tokens" in found and found["input_tokens"] + found.get("cache_read_input_tokens", 0) > 0:
                usage = found
    end = time.perf_counter()
    return MessagesResult(((first or end) - t0) * 1000, (end - t0) * 1000, deltas, "".join(text),
                          int(usage.get("input_tokens", -1)), int(usage.get("cache_read_input_tokens", -1)), header)


@dataclass(frozen=True, slots=True)
class PrefillCounters:
    """llama-server's running totals (`/metrics`, with --metrics): prompt tokens evaluated and taken from cache,
    and seconds spent evaluating prompts."""

    prefilled: int
    reused: int
    seconds: float

    def __sub__(self, other: PrefillCounters) -> PrefillCounters:
        return PrefillCounters(self.prefilled - other.prefilled, self.reused - other.reused,
                               self.seconds - other.seconds)


def prefill_counters(client: httpx.Client, backend_url: str) -> PrefillCounters:
    try:
        text = client.get(f"{backend_url}/metrics").text
    except httpx.RemoteProtocolError:  # a pooled keep-alive connection the server had closed: ask again
        text = client.get(f"{backend_url}/metrics").text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, _, value = line.partition(" ")
            values[name.removeprefix("llamacpp:")] = float(value)
    return PrefillCounters(int(values["prompt_tokens_total"]), int(values["prompt_tokens_cached_total"]),
                           values["prompt_seconds_total"])
