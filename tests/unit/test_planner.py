"""The planner's rules (docs/design-pool.md, "How a request's state is chosen"), one row each: plain values in, a plan
out. No asyncio, no store, no backend. Every candidate is scored by the tokens it shares with the request; the
session's name is a hint for near-ties only."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from slotkeeper.cache.capability import Strategy
from slotkeeper.cache.costs import Tier
from slotkeeper.cache.planner import NEAR_TIE_TOKENS, Candidate, InSlot, Plan, Request, Rules, Why, best, plan
from slotkeeper.types import CacheOutcome, Snapshot, SnapshotKind


def snap(name: str, n_tokens: int = 500, n_prompt: int = 0, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot:
    return Snapshot("m", name, f"{name}.bin", "fp", n_tokens, 1000, "c", 0.0, 0.0, 0, kind, False, n_prompt)


def cand(name: str, messages: int, tokens: int, whole: bool = False, n_tokens: int = 500, n_prompt: int = 0,
         own: bool = False, tier: Tier = Tier.DISK, kind: SnapshotKind = SnapshotKind.SESSION,
         exact: bool = False) -> Candidate:
    return Candidate(snap(name, n_tokens, n_prompt, kind), messages, tokens, whole, exact, tier, own)


def own(messages: int, tokens: int, whole: bool = False, **kw: object) -> Candidate:
    return cand("own", messages, tokens, whole, own=True, **kw)  # type: ignore[arg-type]


SYSTEM = cand("sys", 1, 300, True, 300, 300, kind=SnapshotKind.SYSTEM)
RESTORE = Rules(Strategy.RESTORE, min_restore_tokens=128, n_ctx_slot=8192)
PROMPT_END = Rules(Strategy.PROMPT_END, min_restore_tokens=128, n_ctx_slot=8192)
KEEP_HOT = Rules(Strategy.KEEP_HOT, min_restore_tokens=128, n_ctx_slot=8192)


@dataclass(frozen=True)
class Row:
    name: str
    request: Request
    rules: Rules
    in_slot: InSlot
    saved: list[Candidate] = field(default_factory=list)
    why: Why = Why.NOTHING_SHARED
    restore: str | None = None  # the session_id of the state restored
    outcome: CacheOutcome = CacheOutcome.COLD
    owes: int = 0
    held_back: bool = False
    cut: bool = False


NOTHING = InSlot()
ROWS = [
    # The state that shares the most tokens wins, whatever its name or kind.
    Row("own state, request extends it", Request(5, 1), RESTORE, NOTHING, [own(3, 400, True), SYSTEM],
        Why.OWN, "own", CacheOutcome.RESTORED, 400),
    Row("own state of a raw prompt (no messages)", Request(0), RESTORE, NOTHING, [own(0, 400, True)],
        Why.OWN, "own", CacheOutcome.RESTORED, 400),
    Row("own state, history edited at message 2", Request(5, 1), RESTORE, NOTHING, [own(2, 200)],
        Why.OWN, "own", CacheOutcome.RESTORED, 200),
    Row("another conversation's state shares more than the own one", Request(5, 1), RESTORE, NOTHING,
        [own(1, 300), cand("fork", 4, 900)], Why.PREFIX, "fork", CacheOutcome.PREFIX, 900),
    Row("a near-tie goes to the own state", Request(5, 1), RESTORE, NOTHING,
        [own(3, 400, True), cand("other", 3, 400 + NEAR_TIE_TOKENS)], Why.OWN, "own", CacheOutcome.RESTORED, 400),
    Row("a near-tie goes to a copy in RAM before a file on disk", Request(5, 1), RESTORE, NOTHING,
        [own(3, 404, True), cand("ram", 3, 400, tier=Tier.RAM)], Why.PREFIX, "ram", CacheOutcome.PREFIX, 400),
    Row("a near-tie of equals goes to the smallest state", Request(3, 1), RESTORE, NOTHING,
        [cand("big", 1, 300, n_tokens=5000), SYSTEM], Why.SYSTEM, "sys", CacheOutcome.RESTORED, 300),
    # What the slot holds is a candidate too, and the cheapest: a restore must share more, beyond a near-tie.
    Row("hot, but another state shares more: restore it", Request(6, 1), RESTORE, InSlot(120, 1, own=True),
        [cand("B", 1, 2400)], Why.PREFIX, "B", CacheOutcome.PREFIX, 2400),
    Row("same id, different tokens (a title's state in the slot)", Request(2, 1), RESTORE, InSlot(0, 0, own=True),
        [cand("other-conversation", 1, 23450)], Why.PREFIX, "other-conversation", CacheOutcome.PREFIX, 23450),
    Row("the slot shares as much as any state: keep it", Request(5, 1), RESTORE, InSlot(400, 3),
        [own(3, 400, True)], Why.IN_SLOT),
    Row("the slot shares a near-tie less: keep it", Request(5, 1), RESTORE, InSlot(400 - NEAR_TIE_TOKENS, 3),
        [own(3, 400, True)], Why.IN_SLOT),
    Row("the slot holds the system part a new conversation extends", Request(2, 1), RESTORE, InSlot(300, 1),
        [SYSTEM], Why.IN_SLOT),
    # A request without an id and without a system prompt is planned like any other.
    Row("no id, no system prompt: a chat's own earlier state", Request(3), RESTORE, NOTHING,
        [own(1, 520, True)], Why.OWN, "own", CacheOutcome.RESTORED, 520),
    Row("no id, no system prompt: a pasted document another chat opened with", Request(1), RESTORE, NOTHING,
        [cand("chat-b", 0, 2480, exact=True)], Why.PREFIX, "chat-b", CacheOutcome.PREFIX, 2480),
    # A system part's saved state, or one cut from another conversation, for a new conversation.
    Row("a new conversation starts from its system part's state", Request(2, 1), RESTORE, NOTHING, [SYSTEM],
        Why.SYSTEM, "sys", CacheOutcome.RESTORED, 300),
    Row("a new conversation starts from another conversation sharing its system part", Request(2, 1), RESTORE,
        NOTHING, [cand("A", 1, 4619, n_tokens=4630)], Why.PREFIX, "A", CacheOutcome.PREFIX, 4619),
    Row("a new system part, nothing shares it: cut it after the turn", Request(2, 1, system_saved=False,
        worth_cutting=True), RESTORE, NOTHING, [], Why.NOTHING_SHARED, cut=True),
    Row("a new system part another conversation covers: still cut (a state of its own outlives them)",
        Request(2, 1, system_saved=False, worth_cutting=True), RESTORE, NOTHING, [cand("A", 1, 900)],
        Why.PREFIX, "A", CacheOutcome.PREFIX, 900, cut=True),
    Row("a system part too short to be worth a state: no cut", Request(2, 1, system_saved=False), RESTORE, NOTHING,
        [], Why.NOTHING_SHARED),
    # Thresholds.
    Row("too short to be worth a restore", Request(5, 1), RESTORE, NOTHING, [own(3, 100, True)], Why.TOO_SHORT),
    Row("more tokens than a slot holds", Request(5, 1), RESTORE, NOTHING, [own(3, 400, True, n_tokens=9000)],
        Why.TOO_LONG),
    Row("a state that shares nothing", Request(5, 1), RESTORE, NOTHING, [own(0, 0)], Why.NOTHING_SHARED),
    Row("the catch-all session is never restored", Request(0, default=True), RESTORE, NOTHING, [own(0, 400, True)],
        Why.DEFAULT),
    # Strategies.
    Row("prompt-end: a state the request extends", Request(5, 1), PROMPT_END, NOTHING,
        [own(3, 400, True, n_tokens=400, n_prompt=400)], Why.OWN, "own", CacheOutcome.RESTORED, 400),
    Row("prompt-end: a state with generated tokens is held back", Request(5, 1), PROMPT_END, NOTHING,
        [own(3, 400, True, n_tokens=450, n_prompt=400)], Why.NOT_EXTENDED, held_back=True),
    Row("prompt-end: an edited history is held back, the system part taken", Request(5, 1), PROMPT_END, NOTHING,
        [own(2, 380, n_tokens=400, n_prompt=400), SYSTEM], Why.SYSTEM, "sys", CacheOutcome.RESTORED, 300,
        held_back=True),
    Row("keep-hot: nothing is restored", Request(5, 1), KEEP_HOT, NOTHING, [own(3, 400, True)], Why.KEEP_HOT,
        held_back=True),
    Row("keep-hot: a new system part is still marked for a cut (the pool asks again when it would make it)",
        Request(2, 1, system_saved=False, worth_cutting=True), KEEP_HOT, NOTHING, [], Why.KEEP_HOT, cut=True),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_plan(row: Row) -> None:
    chosen: Plan = plan(row.request, row.rules, row.in_slot, row.saved)
    assert chosen.why is row.why
    assert (chosen.restore.snapshot.session_id if chosen.restore is not None else None) == row.restore
    assert chosen.outcome is row.outcome
    assert chosen.owes == row.owes
    assert chosen.held_back is row.held_back
    assert chosen.cut_system is row.cut


def test_best_prefers_the_most_tokens_then_the_cheapest() -> None:
    assert best([]) is None
    far = cand("far", 2, 1000)
    near = cand("near", 2, 1000 - NEAR_TIE_TOKENS, tier=Tier.RAM)
    assert best([far, near]) is near
    assert best([far, cand("short", 1, 500, tier=Tier.RAM)]) is far


def test_a_tie_goes_to_a_state_the_request_holds_whole_in_any_order() -> None:
    # Two states sharing the system message: the system state (the request holds all of it) and another
    # conversation's (the request holds only its start), same tier, same size: the whole one wins, found first or last.
    system = cand("sys", 1, 900, True, 900, 900, kind=SnapshotKind.SYSTEM)
    other = cand("other", 1, 900, False, 900)
    assert best([other, system]) is system and best([system, other]) is system
    # Same everything: the file name decides, so the answer never depends on the order they were found in.
    a, b = cand("a", 1, 900), cand("b", 1, 900)
    assert best([a, b]) is a and best([b, a]) is a
