"""The planner: which saved state a request's slot should start from, or none. A pure function of plain values
(what the slot holds, the candidates the store found, the thresholds, the backend's strategy); the pool looks the
candidates up, calls `plan`, and does what it says. The rules are in docs/design-pool.md ("What to restore")."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from slotkeeper.cache.capability import Strategy
from slotkeeper.types import CacheOutcome, Snapshot


class Why(enum.StrEnum):
    """Why the plan is what it is: the words a request's record uses for where its state came from, or for why the
    backend had to prefill."""

    OWN = "own"  # the session's own snapshot
    PREFIX = "prefix"  # another conversation's snapshot that shares more than the system part (a fork)
    SYSTEM = "system"  # the system part's snapshot (a new conversation on a known system prompt)
    IN_SLOT = "in-slot"  # the slot already holds as much as any snapshot would give
    WARM_UP = "warm-up"  # a new system prompt: evaluate it into the slot and save it first
    NOTHING_SHARED = "nothing-shared"  # no snapshot shares enough with the request
    TOO_SHORT = "too-short"  # what a snapshot would give is less than --min-restore-tokens
    TOO_LONG = "too-long"  # the snapshot has more tokens than a slot holds
    NOT_EXTENDED = "not-extended"  # this build can only extend a snapshot, and the request does not
    KEEP_HOT = "keep-hot"  # restores cannot help on this backend (sessions stay hot in their slots)
    DEFAULT = "default-session"  # the catch-all session: never restored


# Candidates whose shared tokens differ by no more than this are a tie: the session's own snapshot wins it.
NEAR_TIE_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Candidate:
    """A snapshot the request could start from: `messages` of the request's messages it shares, about `tokens`
    prompt tokens that a restore of it owes, and `whole`: the request has every message it was saved with."""

    snapshot: Snapshot
    messages: int
    tokens: int
    whole: bool


@dataclass(frozen=True, slots=True)
class Request:
    """The request and its slot: `messages` in the request's chain (0 for a raw prompt), `kept` messages the slot's
    current content already gives it for free, `n_system` leading system messages (None: no system part), and
    whether that part's snapshot is worth warming up if there is none."""

    messages: int
    kept: int
    n_system: int | None
    default: bool = False
    worth_warming: bool = False


@dataclass(frozen=True, slots=True)
class Rules:
    strategy: Strategy
    min_restore_tokens: int = 0
    n_ctx_slot: int = 1 << 30


@dataclass(frozen=True, slots=True)
class Plan:
    """Restore `restore` (with `outcome` and the tokens it `owes`), or warm a new system prompt up, or nothing.
    `held_back`: a restore was possible but the strategy did not allow it (a chance for a later trial)."""

    why: Why
    restore: Candidate | None = None
    outcome: CacheOutcome = CacheOutcome.COLD
    warm_up: bool = False
    held_back: bool = False

    @property
    def owes(self) -> int:
        return self.restore.tokens if self.restore is not None else 0


def extends(candidate: Candidate, request_messages: int) -> bool:
    """Whether the request strictly extends every token of the snapshot: it holds a prompt and nothing generated,
    and the request has all of its messages and more (a request without messages: taken as one)."""
    if not candidate.snapshot.at_prompt_end:
        return False
    return request_messages == 0 or (candidate.whole and request_messages > candidate.messages)


def plan(request: Request, rules: Rules, own: Candidate | None = None, prefix: Candidate | None = None,
         system: Snapshot | None = None) -> Plan:
    """What to bring into the request's slot: the state that shares the longest prefix with it. `own`: the session's
    own snapshot (messages and tokens it shares with the request); `prefix`: the store's best match among all
    conversations' snapshots; `system`: the system part's snapshot. Candidates are already checked (size,
    checksum, fingerprint). Near-ties (`NEAR_TIE_TOKENS`) go to the own snapshot, and a tie with the slot to it."""
    if request.default:
        return Plan(Why.DEFAULT)
    if rules.strategy is Strategy.KEEP_HOT:
        warm = request.n_system is not None and system is None and request.worth_warming
        return Plan(Why.WARM_UP if warm else Why.KEEP_HOT, warm_up=warm, held_back=True)
    strict = rules.strategy is Strategy.PROMPT_END
    floor_tokens = max(rules.min_restore_tokens, 1)
    held_back = False
    fits = True
    # On a tie with what the slot holds, the session's own state wins: it usually shares more than whole messages
    # (the next message often starts with the old one's text). A raw prompt (no messages) shares all of it.
    own_ok = own is not None and own.tokens >= floor_tokens and (
        request.messages == 0 or (own.messages > 0 and request.kept <= own.messages))
    if prefix is not None and own is not None and prefix.snapshot.filename == own.snapshot.filename:
        prefix = None  # the best match is the own snapshot
    # Another conversation's state must share more than the system part and than the slot: conversations on one
    # system prompt share its system snapshot; a longer prefix anywhere beats the own snapshot's.
    floor = max(request.kept, request.n_system or 0)
    choices: list[tuple[Why, Candidate, CacheOutcome]] = []
    if own is not None and own_ok:
        choices.append((Why.OWN, own, CacheOutcome.RESTORED))
    if prefix is not None and prefix.messages > floor and prefix.tokens >= rules.min_restore_tokens:
        longer = not choices or prefix.tokens > choices[0][1].tokens + NEAR_TIE_TOKENS
        choices.insert(0 if longer else len(choices), (Why.PREFIX, prefix, CacheOutcome.PREFIX))
    for why, candidate, outcome in choices:
        if strict and not extends(candidate, request.messages):
            held_back = True
        elif candidate.snapshot.n_tokens > rules.n_ctx_slot:
            fits = False
        else:
            return Plan(why, candidate, outcome)
    if request.n_system is None or own is not None:
        return Plan(_miss(own, prefix, held_back, fits, request.kept), held_back=held_back)
    if system is None:
        if request.worth_warming:
            return Plan(Why.WARM_UP, warm_up=True, held_back=held_back)
        return Plan(_miss(own, prefix, held_back, fits, request.kept), held_back=held_back)
    if request.kept > 0 and request.kept >= request.n_system:
        return Plan(Why.IN_SLOT, held_back=held_back)  # the slot holds this system part (a conversation on it)
    if system.n_tokens < floor_tokens:
        return Plan(Why.TOO_SHORT, held_back=held_back)
    if system.n_tokens > rules.n_ctx_slot:
        return Plan(Why.TOO_LONG, held_back=held_back)
    return Plan(Why.SYSTEM, Candidate(system, request.n_system, system.n_tokens, False), CacheOutcome.RESTORED,
                held_back=held_back)


def _miss(own: Candidate | None, prefix: Candidate | None, held_back: bool, fits: bool, kept: int) -> Why:
    if held_back:
        return Why.NOT_EXTENDED
    if not fits:
        return Why.TOO_LONG
    shared = [c.messages for c in (own, prefix) if c is not None and c.messages > 0]
    if shared and kept < max(shared):
        return Why.TOO_SHORT  # a snapshot shares messages, but fewer tokens than are worth a restore
    return Why.IN_SLOT if kept > 0 else Why.NOTHING_SHARED
