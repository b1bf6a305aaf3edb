"""The request journal: one typed entry per finished request, kept in a ring buffer and handed to listeners.

The per-request log line, the JSON log, `/metrics` and the dashboard's recent requests all read the same entry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("slotkeeper.journal")

RECENT_REQUESTS = 100
# Sessions whose running totals are kept (least recently active dropped first).
TRACKED_SESSIONS = 4096
# The latest requests kept per session, for `slotkeeper sessions explain` (its story of a session's last turns).
SESSION_HISTORY = 20
HISTORY_SESSIONS = 1024


@dataclass(frozen=True, slots=True)
class RequestEntry:
    """What one request did to the cache: its session, slot, cache path, token counts, timings and result."""

    api: str
    side: bool
    model: str
    session: str
    slot: int
    cache: str
    restored: int
    restore_ms: float
    save_ms: float
    cache_n: int | None
    prompt_n: int | None
    predicted_n: int | None
    # Milliseconds the backend spent on the prompt, from its `timings` (used to estimate the prefill saved).
    prompt_ms: float | None
    status: int
    end: str
    ms: float
    # The snapshot a restore came from: a session id, or `system:DIGEST` for a system prompt's snapshot.
    restored_from: str | None = None
    # Why the backend prefilled what it did (cache/reasons.py), and the same in words.
    why: str = ""
    why_detail: str = ""
    # Milliseconds slotkeeper took to decide which state to start from (None for a hot turn: no look-up).
    decide_ms: float | None = None
    time: float = field(default_factory=time.time)
    # The cache domain of the request's session (types.SessionKey): whose journal view it shows in.
    domain: str = ""
    # Milliseconds from asking for a slot to holding it (queue, save of its occupant, decision, restore).
    lease_ms: float | None = None

    def log_line(self) -> str:
        """The human-readable request log line (`slotkeeper.turn`)."""
        return (
            f"{self.api}{' side' if self.side else ''} session={self.model}/{self.session} "
            f"{f'domain={self.domain} ' if self.domain else ''}slot={self.slot} "
            f"cache={self.cache} restored={self.restored}"
            f"{f' from={self.restored_from}' if self.restored_from else ''} restore_ms={self.restore_ms:.1f} "
            f"save_ms={self.save_ms:.1f}{f' decide_ms={self.decide_ms:.1f}' if self.decide_ms is not None else ''} "
            f"cache_n={_dash(self.cache_n)} prompt_n={_dash(self.prompt_n)} "
            f"status={self.status} end={self.end} ms={self.ms:.0f}"
            f"{f' why={self.why}' if self.why else ''}{f' ({self.why_detail})' if self.why_detail else ''}"
        )

    def prefill_seconds_saved(self, fallback_ms_per_token: float | None) -> float:
        """Estimated prefill time the reused tokens would have cost: cache_n at this response's prefill rate."""
        if not self.cache_n:
            return 0.0
        rate = None
        if self.prompt_ms is not None and self.prompt_n:
            rate = self.prompt_ms / self.prompt_n
        rate = rate if rate is not None else fallback_ms_per_token
        return 0.0 if rate is None else self.cache_n * rate / 1000.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class SessionTotals:
    """Running totals of one session since slotkeeper started."""

    requests: int = 0
    hits: int = 0  # requests that started from a hot, restored or prefix state
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    seconds_saved: float = 0.0
    last_request: float = 0.0


RequestListener = Callable[[RequestEntry], None]


class RequestJournal:
    """The last RECENT_REQUESTS entries, per-session totals, and listeners called for every new entry."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self._recent: deque[RequestEntry] = deque(maxlen=size)
        # By model, session and cache domain.
        self._totals: OrderedDict[tuple[str, str, str], SessionTotals] = OrderedDict()
        self._history: OrderedDict[tuple[str, str, str], deque[RequestEntry]] = OrderedDict()
        self._listeners: list[RequestListener] = []
        self._lock = threading.Lock()
        # The latest measured prefill rate, for responses that prefilled nothing themselves.
        self.ms_per_token: float | None = None

    def subscribe(self, listener: RequestListener) -> None:
        self._listeners.append(listener)

    def add(self, entry: RequestEntry) -> None:
        if entry.prompt_ms is not None and entry.prompt_n and entry.prompt_n >= 16:
            self.ms_per_token = entry.prompt_ms / entry.prompt_n
        saved = entry.prefill_seconds_saved(self.ms_per_token)
        with self._lock:
            self._recent.append(entry)
            key = (entry.model, entry.session, entry.domain)
            totals = self._totals.pop(key, None) or SessionTotals()
            totals.requests += 1
            totals.hits += entry.cache != "cold"
            totals.tokens_reused += entry.cache_n or 0
            totals.tokens_prefilled += entry.prompt_n or 0
            totals.seconds_saved += saved
            totals.last_request = entry.time
            self._totals[key] = totals
            history = self._history.pop(key, None) or deque(maxlen=SESSION_HISTORY)
            history.append(entry)
            self._history[key] = history
            while len(self._totals) > TRACKED_SESSIONS:
                self._totals.popitem(last=False)
            while len(self._history) > HISTORY_SESSIONS:
                self._history.popitem(last=False)
        for listener in self._listeners:
            try:
                listener(entry)
            except Exception:  # a broken observer must never fail the request that is being recorded
                log.exception("request listener %r failed", listener)

    def recent(self, limit: int = RECENT_REQUESTS) -> list[RequestEntry]:
        """Newest first."""
        with self._lock:
            entries = list(self._recent)
        return entries[::-1][:limit]

    def of_session(self, model: str, session: str, domain: str = "") -> list[RequestEntry]:
        """The session's latest requests (up to SESSION_HISTORY), oldest first."""
        with self._lock:
            return list(self._history.get((model, session, domain), ()))

    def totals(self) -> dict[tuple[str, str, str], SessionTotals]:
        with self._lock:
            return {key: SessionTotals(**asdict(value)) for key, value in self._totals.items()}


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)
