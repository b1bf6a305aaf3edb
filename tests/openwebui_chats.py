"""OpenWebUI's chats under its default settings (tests/fixtures/clients/openwebui-default.json), as the sequence of
requests it sends: no chat id, no system prompt, and around each turn the background tasks it runs (a new chat's
title task racing its first request; follow-ups after every answer, tags after the first). Shared by
tests/integration/test_openwebui_default.py (through the official `ollama` client) and the `day` benchmark (on
/v1/chat/completions). The answers sent back are the fixture's, the same for every target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.client_fixtures import expand, load

FIXTURE = "openwebui-default"
TASK_KINDS = ("title", "tags", "follow_ups")


@dataclass(frozen=True)
class Ask:
    """One request: a chat's turn (`kind` "chat", streamed) or one of its tasks (one user message, not streamed)."""

    kind: str
    chat: str
    turn: int  # the chat's turn it belongs to, from 0
    messages: list[dict[str, str]]
    stream: bool

    @property
    def what(self) -> str:
        return f"{self.chat}{self.turn + 1}" + ("" if self.kind == "chat" else f" {self.kind}")


# A step is one request, or a new chat's title task and the chat's first turn sent just after it.
Step = list[Ask]


def quoted(fixture: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """The chat history as a task template quotes it: `ROLE: content`, one message per line."""
    return "\n".join(expand(fixture["quote"], {"ROLE": m["role"].upper(), "CONTENT": m["content"]}) for m in messages)


def task_prompt(fixture: dict[str, Any], kind: str, history: list[dict[str, str]]) -> str:
    spec = fixture["tasks"][kind]
    return str(expand(spec["template"], {"MESSAGES": quoted(fixture, history[-spec["last"]:])}))


def steps(fixture: dict[str, Any] | None = None, document: str | None = None, label: str = "") -> list[Step]:
    """The fixture's chats in its order (A1 B1 A2 B2 A3), each turn with the tasks OpenWebUI sends around it.
    `document` replaces the fixture's pasted document (a smaller one for a short run); `label` is put in front of
    each chat's first message, so that two runs in one process are different chats."""
    fixture = fixture or load(FIXTURE)
    names = {"DOCUMENT": document if document is not None else str(expand(fixture["document"], {}))}
    histories: dict[str, list[dict[str, str]]] = {}
    turns: dict[str, int] = {}
    out: list[Step] = []
    for chat in fixture["order"]:
        spec = fixture["chats"][chat]
        turn = turns.get(chat, 0)
        turns[chat] = turn + 1
        history = histories.setdefault(chat, [])
        text = str(expand(spec["user"][turn], names))
        history.append({"role": "user", "content": (label + text) if turn == 0 else text})
        around = fixture["around_a_turn"]["first" if turn == 0 else "later"]
        before = [Ask(kind, chat, turn, [{"role": "user", "content": task_prompt(fixture, kind, history)}], False)
                  for kind in around["before"]]
        out.append([*before, Ask("chat", chat, turn, [dict(m) for m in history], True)])
        history.append({"role": "assistant", "content": str(expand(spec["assistant"][turn], names))})
        out += [[Ask(kind, chat, turn, [{"role": "user", "content": task_prompt(fixture, kind, history)}], False)]
                for kind in around["after"]]
    return out
