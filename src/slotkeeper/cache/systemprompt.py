"""System prompts as cache keys: the part of a chat request that comes before the conversation.

The part is the leading system (or developer) messages, the tools, and the instruction blocks that agents put in
front of the first user message (Claude Code's `<system-reminder>` blocks: every block of that message but the
last, when it has several and they are all text). It is the same in every turn of a conversation, so turn 1 and
turn N hash alike; the hash is sha256 over canonical JSON (key order and `cache_control` do not change it).

Pure functions over the backend's own (OpenAI-style) request body; no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slotkeeper.cache.chain import Link, canonical_json, message_chain

_SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True, slots=True)
class SystemPrompt:
    """What a system snapshot holds: the leading messages, tools and instruction blocks of a chat request."""

    digest: str  # sha256 hex of the canonical JSON: the snapshot's key inside a model's namespace
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...]
    instructions: tuple[Mapping[str, Any], ...]
    chars: int  # characters of canonical JSON: a rough size, to skip prompts too short to be worth a snapshot

    @property
    def n_messages(self) -> int:
        """How many leading messages of a request this part covers (the system messages only: the first user
        message is shared only in part)."""
        return len(self.messages)

    @property
    def short_id(self) -> str:
        return self.digest[:12]

    def warmup_messages(self) -> list[dict[str, Any]]:
        """The messages of the warm-up request: the system part and a user message holding only the instructions."""
        user: dict[str, Any] = {"role": "user", "content": [dict(b) for b in self.instructions] or ""}
        return [dict(m) for m in self.messages] + [user]

    def warmup_body(self, slot_id: int, *, progress: bool = False) -> dict[str, Any]:
        """A request that evaluates the system part into slot `slot_id` and generates (almost) nothing.

        llama-server treats max_tokens 0 as "evaluate the prompt only"; some builds still sample one token, which
        the slot does not keep (a save holds the prompt plus generated tokens minus one).
        """
        body: dict[str, Any] = {"messages": self.warmup_messages(), "max_tokens": 0, "id_slot": slot_id,
                                "cache_prompt": True, "stream": progress}
        if self.tools:
            body["tools"] = [dict(t) for t in self.tools]
        if progress:
            body["return_progress"] = True
        return body

    def template_body(self, marker: str) -> dict[str, Any]:
        """A /apply-template request for the system part followed by a user message ending in `marker`: two of
        them with different markers render to a common prefix that every conversation on this system part starts
        with, up to where its first user message's own text begins (see `warmup_prompt_body`)."""
        last = {"type": "text", "text": marker}
        content: Any = [dict(b) for b in self.instructions] + [last] if self.instructions else marker
        body: dict[str, Any] = {"messages": [dict(m) for m in self.messages] + [{"role": "user", "content": content}]}
        if self.tools:
            body["tools"] = [dict(t) for t in self.tools]
        return body

    def chain(self) -> list[Link]:
        """The message chain of the warm-up request, recorded with its snapshot: the system messages, then the
        instruction blocks as a user message of their own (when there are any)."""
        if not self.instructions:
            return message_chain(list(self.messages), list(self.tools) or None)
        return message_chain(self.warmup_messages(), list(self.tools) or None)

    def without_instructions(self) -> SystemPrompt:
        """The part without the instruction blocks of the first user message: what a conversation's state is cut
        back to (agents move those blocks between messages and change them from one run to the next)."""
        if not self.instructions:
            return self
        return _part(self.messages, self.tools, ())


def system_prompt_of(body: Mapping[str, Any]) -> SystemPrompt | None:
    """The system part of an upstream chat body, or None when it has no system message and no tools."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    leading: list[Mapping[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in _SYSTEM_ROLES:
            break
        leading.append(message)
    raw_tools = body.get("tools")
    tools = tuple(t for t in raw_tools if isinstance(t, Mapping)) if isinstance(raw_tools, list) else ()
    if not leading and not tools:
        return None
    rest = messages[len(leading):]
    instructions = _instruction_blocks(rest[0]) if rest else ()
    return _part(tuple(leading), tools, instructions)


def _part(leading: tuple[Mapping[str, Any], ...], tools: tuple[Mapping[str, Any], ...],
          instructions: tuple[Mapping[str, Any], ...]) -> SystemPrompt:
    canonical = canonical_json({"system": list(leading), "tools": list(tools), "instructions": list(instructions)})
    digest = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
    return SystemPrompt(digest, leading, tools, instructions, len(canonical))


def _instruction_blocks(message: object) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(message, Mapping) or message.get("role") != "user":
        return ()
    content = message.get("content")
    if not isinstance(content, Sequence) or isinstance(content, str) or len(content) < 2:
        return ()
    blocks = list(content)
    if not all(isinstance(b, Mapping) and b.get("type") == "text" for b in blocks):
        return ()
    return tuple(blocks[:-1])


def warmup_prompt_body(prompt: str, slot_id: int, *, progress: bool = False) -> dict[str, Any]:
    """A /completion request that evaluates `prompt` (the rendered common prefix of a system part) into slot
    `slot_id` and generates nothing. A state of exactly that prefix is one that every new conversation on it
    strictly extends, which a recurrent or hybrid model on a build without checkpoints in slot files needs."""
    body: dict[str, Any] = {"prompt": prompt, "n_predict": 0, "id_slot": slot_id, "cache_prompt": True,
                            "stream": progress}
    if progress:
        body["return_progress"] = True
    return body


def common_prefix_text(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]
