"""The states kept for side tasks (OpenWebUI's title, tags and follow-up requests): the last few, each under a key of
its own, so that the next task which starts the same way (the same template, and often the same chat's history)
starts from the one sharing the longest beginning with it.

Side tasks carry no history of their own (one user message quoting the chat), so they have no message chain to
match: the text of the request is compared instead, and the tokens it shares are estimated from the share of
characters. Pure bookkeeping; the pool saves, restores and deletes the snapshots.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass

from slotkeeper.cache.systemprompt import common_prefix_text
from slotkeeper.types import IdSource, SessionKey

# Side states kept per model; the oldest one's snapshot is deleted when another is kept.
KEPT = 8
# The session ids of side states: never an id a client would send (see `is_side_key`).
_PREFIX = "~side-"
_ID = re.compile(r"~side-[0-9a-f]{16}")


@dataclass(frozen=True, slots=True)
class SideState:
    key: SessionKey
    text: str
    n_tokens: int


@dataclass(frozen=True, slots=True)
class SideMatch:
    """The side state to start from, and about how many of its tokens the request shares."""

    key: SessionKey
    tokens: int


def is_side_key(session_id: str) -> bool:
    return _ID.fullmatch(session_id) is not None


class SideStates:
    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        self._states: OrderedDict[SessionKey, SideState] = OrderedDict()

    def best(self, model: str, text: str) -> SideMatch | None:
        """The kept state of `model` sharing the longest beginning with `text`, if any shares something."""
        found: SideMatch | None = None
        for state in self._states.values():
            if state.key.model != model or not state.text:
                continue
            shared = len(common_prefix_text(state.text, text))
            tokens = state.n_tokens * shared // len(state.text)
            if tokens > 0 and (found is None or tokens > found.tokens):
                found = SideMatch(state.key, tokens)
        return found

    def keep(self, model: str, text: str, n_tokens: int) -> tuple[SessionKey, list[SessionKey]]:
        """Record the state a side task of `text` left (`n_tokens`); returns its key and the keys no longer kept."""
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        key = SessionKey(model, _PREFIX + digest, IdSource.ROUTE)
        self._states.pop(key, None)
        self._states[key] = SideState(key, text, n_tokens)
        dropped: list[SessionKey] = []
        mine = [k for k in self._states if k.model == model]
        while len(mine) > self._kept:
            oldest = mine.pop(0)
            del self._states[oldest]
            dropped.append(oldest)
        return key, dropped

    def used(self, key: SessionKey) -> None:
        if key in self._states:
            self._states.move_to_end(key)

    def drop(self, key: SessionKey) -> None:
        self._states.pop(key, None)
