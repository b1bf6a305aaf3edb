"""Message chains: one hash per message position, each covering the tools and every message up to it.

Two requests share a chain prefix exactly when they share the rendered prompt up to that message, so the longest
common chain prefix between a request and a snapshot says how much of the snapshot a restore can reuse.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Keys that never change what the model sees (prompt-caching hints of other APIs).
_IGNORED_KEYS = frozenset({"cache_control"})


@dataclass(frozen=True, slots=True)
class Link:
    """Chain position i: the hash of tools + messages[0..i], and the prompt characters up to and including it."""

    digest: str
    chars: int


def message_chain(messages: Sequence[Any], tools: Any = None) -> list[Link]:
    """The chain of an OpenAI-style message list (the backend's own format, whatever the client's dialect)."""
    running = hashlib.sha256(b"slotkeeper-chain-v1\0")
    running.update(canonical_json(tools).encode("utf-8", "surrogatepass"))
    return _links(running, messages)


def _links(running: Any, items: Sequence[Any]) -> list[Link]:
    """One link per item: the running hash over the items so far, and their characters in canonical JSON."""
    links: list[Link] = []
    chars = 0
    for item in items:
        text = canonical_json(item)
        chars += len(text)
        running.update(b"\0")
        running.update(text.encode("utf-8", "surrogatepass"))
        links.append(Link(running.copy().hexdigest()[:32], chars))
    return links


def infill_chain(body: Mapping[str, Any]) -> list[Link]:
    """The chain of a llama-server /infill request, in the order the backend lays its prompt out: the extra context
    (`input_extra` chunks), the text before the cursor (`input_prefix`), the cursor's line up to it (`prompt`), then
    the text after it (`input_suffix`). A request that keeps the extra context and the file before the cursor shares
    two positions with the last one; a request in another file, only the first. Seeded apart from message chains,
    so an infill never matches a chat."""
    parts = (body.get("input_extra") or [], body.get("input_prefix", ""), body.get("prompt", ""),
             body.get("input_suffix", ""))
    return _links(hashlib.sha256(b"slotkeeper-infill-v1\0"), parts)


def common_messages(a: Sequence[Link], b: Sequence[Link]) -> int:
    """How many leading links (messages) two chains share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x.digest != y.digest:
            break
        n += 1
    return n


def canonical_json(value: Any) -> str:
    """Compact JSON with sorted keys and without keys that never change what the model sees."""
    return json.dumps(_strip(value), sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _strip(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _strip(v) for k, v in value.items() if k not in _IGNORED_KEYS}
    if isinstance(value, list | tuple):
        return [_strip(v) for v in value]
    return value
