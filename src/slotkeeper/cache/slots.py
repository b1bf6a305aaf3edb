"""What the pool knows about each slot, and what it hands out: the slot's state, a lease of it for one turn, and
the record of what the cache did for that turn. Plain data; the pool (pool.py) changes it, and
the work it hands a leased or held slot to (bringing.py, idlesaves.py, warmups.py, operations.py)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from slotkeeper.cache.chain import Link
from slotkeeper.cache.promptend import Replay
from slotkeeper.cache.systemprompt import SystemPrompt
from slotkeeper.cache.tokens import Tokens
from slotkeeper.types import CacheOutcome, SessionKey, Snapshot, SnapshotKind


class TurnEnd(enum.Enum):
    """How a leased turn ended, which decides what the slot holds afterwards."""

    COMPLETED = "completed"  # the slot holds the session's state up to this turn: save it later
    CANCELLED = "cancelled"  # the client hung up: the slot holds a prefix of the session's state
    REJECTED = "rejected"  # the backend refused the request before touching the slot
    FAILED = "failed"  # the backend broke mid-turn: the slot's content is unknown, nothing is saved from it


@dataclass
class SlotState:
    slot_id: int
    occupant: SessionKey | None = None
    # What the occupant's state is saved as: a conversation's, or a side task's (kept for the next side task).
    kind: SnapshotKind = SnapshotKind.SESSION
    dirty: bool = False
    busy: bool = False
    generation: int = 0
    last_used: float = 0.0
    n_tokens: int = 0
    # The message chain of the last turn that ran in the slot: what a save of it will cover.
    chain: list[Link] = field(default_factory=list)
    # Tokens the slot's state is known to start with (a restored state's, or the last prompt's when it was
    # tokenized), for exact comparisons with a request; None when not known.
    tokens: Tokens | None = None
    # The system part to cut the slot's state back to once it is saved and idle (no state of that part is saved).
    cut: SystemPrompt | None = None
    # The last turn's prompt tokens, and its request (to bring the slot back to the end of that prompt before a
    # save, on backends that need it: see promptend.py); `at_prompt_end` once it was.
    n_prompt: int = 0
    replay: Replay | None = None
    at_prompt_end: bool = False
    # The slot's session was deleted while the slot was busy (a turn, or a save of it, running): the lease
    # generation it was deleted in. When the turn or save of that generation gives the slot back, the slot's state
    # is not attributed (or saved) any more; a later lease never sees it (it has a newer generation).
    forgotten_in: int | None = None
    # The session a conversation's request was handed this slot for, from the step that handed it out until the
    # lease ends: a second request of that session waits for this slot rather than take another (pool.py).
    claimed: SessionKey | None = None
    # What the slot holds is what a side task left (kept as a side state or not): the next side task, which may
    # begin the same way (a task's instructions), is sent here rather than to an empty slot (pool.py).
    side_content: bool = False
    # The cache domain of what the slot holds (SessionKey.domain; None: not known, as at start when domains are
    # kept apart): a request of another domain gets it erased first, so that the backend reuses nothing of it
    # (pool.py).
    domain: str | None = ""


@dataclass
class TurnCache:
    """What the cache did for one turn: the record its journal row, log line, response headers and metrics are
    made of. The pool fills it in while it brings a state in; the lease only carries it to the caller."""

    outcome: CacheOutcome = CacheOutcome.COLD
    # Why the backend prefilled what it did (reasons.py), in a word and in words; for a rewritten history, the
    # message (0-based) where it changed.
    why: str = ""
    detail: str = ""
    changed_at: int | None = None
    restored_tokens: int = 0
    # Tokens the restore should let the backend reuse (the whole snapshot, or the shared prefix of another one).
    expected_reuse: int = 0
    restored_from: str | None = None
    restore_ms: float = 0.0
    save_ms: float = 0.0
    warm_ms: float = 0.0
    # The time the decision took: the look-ups, the request's tokens when the planner asked for them, the plan.
    decide_ms: float | None = None
    # The whole time from asking for a slot to holding it: the wait in the queue, the save of its occupant, the
    # decision and the restore (what the turn waited for before its request went to the backend).
    lease_ms: float = 0.0


@dataclass
class SlotLease:
    """A slot held for one turn. `release` is synchronous so it is safe in cancelled code paths."""

    slot_id: int
    key: SessionKey
    side: bool = False
    chain: list[Link] = field(default_factory=list)
    cache: TurnCache = field(default_factory=TurnCache)
    # The request's system part: the part a slot's state is cut back to after the turn when no saved state covers
    # it yet (`cut_system`), or, for a pre-warm's lease, the part to evaluate and save.
    system: SystemPrompt | None = None
    cut_system: bool = False
    # The system snapshot already on disk, for a lease taken only to warm a system prompt up (see `warm_lease`).
    existing: Snapshot | None = None
    # The request sent for the turn (set by the caller), kept by the slot to bring it back to the prompt's end.
    replay: Replay | None = None
    # The request's tokens when the planner needed them (the slot holds them after the turn).
    tokens: Tokens | None = None
    _release: Callable[[SlotLease, TurnEnd, int, int | None, int, float | None], None] | None = field(
        default=None, repr=False)

    def release(self, end: TurnEnd, n_tokens: int = 0, cache_n: int | None = None, n_prompt: int = 0,
                prompt_ms: float | None = None) -> None:
        """Give the slot back; `cache_n` is the backend's reported reuse, checked against what a restore owed,
        `n_prompt` the turn's prompt tokens (cached and processed), and `prompt_ms` the backend's time for those it
        processed (a measure of what a prefill costs: costs.py)."""
        if self._release is not None:
            release, self._release = self._release, None
            release(self, end, n_tokens, cache_n, n_prompt, prompt_ms)


@dataclass(frozen=True, slots=True)
class Held:
    """What a slot holds, as a save of it needs it: taken before the slot changes hands."""

    chain: list[Link]
    n_prompt: int = 0
    replay: Replay | None = None
    at_prompt_end: bool = False
    kind: SnapshotKind = SnapshotKind.SESSION

    @classmethod
    def of(cls, slot: SlotState) -> Held:
        return cls(slot.chain, slot.n_prompt, slot.replay, slot.at_prompt_end, slot.kind)
