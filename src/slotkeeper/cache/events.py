"""Cache events at the moment they happen (a save or restore finished), for observers such as `/metrics`.

The pool calls these hooks; with no observer subscribed they cost one empty loop.
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger("slotkeeper.events")


class CacheObserver(Protocol):
    def saved(self, ms: float, n_bytes: int, n_tokens: int) -> None: ...

    def restored(self, ms: float, n_bytes: int, n_tokens: int) -> None: ...


class CacheEvents:
    """Fans each save and restore out to the subscribed observers; an observer's failure is logged, not raised."""

    def __init__(self) -> None:
        self._observers: list[CacheObserver] = []

    def subscribe(self, observer: CacheObserver) -> None:
        self._observers.append(observer)

    def saved(self, ms: float, n_bytes: int, n_tokens: int) -> None:
        for observer in self._observers:
            try:
                observer.saved(ms, n_bytes, n_tokens)
            except Exception:
                log.exception("cache observer %r failed", observer)

    def restored(self, ms: float, n_bytes: int, n_tokens: int) -> None:
        for observer in self._observers:
            try:
                observer.restored(ms, n_bytes, n_tokens)
            except Exception:
                log.exception("cache observer %r failed", observer)
