"""The states kept for side tasks (OpenWebUI's title, tags and follow-up requests): the last few, each under a key of
its own, so that the next task which starts the same way (the same template, and often the same chat's history)
starts from the one sharing the longest beginning with it.

Side tasks carry no history of their own (one user message quoting the chat), so they have no message chain to
match: the text of the request is compared instead, and the tokens it shares are estimated from the share of
characters. Pure bookkeeping; the pool saves, restores and deletes the snapshots.

With a `path`, what is kept (each state's text and tokens) is also written to a small JSON file whenever it changes
(a temporary file, then a rename), so that after a restart the next task still finds the state an earlier run left.
A file that cannot be read or does not check out is ignored: the states it named are then deleted as stale.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from slotkeeper.cache.systemprompt import common_prefix_text
from slotkeeper.types import IdSource, SessionKey

log = logging.getLogger("slotkeeper.pool")

# Side states kept per model; the oldest one's snapshot is deleted when another is kept.
KEPT = 8
# The session ids of side states: never an id a client would send (see `is_side_key`).
_PREFIX = "~side-"
_ID = re.compile(r"~side-[0-9a-f]{16}")
_FORMAT = 1


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


def _key(model: str, text: str) -> SessionKey:
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return SessionKey(model, _PREFIX + digest, IdSource.ROUTE)


class SideStates:
    def __init__(self, kept: int = KEPT, path: Path | None = None) -> None:
        self._kept = kept
        self._path = path
        self._states: OrderedDict[SessionKey, SideState] = OrderedDict()

    def load(self) -> set[SessionKey]:
        """Read what an earlier run kept (oldest first); returns the keys now kept. A missing file is an empty one;
        a damaged one, or an entry whose key does not match its text, is left out (and logged)."""
        if self._path is None:
            return set()
        try:
            raw = json.loads(self._path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return set()
        except (OSError, ValueError) as exc:
            log.warning("the side states file %s cannot be read (%s): starting without it", self._path, exc)
            return set()
        entries = raw.get("states") if isinstance(raw, dict) and raw.get("format") == _FORMAT else None
        if not isinstance(entries, list):
            log.warning("the side states file %s is not one this version wrote: starting without it", self._path)
            return set()
        for entry in entries:
            try:
                model, text, n_tokens = str(entry["model"]), str(entry["text"]), int(entry["n_tokens"])
                key = _key(model, text)
                if key.session_id != entry["session_id"] or n_tokens <= 0:
                    raise ValueError("its key does not match its text")
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("a side state in %s is left out: %s", self._path, exc)
                continue
            self._states.pop(key, None)
            self._states[key] = SideState(key, text, n_tokens)
        return set(self._states)

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
        key = _key(model, text)
        self._states.pop(key, None)
        self._states[key] = SideState(key, text, n_tokens)
        dropped: list[SessionKey] = []
        mine = [k for k in self._states if k.model == model]
        while len(mine) > self._kept:
            oldest = mine.pop(0)
            del self._states[oldest]
            dropped.append(oldest)
        self._write()
        return key, dropped

    def used(self, key: SessionKey) -> None:
        if key in self._states:
            self._states.move_to_end(key)
            self._write()

    def drop(self, key: SessionKey) -> None:
        if self._states.pop(key, None) is not None:
            self._write()

    def _write(self) -> None:
        """The kept states to the file, whole or not at all (bookkeeping: a failure costs only a cold task after
        a restart, and is logged)."""
        if self._path is None:
            return
        states = [{"model": s.key.model, "session_id": s.key.session_id, "text": s.text, "n_tokens": s.n_tokens}
                  for s in self._states.values()]
        temp = self._path.with_name(self._path.name + ".tmp")
        try:
            temp.write_text(json.dumps({"format": _FORMAT, "states": states}), encoding="utf-8")
            os.replace(temp, self._path)
        except OSError as exc:
            log.warning("writing the side states file %s failed: %s", self._path, exc)
