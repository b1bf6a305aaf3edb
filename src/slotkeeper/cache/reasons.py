"""Why a turn's backend prefilled what it did: one reason per request, in words a person can act on.

A pure function of what the pool knew when it chose (the plan, the session's own snapshot, what became of a snapshot
or a slot state it had, whether the session was seen before); the request's journal row, its log line, /metrics and
`slotkeeper sessions explain` carry the result. The vocabulary is `Reason`, and docs/clients.md explains each one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from slotkeeper.cache.planner import Candidate, Plan, Why


class Reason(enum.StrEnum):
    HOT = "hot"  # the slot held the session: only the new messages were prefilled
    OWN = "own"  # the session's own snapshot was restored
    PREFIX = "prefix"  # another saved state (a conversation's or a side task's) that shares the most
    SYSTEM = "system"  # the system part's saved state
    IN_SLOT = "in-slot"  # the slot already held what any snapshot would give
    NEW_SESSION = "new-session"  # nothing of this conversation was seen or saved before
    SIDE_TASK = "side-task"  # a title, tag or other side request: runs apart, restores nothing
    REWRITTEN = "rewritten"  # the client sent an earlier message changed (or dropped): reuse stops there
    EVICTED = "evicted"  # the session's snapshot was evicted by the disk budget
    NOT_RESTORABLE = "not-restorable"  # the snapshot is of another model file, build or slot layout
    QUARANTINED = "quarantined"  # the snapshot failed its checks (size, checksum) and was moved aside
    BACKEND_RESTARTED = "backend-restarted"  # the backend lost the slot's state (a crash, a restart)
    SLOT_TAKEN = "slot-taken"  # another session took the slot, and this backend cannot bring the state back
    NOT_EXTENDED = "not-extended"  # a recurrent/hybrid state restores only for a request that extends all of it
    KEEP_HOT = "keep-hot"  # restores cannot help on this backend (sliding window without checkpoints)
    TOO_SHORT = "too-short"  # restoring what could be restored costs more than prefilling it (costs.py)
    TOO_LONG = "too-long"  # the snapshot is larger than a slot
    NOTHING_SHARED = "nothing-shared"  # no snapshot shares enough with the request
    RESTORE_FAILED = "restore-failed"  # the backend refused the restore; the turn ran cold
    DEFAULT = "default-session"  # the catch-all session (a request without messages or an id): never saved


# A session's snapshot that is gone or unusable, as the look-up found it (Snapshots.own).
FATES = frozenset({Reason.EVICTED, Reason.NOT_RESTORABLE, Reason.QUARANTINED})
# What became of a session's state in its slot since its last turn (the pool notes it).
LEFT = frozenset({Reason.BACKEND_RESTARTED, Reason.SLOT_TAKEN})
_MISSES = frozenset({Why.NOTHING_SHARED, Why.IN_SLOT, Why.SYSTEM, Why.PREFIX, Why.TOO_SHORT})


@dataclass(frozen=True, slots=True)
class Explained:
    """A reason, a detail in words, and the message (0-based) where the history changed for REWRITTEN."""

    reason: Reason
    detail: str = ""
    changed_at: int | None = None


@dataclass(frozen=True, slots=True)
class Known:
    """What the pool knew about the session besides the plan: `fate` of its snapshot, what became of its slot state
    (`left`, with words), and whether it was seen before."""

    fate: Reason | None = None
    left: Reason | None = None
    left_detail: str = ""
    seen: bool = True


def explain(chosen: Plan, own: Candidate | None, known: Known) -> Explained:
    """The reason for a planned turn (not hot, not a side request)."""
    if chosen.why is Why.DEFAULT:
        return Explained(Reason.DEFAULT)
    if chosen.why is Why.OWN:
        assert own is not None
        if not own.whole:
            return _rewritten(own, "restored up to there")
        if known.left is not None:
            return Explained(Reason.OWN, f"restored after: {known.left_detail}")
        return Explained(Reason.OWN)
    if own is not None and own.messages == 0 and not own.whole:
        return _rewritten(own, "nothing of the saved state applies")
    source = {Why.SYSTEM: "started from the system part's saved state",
              Why.PREFIX: f"started from the saved state sharing the most with it ({chosen.owes} tokens)",
              Why.IN_SLOT: "the slot already held its beginning"}.get(chosen.why, "")
    if chosen.why in _MISSES or chosen.why in (Why.KEEP_HOT, Why.NOT_EXTENDED):
        if known.fate is not None:
            return Explained(known.fate, source)
        if known.left is not None and chosen.why is not Why.IN_SLOT:  # in-slot: the slot gave all a state could
            return Explained(known.left, _join(known.left_detail, source))
        if own is not None and not own.whole and chosen.why in _MISSES:
            return _rewritten(own, source or "too little left to restore")
        if not known.seen and own is None:
            return Explained(Reason.NEW_SESSION, source)
    return Explained(Reason(str(chosen.why)), source)


def _rewritten(own: Candidate, what: str) -> Explained:
    return Explained(Reason.REWRITTEN, f"message {own.messages + 1} differs from the saved history; {what}",
                     own.messages)


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)
