"""The `day` scenario's traffic (bench/day.py says what it is): the day's requests, generated deterministically and
the same on every call, then each one's prompt tokens and S_i, the longest token prefix it shares with any earlier
request's prompt, as a scratch llama-server renders and tokenizes them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench import day_openwebui
from bench.agent import AgentSession
from bench.common import GRAMMAR, BenchConfig
from bench.messages import CHARS_PER_TOKEN, system_part
from bench.openwebui import task_content
from tests.support import words


@dataclass
class Request:
    """One request of the day: its route, body, and the chat body that renders to the same prompt."""

    kind: str
    conversation: str
    api: str  # "chat" (/v1/chat/completions) or "messages" (/v1/messages)
    body: dict[str, Any]
    render: dict[str, Any]
    tokens: list[int] = field(default_factory=list)
    shared: int = 0  # S_i: longest token prefix shared with any earlier request's prompt
    headers: dict[str, str] = field(default_factory=dict)  # what the client sends beside the body (a chat id)


# A step is one request, or a new chat's title task and, 30 ms after it, the chat's first turn.
Step = list[Request]


@dataclass(frozen=True)
class Shape:
    chats: int
    chat_turns: int
    owui_tokens: int
    first_message_tokens: int
    agent_tokens: int
    agent_turns: int
    subagent_turns: int
    claude_turns: int
    result_tokens: int
    answer_tokens: tuple[int, int]  # each answer's length is drawn from this range
    document_tokens: int  # the document pasted into the first message of an OpenWebUI default-settings chat


def shape(config: BenchConfig) -> Shape:
    if config.small:
        return Shape(chats=3, chat_turns=2, owui_tokens=300, first_message_tokens=80, agent_tokens=500,
                     agent_turns=2, subagent_turns=1, claude_turns=2, result_tokens=80, answer_tokens=(4, 6),
                     document_tokens=300)
    return Shape(chats=4, chat_turns=3, owui_tokens=1500, first_message_tokens=200, agent_tokens=3000,
                 agent_turns=6, subagent_turns=3, claude_turns=4, result_tokens=300, answer_tokens=(8, 12),
                 document_tokens=2500)


def chat_body(messages: list[dict[str, Any]], max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "stream": stream,
                            "temperature": 0, "ignore_eos": True, "grammar": GRAMMAR}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def filler(tokens: int, seed: int) -> str:
    """About `tokens` tokens of filler text, the same for the same seed."""
    return words(int(tokens * CHARS_PER_TOKEN), seed)


def anthropic_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body llama-server renders a /v1/messages body as: system blocks as a system message, text blocks as
    content parts, tool_use as tool_calls, tool_result as tool messages (checked against its input_tokens +
    cache_read_input_tokens, see `prompt_check` in the results)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "\n".join(b["text"] for b in body["system"])}]
    for m in body["messages"]:
        blocks = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        texts = [{"type": "text", "text": b["text"]} for b in blocks if b["type"] == "text"]
        calls = [{"id": b["id"], "type": "function",
                  "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
                 for b in blocks if b["type"] == "tool_use"]
        for b in blocks:
            if b["type"] == "tool_result":
                messages.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": b["content"]})
        if m["role"] == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": "\n".join(t["text"] for t in texts)}
            if calls:
                out["tool_calls"] = calls
            messages.append(out)
        elif texts:
            messages.append({"role": m["role"], "content": texts})
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in body.get("tools", [])]
    return {"messages": messages, "tools": tools}


def traffic(config: BenchConfig) -> list[Step]:
    """The day's steps, the same on every call."""
    s = shape(config)
    rng = random.Random(20261201)

    def answer() -> int:
        return rng.randint(*s.answer_tokens)

    owui_system = "You are a helpful assistant in OpenWebUI. " + filler(s.owui_tokens, 61)
    tool_text = "\n".join(f"- {name}(arg: string): " + filler(60, 70 + i)
                          for i, name in enumerate(("read_file", "edit_file", "run_command", "search", "task")))
    agent_system = (f"You are a coding agent working in a repository.\n# Tools\n{tool_text}\n# Rules\n"
                    + filler(max(0, s.agent_tokens - 400), 81))
    chats: dict[str, list[dict[str, Any]]] = {}
    agents: dict[str, list[dict[str, Any]]] = {}
    claude = AgentSession(system_part(s.agent_tokens, 909), "day-claude", 100, s.result_tokens)

    def chat_steps(name: str, k: int) -> list[Step]:
        history = chats.setdefault(name, [{"role": "system", "content": owui_system}])
        n = len(history)
        if n == 1:
            text = f"Chat {k}: please look at this. " + filler(s.first_message_tokens, 100 + k) + " What now?"
        else:
            text = filler(60, 1000 * k + n)
        history.append({"role": "user", "content": text})
        main = Request("chat", name, "chat", chat_body(list(history), answer(), True), {})
        steps: list[Step] = []
        if n == 1:
            steps.append([task("title", name, history), main])
        else:
            steps.append([main])
        history.append({"role": "assistant", "content": filler(40, 2000 * k + n)})
        if n == 1 and rng.random() < 0.75:
            steps.append([task("tags", name, history)])
        if rng.random() < 0.5:
            steps.append([task("follow_ups", name, history)])
        return steps

    def task(kind: str, name: str, history: list[dict[str, Any]]) -> Request:
        content = task_content(kind, history[1:])
        return Request(kind, name, "chat", chat_body([{"role": "user", "content": content}], answer(), False), {})

    def agent_step(name: str, kind: str, seed: int) -> Step:
        history = agents.setdefault(name, [{"role": "system", "content": agent_system}])
        if len(history) == 1:
            history.append({"role": "user", "content": f"{name}: fix the failing test. " + filler(120, seed)})
        else:
            n = len(history)
            call = f"call_{name}_{n}"
            history += [
                {"role": "assistant", "content": filler(30, seed + n),
                 "tool_calls": [{"id": call, "type": "function",
                                 "function": {"name": "read_file", "arguments": json.dumps({"arg": f"src/m{n}.py"})}}]},
                {"role": "tool", "tool_call_id": call, "content": filler(s.result_tokens, seed + 500 + n)},
            ]
        return [Request(kind, name, "chat", chat_body(list(history), answer(), True), {})]

    def claude_step() -> Step:
        if claude.messages:
            claude.answered()
        body = claude.request(answer())
        body["messages"] = json.loads(json.dumps(body["messages"]))
        body["grammar"] = GRAMMAR
        return [Request("claude-code", "claude-code", "messages", body, anthropic_as_chat(body))]

    # Which conversation speaks next: an interleaving of every conversation's turns, the subagent's turns right
    # after the first agent's third (the parent waits for it).
    labels = ([f"chat-{k}" for k in range(s.chats) for _ in range(s.chat_turns)]
              + ["agent-1"] * s.agent_turns + ["agent-2"] * s.agent_turns + ["claude-code"] * s.claude_turns)
    rng.shuffle(labels)
    steps: list[Step] = []
    agent_turns = 0
    for label in labels:
        if label.startswith("chat-"):
            k = int(label.removeprefix("chat-"))
            steps += chat_steps(label, k)
        elif label == "claude-code":
            steps.append(claude_step())
        else:
            steps.append(agent_step(label, "agent", 3000 if label == "agent-1" else 4000))
            if label == "agent-1":
                agent_turns += 1
                if agent_turns == min(3, s.agent_turns):
                    steps += [agent_step("subagent", "subagent", 5000) for _ in range(s.subagent_turns)]
    groups = day_openwebui.part_steps(filler(s.document_tokens, 91), s.answer_tokens, chat_body)
    steps = day_openwebui.interleave(steps, [[[Request(p.kind, p.conversation, "chat", p.body, {}) for p in step]
                                              for step in group] for group in groups])
    for step in steps:
        for r in step:
            if r.api == "chat":
                r.render = {"messages": r.body["messages"]}
    return steps


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # the longest n with a[:n] == b[:n]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tokenize(client: httpx.Client, url: str, steps: list[Step]) -> None:
    """Each request's prompt tokens and S_i, in the order the requests are sent."""
    seen: list[tuple[int, ...]] = []
    for step in steps:
        for r in step:
            prompt = client.post(f"{url}/apply-template", json=r.render)
            prompt.raise_for_status()
            tokens = client.post(f"{url}/tokenize", json={"content": prompt.json()["prompt"], "add_special": True})
            tokens.raise_for_status()
            r.tokens = list(tokens.json()["tokens"])
            mine = tuple(r.tokens)
            r.shared = max((_common_prefix(mine, other) for other in seen), default=0)
            seen.append(mine)
