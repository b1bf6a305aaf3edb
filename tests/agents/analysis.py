"""What an agent's recorded requests show that matters for caching: the session signals it sends (headers, body
fields), its system prompts and their sizes, its side requests (a system prompt other than the conversation's main
one, under the same turn), and how a conversation's messages change from one request to the next."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, defaultdict
from typing import Any

import httpx

from tests.agents.proxy import Record
from tests.agents.runner import SequenceResult, chat_form, is_generation, route

SESSION_HEADER = re.compile(r"session|conversation|thread|affinity|chat-id|agent-id|request-class|window-id|"
                            r"turn-metadata|x-claude-code", re.IGNORECASE)
SESSION_FIELDS = ("session_id", "conversation_id", "chat_id", "id", "prompt_cache_key", "user", "previous_response_id")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _system(chat: dict[str, Any]) -> str:
    """The leading system messages' text (a chat form's system part)."""
    texts = []
    for message in chat["messages"]:
        if message.get("role") not in ("system", "developer"):
            break
        texts.append(_text(message.get("content")))
    return "\n".join(texts)


def _first_user(chat: dict[str, Any]) -> str:
    return next((_text(m.get("content")) for m in chat["messages"] if m.get("role") == "user"), "")


def _fingerprint(text: str, tools: Any) -> str:
    return hashlib.sha256((text + json.dumps(tools, sort_keys=True)).encode()).hexdigest()[:10]


def session_signals(record: Record) -> dict[str, Any]:
    """The record's headers and body fields that could name its conversation."""
    found: dict[str, Any] = {k: v[:200] for k, v in record.headers.items() if SESSION_HEADER.search(k)}
    body = record.body if isinstance(record.body, dict) else {}
    for name in SESSION_FIELDS:
        if name in body:
            found[f"body.{name}"] = body[name]
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and "user_id" in metadata:
        found["body.metadata.user_id"] = metadata["user_id"]
    return found


def diff(previous: list[dict[str, Any]], current: list[dict[str, Any]]) -> str:
    """How `current` messages differ from `previous`: appended, or changed from message k on (and how)."""
    for k, (a, b) in enumerate(zip(previous, current, strict=False)):
        if a != b:
            what = "content" if a.get("role") == b.get("role") else "role"
            ta, tb = _text(a.get("content")), _text(b.get("content"))
            detail = f"{len(ta)} -> {len(tb)} chars" if what == "content" else f"{a.get('role')} -> {b.get('role')}"
            if what == "content" and isinstance(a.get("content"), list) != isinstance(b.get("content"), list):
                detail += " (parts <-> string)"
            return (f"rewritten at message {k} ({a.get('role')}, {what}: {detail}); {len(previous)} -> "
                    f"{len(current)} messages")
    if len(current) == len(previous):
        return "the same messages again (a retry)"
    if len(current) > len(previous):
        return f"appended {len(current) - len(previous)} message(s)"
    return f"dropped the last {len(previous) - len(current)} message(s)"


def describe(result: SequenceResult, client: httpx.Client, backend_url: str) -> dict[str, Any]:
    """A summary of the recorded sequence for people: per distinct system prompt (with its tools), how many
    requests, in which turns, its size, the first 200 characters of its system and first user message, the session
    signals it carried, and whether it is a conversation's main prompt or a side request's; and per conversation and
    system prompt, what changed between consecutive requests."""
    through_slotkeeper = result.target.startswith("slotkeeper")
    systems: dict[str, dict[str, Any]] = {}
    per_conversation: list[tuple[str, str, int]] = []
    changes: dict[str, list[str]] = defaultdict(list)
    last: dict[tuple[str, str], list[dict[str, Any]]] = {}
    other_routes: Counter[str] = Counter()
    for record in result.records:
        if not is_generation(record):
            other_routes[f"{record.method} {route(record)} {record.status}"] += 1
            continue
        chat = chat_form(record, through_slotkeeper)
        if chat is None:
            other_routes[f"{record.method} {route(record)} {record.status}"] += 1
            continue
        system = _system(chat)
        key = _fingerprint(system, chat.get("tools"))
        per_conversation.append((record.turn[:1], key, record.index))
        if key not in systems:
            tokens = 0
            if system:
                rendered = client.post(f"{backend_url}/tokenize", json={"content": system, "add_special": False})
                tokens = len(rendered.json()["tokens"]) if rendered.status_code == 200 else -1
            systems[key] = {"route": route(record), "system_chars": len(system), "system_tokens": tokens,
                            "tools": len(chat.get("tools") or []), "requests": 0, "turns": [],
                            "system_head": system[:200], "first_user_head": _first_user(chat)[:200],
                            "session_signals": session_signals(record), "max_tokens_asked": Counter()}
        entry = systems[key]
        entry["requests"] += 1
        if record.turn not in entry["turns"]:
            entry["turns"].append(record.turn)
        for name, (asked, _sent) in record.capped.items():
            entry["max_tokens_asked"][f"{name}={asked}"] += 1
        conversation = record.turn[:1]
        previous = last.get((conversation, key))
        if previous is not None:
            change = diff(previous, chat["messages"])
            changes[f"{conversation} {key}"].append(f"#{record.index} {record.turn}: {change}")
        last[(conversation, key)] = chat["messages"]
    # A conversation's main system prompt is the one of its longest prompt (side requests, titles and memory
    # extraction, are shorter than the agent's own turns); any other is a side request's.
    size = {m.index: m.prompt_tokens for m in result.measured}
    longest: dict[str, tuple[int, str]] = {}
    for conv, key, index in per_conversation:
        n = size.get(index, len(json.dumps(result.records[index].body)))
        if conv not in longest or n > longest[conv][0]:
            longest[conv] = (n, key)
    main = {key for _n, key in longest.values()}
    for key, entry in systems.items():
        entry["kind"] = "main" if key in main else "side"
        entry["max_tokens_asked"] = dict(entry["max_tokens_asked"])
    return {"system_prompts": systems, "changes": dict(changes), "other_routes": dict(other_routes)}
