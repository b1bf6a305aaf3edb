"""The planner's rules (docs/design-pool.md, "What to restore"), one row each: plain values in, a plan out. No
asyncio, no store, no backend."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from slotkeeper.cache.capability import Strategy
from slotkeeper.cache.planner import Candidate, Plan, Request, Rules, Why, plan
from slotkeeper.types import CacheOutcome, Snapshot, SnapshotKind


def snap(name: str, n_tokens: int = 500, n_prompt: int = 0, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot:
    return Snapshot("m", name, f"{name}.bin", "fp", n_tokens, 1000, "c", 0.0, 0.0, 0, kind, False, n_prompt)


def cand(name: str, messages: int, tokens: int, whole: bool = False, n_tokens: int = 500,
         n_prompt: int = 0) -> Candidate:
    return Candidate(snap(name, n_tokens, n_prompt), messages, tokens, whole)


SYSTEM = snap("sys", 300, 300, SnapshotKind.SYSTEM)
RESTORE = Rules(Strategy.RESTORE, min_restore_tokens=128, n_ctx_slot=8192)
PROMPT_END = Rules(Strategy.PROMPT_END, min_restore_tokens=128, n_ctx_slot=8192)
KEEP_HOT = Rules(Strategy.KEEP_HOT, min_restore_tokens=128, n_ctx_slot=8192)


@dataclass(frozen=True)
class Row:
    name: str
    request: Request
    rules: Rules
    own: Candidate | None
    prefix: Candidate | None
    system: Snapshot | None
    why: Why
    restore: str | None = None  # the session_id of the snapshot restored
    outcome: CacheOutcome = CacheOutcome.COLD
    owes: int = 0
    warm_up: bool = False
    held_back: bool = False


ROWS = [
    # 1. The longest prefix: the session's own snapshot.
    Row("own snapshot, request extends it", Request(5, 0, 1), RESTORE, cand("own", 3, 400, True), None, SYSTEM,
        Why.OWN, "own", CacheOutcome.RESTORED, 400),
    Row("own snapshot of a raw prompt (no messages)", Request(0, 0, None), RESTORE, cand("own", 0, 400, True), None,
        None, Why.OWN, "own", CacheOutcome.RESTORED, 400),
    Row("own snapshot, history edited at message 2", Request(5, 0, 1), RESTORE, cand("own", 2, 200), None, None,
        Why.OWN, "own", CacheOutcome.RESTORED, 200),
    Row("own snapshot ties what the slot holds: own wins", Request(5, 2, 1), RESTORE, cand("own", 2, 200), None, None,
        Why.OWN, "own", CacheOutcome.RESTORED, 200),
    Row("own snapshot shares less than the slot holds", Request(5, 3, 1), RESTORE, cand("own", 2, 200), None, None,
        Why.IN_SLOT),
    Row("own snapshot shares nothing (a trimmed history)", Request(5, 0, 1), RESTORE, cand("own", 0, 0), None, SYSTEM,
        Why.NOTHING_SHARED),
    Row("own snapshot too short to be worth a restore", Request(5, 0, 1), RESTORE, cand("own", 3, 100, True), None,
        None, Why.TOO_SHORT),
    Row("own snapshot longer than a slot", Request(5, 0, 1), RESTORE, cand("own", 3, 9000, True, n_tokens=9000),
        None, None, Why.TOO_LONG),
    # 1. The longest prefix: another conversation's snapshot that shares more than the system part.
    Row("a fork: another session shares 3 messages", Request(5, 0, 1), RESTORE, None, cand("other", 3, 300), SYSTEM,
        Why.PREFIX, "other", CacheOutcome.PREFIX, 300),
    Row("another session shares only the system part", Request(5, 0, 1), RESTORE, None, cand("other", 1, 300), SYSTEM,
        Why.SYSTEM, "sys", CacheOutcome.RESTORED, 300),
    Row("another session shares no more than the slot holds", Request(5, 3, 1), RESTORE, None, cand("other", 3, 300),
        SYSTEM, Why.IN_SLOT),
    Row("a longer own share beats another session's", Request(5, 0, 1), RESTORE, cand("own", 4, 450),
        cand("other", 3, 300), SYSTEM, Why.OWN, "own", CacheOutcome.RESTORED, 450),
    Row("a longer prefix elsewhere beats the own snapshot (two agents that were one session)", Request(9, 0, 1),
        RESTORE, cand("own", 2, 3000), cand("other", 7, 3900), SYSTEM, Why.PREFIX, "other", CacheOutcome.PREFIX, 3900),
    Row("a near-tie with another session's prefix goes to the own snapshot", Request(9, 0, 1), RESTORE,
        cand("own", 6, 3895), cand("other", 7, 3900), SYSTEM, Why.OWN, "own", CacheOutcome.RESTORED, 3895),
    Row("the best prefix is the own snapshot itself", Request(9, 0, 1), RESTORE, cand("own", 7, 3900, True),
        cand("own", 7, 3900, True), SYSTEM, Why.OWN, "own", CacheOutcome.RESTORED, 3900),
    Row("a longer prefix that does not fit a slot: the own snapshot", Request(9, 0, 1), RESTORE, cand("own", 2, 3000),
        cand("other", 7, 9000, n_tokens=9000), SYSTEM, Why.OWN, "own", CacheOutcome.RESTORED, 3000),
    Row("prompt-end: a longer prefix it does not extend, the own snapshot it does", Request(9, 0, 1), PROMPT_END,
        cand("own", 4, 2000, True, n_prompt=500), cand("other", 7, 3900), SYSTEM, Why.OWN, "own",
        CacheOutcome.RESTORED, 2000),
    Row("own too short, another session's prefix worth it", Request(5, 0, 1), RESTORE, cand("own", 1, 50),
        cand("other", 3, 300), None, Why.PREFIX, "other", CacheOutcome.PREFIX, 300),
    Row("another session's prefix too short", Request(5, 0, 1), RESTORE, None, cand("other", 3, 100), None,
        Why.TOO_SHORT),
    # 2. The system snapshot of a new conversation.
    Row("new conversation on a known system prompt", Request(2, 0, 1), RESTORE, None, None, SYSTEM, Why.SYSTEM, "sys",
        CacheOutcome.RESTORED, 300),
    Row("new system prompt: warm it up", Request(2, 0, 1, worth_warming=True), RESTORE, None, None, None,
        Why.WARM_UP, warm_up=True),
    Row("new system prompt too short to warm up", Request(2, 0, 1), RESTORE, None, None, None, Why.NOTHING_SHARED),
    Row("the slot already holds this system part", Request(2, 1, 1), RESTORE, None, None, SYSTEM, Why.IN_SLOT),
    Row("a session with its own snapshot never takes the system snapshot", Request(5, 0, 1), RESTORE,
        cand("own", 0, 0), None, SYSTEM, Why.NOTHING_SHARED),
    Row("system snapshot too short", Request(2, 0, 1), RESTORE, None, None, snap("sys", 100, 100, SnapshotKind.SYSTEM),
        Why.TOO_SHORT),
    # 3. Nothing.
    Row("no system part, nothing found", Request(2, 0, None), RESTORE, None, None, None, Why.NOTHING_SHARED),
    Row("the catch-all session is never restored", Request(2, 0, None, default=True), RESTORE, cand("own", 2, 400),
        None, None, Why.DEFAULT),
    # Builds that can only extend a snapshot (recurrent and hybrid models without checkpoints in slot files).
    Row("prompt-end: the next turn extends the prompt-end snapshot", Request(5, 0, 1), PROMPT_END,
        cand("own", 3, 400, True, n_tokens=400, n_prompt=400), None, SYSTEM, Why.OWN, "own", CacheOutcome.RESTORED,
        400),
    Row("prompt-end: a snapshot holding generated tokens is not extended", Request(5, 0, 1), PROMPT_END,
        cand("own", 3, 400, True, n_tokens=440, n_prompt=400), None, None, Why.NOT_EXTENDED, held_back=True),
    Row("prompt-end: an edited history does not extend it", Request(5, 0, 1), PROMPT_END,
        cand("own", 2, 200, False, n_tokens=400, n_prompt=400), None, None, Why.NOT_EXTENDED, held_back=True),
    Row("prompt-end: the same prompt again (a regenerate) does not extend it", Request(3, 0, 1), PROMPT_END,
        cand("own", 3, 400, True, n_tokens=400, n_prompt=400), None, None, Why.NOT_EXTENDED, held_back=True),
    Row("prompt-end: a fork from the last message extends another session's", Request(5, 0, 1), PROMPT_END, None,
        cand("other", 3, 400, True, n_tokens=400, n_prompt=400), SYSTEM, Why.PREFIX, "other", CacheOutcome.PREFIX,
        400),
    Row("prompt-end: a fork from an earlier message falls back to the system snapshot", Request(5, 0, 1),
        PROMPT_END, None, cand("other", 2, 300, False, n_tokens=400, n_prompt=400), SYSTEM, Why.SYSTEM, "sys",
        CacheOutcome.RESTORED, 300, held_back=True),
    Row("prompt-end: a new chat extends the system snapshot", Request(2, 0, 1), PROMPT_END, None, None, SYSTEM,
        Why.SYSTEM, "sys", CacheOutcome.RESTORED, 300),
    # Builds where no restore helps (sliding-window models without checkpoints in slot files).
    Row("keep-hot: never a restore", Request(5, 0, 1), KEEP_HOT, cand("own", 3, 400, True), None, SYSTEM,
        Why.KEEP_HOT, held_back=True),
    Row("keep-hot: a new system prompt is still warmed up", Request(2, 0, 1, worth_warming=True), KEEP_HOT, None,
        None, None, Why.WARM_UP, warm_up=True, held_back=True),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_plan(row: Row) -> None:
    got: Plan = plan(row.request, row.rules, row.own, row.prefix, row.system)
    restored = got.restore.snapshot.session_id if got.restore is not None else None
    assert (got.why, restored, got.outcome, got.owes, got.warm_up, got.held_back) == (
        row.why, row.restore, row.outcome, row.owes, row.warm_up, row.held_back)


def test_every_reason_is_reached() -> None:
    assert {r.why for r in ROWS} == set(Why)
