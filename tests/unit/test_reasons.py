"""Why a turn prefilled what it did (cache/reasons.py): plain values in, one reason out, a row per case. No asyncio,
no store, no backend."""

from __future__ import annotations

import pytest

from slotkeeper.cache.planner import Candidate, Plan, Why
from slotkeeper.cache.reasons import Known, Reason, explain
from slotkeeper.types import CacheOutcome, Snapshot


def own(messages: int, whole: bool) -> Candidate:
    snapshot = Snapshot("m", "s", "s.bin", "fp", 500, 1000, "c", 0.0, 0.0, 0)
    return Candidate(snapshot, messages, 400, whole)


RESTORED = Plan(Why.OWN, own(3, True), CacheOutcome.RESTORED)
TAKEN = Known(left=Reason.SLOT_TAKEN, left_detail="slot 0 was taken by session B")
RESTARTED = Known(left=Reason.BACKEND_RESTARTED, left_detail="the server exited")

ROWS = [
    ("own snapshot, the history extends it", RESTORED, own(3, True), Known(), Reason.OWN, None),
    ("own snapshot after another session took the slot", RESTORED, own(3, True), TAKEN, Reason.OWN, None),
    ("own snapshot after a restart", RESTORED, own(3, True), RESTARTED, Reason.OWN, None),
    ("own snapshot, message 3 edited", Plan(Why.OWN, own(2, False), CacheOutcome.RESTORED), own(2, False), Known(),
     Reason.REWRITTEN, 2),
    ("own snapshot shares nothing: rewritten from the first message", Plan(Why.NOTHING_SHARED), own(0, False),
     Known(), Reason.REWRITTEN, 0),
    ("own snapshot shares too little", Plan(Why.TOO_SHORT), own(1, False), Known(), Reason.REWRITTEN, 1),
    ("never seen, nothing saved", Plan(Why.NOTHING_SHARED), None, Known(seen=False), Reason.NEW_SESSION, None),
    ("never seen, a new system prompt", Plan(Why.NOTHING_SHARED, cut_system=True), None, Known(seen=False),
     Reason.NEW_SESSION, None),
    ("never seen, from the system snapshot", Plan(Why.SYSTEM, None, CacheOutcome.RESTORED), None,
     Known(seen=False), Reason.NEW_SESSION, None),
    ("seen, its snapshot evicted by the budget", Plan(Why.SYSTEM), None, Known(fate=Reason.EVICTED),
     Reason.EVICTED, None),
    ("its snapshot is of another build", Plan(Why.NOTHING_SHARED), None, Known(fate=Reason.NOT_RESTORABLE),
     Reason.NOT_RESTORABLE, None),
    ("its snapshot was damaged", Plan(Why.NOTHING_SHARED), None, Known(fate=Reason.QUARANTINED),
     Reason.QUARANTINED, None),
    ("slot taken, but what the slot holds now gives as much", Plan(Why.IN_SLOT), None, TAKEN, Reason.IN_SLOT, None),
    ("lost in a restart, not saved yet", Plan(Why.NOTHING_SHARED), None, RESTARTED, Reason.BACKEND_RESTARTED, None),
    ("slot taken on a keep-hot backend", Plan(Why.KEEP_HOT, held_back=True), None, TAKEN, Reason.SLOT_TAKEN, None),
    ("keep-hot, a new session", Plan(Why.KEEP_HOT, held_back=True), None, Known(seen=False), Reason.NEW_SESSION,
     None),
    ("keep-hot, nothing else known", Plan(Why.KEEP_HOT, held_back=True), None, Known(), Reason.KEEP_HOT, None),
    ("a recurrent state the request does not extend", Plan(Why.NOT_EXTENDED, held_back=True), own(3, False),
     Known(), Reason.NOT_EXTENDED, None),
    ("the catch-all session", Plan(Why.DEFAULT), None, Known(seen=False), Reason.DEFAULT, None),
    ("seen, nothing shared", Plan(Why.NOTHING_SHARED), None, Known(), Reason.NOTHING_SHARED, None),
    ("too long for a slot", Plan(Why.TOO_LONG), None, Known(), Reason.TOO_LONG, None),
]


@pytest.mark.parametrize(("name", "chosen", "candidate", "known", "reason", "changed_at"), ROWS,
                         ids=[row[0] for row in ROWS])
def test_reason(name: str, chosen: Plan, candidate: Candidate | None, known: Known, reason: Reason,
                changed_at: int | None) -> None:
    explained = explain(chosen, candidate, known)
    assert (explained.reason, explained.changed_at) == (reason, changed_at), name


def test_the_words_say_what_happened() -> None:
    assert "taken by session B" in explain(RESTORED, own(3, True), TAKEN).detail
    assert "message 3" in explain(Plan(Why.OWN, own(2, False), CacheOutcome.RESTORED), own(2, False), Known()).detail
    assert "system part" in explain(Plan(Why.SYSTEM), None, Known(fate=Reason.EVICTED)).detail


def test_every_planner_reason_is_a_reason() -> None:
    assert {str(w) for w in Why} <= {str(r) for r in Reason}
