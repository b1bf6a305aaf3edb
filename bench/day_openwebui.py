"""The `day` scenario's OpenWebUI chats under OpenWebUI's default settings: no chat id (no header, no body field) and
no system prompt, so a chat is known only by its messages. Two chats from tests/fixtures/clients/openwebui-default.json
(tests/openwebui_chats.py builds the requests): A opens with a pasted document (about 2,500 tokens; 300 at the CI
size), B is short, in the order A1 B1 A2 B2 A3. Around each turn the tasks OpenWebUI sends: a new chat's title task
30 ms before its first request (run_step's two-request step), follow-ups after every answer, tags after the first.
Every target gets them on /v1/chat/completions (OpenWebUI's OpenAI connection sends no chat id by default either;
its Ollama connection's /api/chat would not reach the direct targets), with the day's grammar and answer lengths.

Their turns are spread evenly over the rest of the day's steps, so the chats come back after other conversations
took the slot and, for the turns after the restart, after the restart.

Reported per target (`summary`): the side tasks' total time (every task of the day, and this part's), the chats'
time to first token (every chat's turns, and this part's), and this part's reuse efficiency."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.common import percentile
from tests.openwebui_chats import TASK_KINDS, steps

PREFIX = "owui-default-"
LABEL = "[day] "
ANSWER_SEED = 20261202


@dataclass(frozen=True)
class Part:
    """One request of the part: its kind, conversation and /v1/chat/completions body."""

    kind: str
    conversation: str
    body: dict[str, Any]


def part_steps(document: str, answer_tokens: tuple[int, int],
               chat_body: Callable[[list[dict[str, Any]], int, bool], dict[str, Any]]) -> list[list[list[Part]]]:
    """The part's steps, grouped by turn: each group is a turn's step (with the title task before a first turn)
    and the steps of the tasks after its answer."""
    rng = random.Random(ANSWER_SEED)
    groups: list[list[list[Part]]] = []
    for step in steps(document=document, label=LABEL):
        parts = [Part(ask.kind, PREFIX + ask.chat, chat_body(ask.messages, rng.randint(*answer_tokens), ask.stream))
                 for ask in step]
        if any(ask.kind == "chat" for ask in step):
            groups.append([])
        groups[-1].append(parts)
    return groups


def interleave(day: list[Any], groups: list[list[Any]]) -> list[Any]:
    """`day`'s steps with each group inserted whole, at evenly spaced places."""
    out = list(day)
    for i in reversed(range(len(groups))):
        at = round((i + 1) * len(day) / (len(groups) + 1))
        out[at:at] = groups[i]
    return out


def _stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95)} if values else {"n": 0}


def summary(mine: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's figures from its samples: the side tasks' total time and the chats' TTFT, of the whole day and
    of this part, and this part's efficiency (its steps hold nothing else, so their prefill is its own)."""
    ours = [s for s in mine if s["conversation"].startswith(PREFIX)]
    steps_prefilled = {s["step"]: s["step_prefilled"] for s in ours}
    prompt = sum(s["prompt_tokens"] for s in ours)
    shared = sum(s["shared_prefix"] for s in ours)
    prefilled = sum(steps_prefilled.values())

    def tasks_s(rows: list[dict[str, Any]]) -> float:
        return sum(s["total_ms"] for s in rows if s["kind"] in TASK_KINDS) / 1000

    def chat_ttft(rows: list[dict[str, Any]]) -> dict[str, float]:
        return _stats([s["ttft_ms"] for s in rows if s["kind"] == "chat" and s["status"] == 200])

    return {
        "side_tasks": {"n": sum(1 for s in mine if s["kind"] in TASK_KINDS), "total_s": tasks_s(mine)},
        "chat_ttft_ms": chat_ttft(mine),
        "openwebui_default": {
            "requests": len(ours), "prompt_tokens": prompt, "shared_prefix_tokens": shared, "prefilled": prefilled,
            "efficiency": (prompt - prefilled) / shared if shared else None,
            "side_tasks": {"n": sum(1 for s in ours if s["kind"] in TASK_KINDS), "total_s": tasks_s(ours)},
            "chat_ttft_ms": chat_ttft(ours),
        },
    }


def report_lines(r: dict[str, Any]) -> list[str]:
    """The day section's table of side tasks, chats and this part, per target."""
    s = r["summary"]["targets"]
    if not all("openwebui_default" in t for t in s.values()):
        return []
    doc = r["traffic"]["shape"].get("document_tokens")
    lines = [
        "", f"OpenWebUI with its default settings (`{PREFIX}*`: no chat id, no system prompt, one chat opening with a "
        f"pasted document of about {doc:,} tokens, A1 B1 A2 B2 A3 with their title, tags and follow-up tasks, spread "
        "over the day). *Side tasks* is the total response time of every title, tags and follow-up task (they are "
        "not streamed); *chats' TTFT* is over every chat turn. The part's *efficiency* is reused / shared over its own "
        "requests.", "",
        "| target | efficiency (day) | side tasks: n, total s | chats' TTFT p50 / p95 ms | part: efficiency "
        "| part: side tasks total s | part: chats' TTFT p50 / p95 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def pct(x: float | None) -> str:
        return f"{x * 100:.1f}%" if x is not None else ""

    def pp(x: dict[str, float]) -> str:
        return f"{x['p50']:,.0f} / {x['p95']:,.0f}" if x["n"] else ""

    for target, t in s.items():
        part = t["openwebui_default"]
        lines.append(f"| {target} | {pct(t['efficiency'])} | {t['side_tasks']['n']}, "
                     f"{t['side_tasks']['total_s']:,.1f} | {pp(t['chat_ttft_ms'])} | {pct(part['efficiency'])} "
                     f"| {part['side_tasks']['total_s']:,.1f} | {pp(part['chat_ttft_ms'])} |")
    return lines

