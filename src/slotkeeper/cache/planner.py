"""The planner: which state a request's slot should start from. A pure function of plain values: what the slot holds,
the saved states the store found (of every kind: conversations, system parts, side tasks), each with the tokens it
shares with the request, the thresholds, and the backend's strategy. The pool looks the candidates up, calls `plan`,
and does what it says. The rules are in docs/design-pool.md ("How a request's state is chosen").

The tokens decide: the state sharing the most tokens with the request wins, and on a near-tie the cheapest one
(what the slot holds, then a copy in RAM, then a file on disk; then the session's own state; then the smallest).
A session id is only a hint for that last tie.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from slotkeeper.cache.capability import Strategy
from slotkeeper.cache.costs import PRIOR_TOKENS, Costs, Tier, pays
from slotkeeper.types import CacheOutcome, Snapshot, SnapshotKind


class Why(enum.StrEnum):
    """Why the plan is what it is: the words a request's record uses for where its state came from, or for why the
    backend had to prefill."""

    OWN = "own"  # the session's own saved state
    PREFIX = "prefix"  # another saved state (a conversation's or a side task's) that shares the most
    SYSTEM = "system"  # a system part's saved state
    IN_SLOT = "in-slot"  # the slot already holds as much as any saved state would give
    NOTHING_SHARED = "nothing-shared"  # no saved state shares enough with the request
    TOO_SHORT = "too-short"  # a restore would cost more than a prefill of what it gives (costs.py)
    TOO_LONG = "too-long"  # the state has more tokens than a slot holds
    NOT_EXTENDED = "not-extended"  # this build can only extend a state, and the request does not
    KEEP_HOT = "keep-hot"  # restores cannot help on this backend (sessions stay hot in their slots)
    DEFAULT = "default-session"  # the catch-all session: never restored


# Candidates whose shared tokens differ by no more than this are a tie: the cheapest wins it.
NEAR_TIE_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Candidate:
    """A saved state the request could start from: `tokens` it shares with the request (counted one by one when
    `exact`, else estimated from the `messages` their chains share), and `whole`: the request holds every token of
    it (every message it was saved with)."""

    snapshot: Snapshot
    messages: int
    tokens: int
    whole: bool
    exact: bool = False
    tier: Tier = Tier.DISK
    own: bool = False  # the session's own conversation state (by name: a hint for ties only)


@dataclass(frozen=True, slots=True)
class InSlot:
    """What the slot's current content gives the request for free: `tokens` (about), `messages` of its chain, and
    whether it is the session's own state."""

    tokens: int = 0
    messages: int = 0
    own: bool = False


@dataclass(frozen=True, slots=True)
class Request:
    """The request: `messages` in its chain (0 for a raw prompt), `n_system` leading system messages (None: no
    system part), and whether a saved state of its system part exists (else, when it is worth one, the slot's state
    is cut back to it after the turn)."""

    messages: int
    n_system: int | None = None
    default: bool = False
    system_saved: bool = True
    worth_cutting: bool = False


@dataclass(frozen=True, slots=True)
class Rules:
    """The backend's strategy, its slot size, and when a restore pays: by the measured `costs`, or by the operator's
    fixed floor of tokens (`min_restore_tokens`; None: measured)."""

    strategy: Strategy
    min_restore_tokens: int | None = 0
    n_ctx_slot: int = 1 << 30
    costs: Costs = field(default_factory=Costs)


@dataclass(frozen=True, slots=True)
class Plan:
    """Restore `restore` (with `outcome` and the tokens it `owes`), or nothing. `held_back`: a restore was possible
    but the strategy did not allow it (a chance for a later trial). `cut_system`: after the turn, keep the system part
    of the slot's state as a saved state of its own (no state covers it yet)."""

    why: Why
    restore: Candidate | None = None
    outcome: CacheOutcome = CacheOutcome.COLD
    held_back: bool = False
    cut_system: bool = False

    @property
    def owes(self) -> int:
        return self.restore.tokens if self.restore is not None else 0


def extends(candidate: Candidate, request_messages: int) -> bool:
    """Whether the request strictly extends every token of the state: it holds a prompt and nothing generated, and
    the request has all of it and more (a request without messages: taken as doing so)."""
    if not candidate.snapshot.at_prompt_end or not candidate.whole:
        return False
    return request_messages == 0 or candidate.exact or request_messages > candidate.messages


def cost(candidate: Candidate) -> tuple[int, int, int, int, str]:
    """The order among near-ties: the cheapest tier, then the session's own state, then one the request holds whole
    (nothing of it to drop after the restore), then the fewest tokens to load; the file name last, so that the same
    candidates always give the same answer, in whatever order they were found."""
    return (candidate.tier, 0 if candidate.own else 1, 0 if candidate.whole else 1, candidate.snapshot.n_tokens,
            candidate.snapshot.filename)


def best(candidates: Sequence[Candidate]) -> Candidate | None:
    """The candidate sharing the most tokens, the cheapest of those within NEAR_TIE_TOKENS of the most."""
    if not candidates:
        return None
    most = max(c.tokens for c in candidates)
    return min((c for c in candidates if c.tokens >= most - NEAR_TIE_TOKENS), key=cost)


def plan(request: Request, rules: Rules, in_slot: InSlot = InSlot(), saved: Sequence[Candidate] = ()) -> Plan:
    """What to bring into the request's slot: the saved state that shares the most tokens with the request, if it
    shares more than the slot's content already does (beyond a near-tie) and enough to be worth a restore; else
    nothing (the backend reuses what the slot shares). Candidates are already checked (size, checksum,
    fingerprint)."""
    if request.default:
        return Plan(Why.DEFAULT)
    # A system part without a saved state of its own gets one, cut from this request's state after the turn, even
    # when another conversation's state covers it now: that one may be evicted, extended past it, or (on a build
    # that keeps no checkpoints in its files) impossible to cut back to it. (Whether a cut can help on the backend
    # is asked when it would be made: the strategy may be known only once a file was saved.)
    cut = request.n_system is not None and not request.system_saved and request.worth_cutting
    # What the slot holds is the cheapest candidate: a restore must share more than it, beyond a near-tie, and pay
    # for itself (costs.py).
    margin = in_slot.tokens + (NEAR_TIE_TOKENS if in_slot.tokens > 0 else 0)
    worth = [c for c in saved if (c.tokens > margin or _next_message(c, in_slot)) and _pays(c, in_slot, rules)]
    if rules.strategy is Strategy.KEEP_HOT:
        return Plan(Why.KEEP_HOT, held_back=bool(worth), cut_system=cut)
    fitting = [c for c in worth if c.snapshot.n_tokens <= rules.n_ctx_slot]
    usable = fitting
    if rules.strategy is Strategy.PROMPT_END:
        usable = [c for c in fitting if extends(c, request.messages)]
    chosen = best(usable)
    held_back = len(usable) < len(fitting)
    if chosen is not None:
        return Plan(_why(chosen), chosen, _outcome(chosen), held_back=held_back, cut_system=cut)
    if held_back:
        why = Why.NOT_EXTENDED
    elif len(fitting) < len(worth):
        why = Why.TOO_LONG
    elif any(c.tokens > 0 and not _pays(c, in_slot, rules) for c in saved) and not in_slot.tokens:
        why = Why.TOO_SHORT  # a state shares something, but less than a restore of it costs
    elif in_slot.tokens > 0 or in_slot.messages > 0:
        why = Why.IN_SLOT
    else:
        why = Why.NOTHING_SHARED
    return Plan(why, held_back=held_back, cut_system=cut)


def _pays(candidate: Candidate, in_slot: InSlot, rules: Rules) -> bool:
    """Whether the restore is worth its cost (costs.py): a state sharing PRIOR_TOKENS or more is unless it clearly
    loses to the prefill, one over a fixed floor always; below, what it gives beyond what the slot holds (the tokens
    it saves a prefill of) is weighed against the time to bring its bytes in. A near-tie the own state wins by its
    next message is weighed whole."""
    gain = candidate.tokens
    if (rules.min_restore_tokens is None and candidate.tokens < PRIOR_TOKENS
            and not _next_message(candidate, in_slot)):
        gain -= in_slot.tokens
    return pays(gain, candidate.snapshot.n_bytes, candidate.tier, rules.costs, rules.min_restore_tokens)


def _next_message(candidate: Candidate, in_slot: InSlot) -> bool:
    """A near-tie at the message level that the session's own state wins over another conversation's in the slot:
    both hold the same leading messages, and the own state holds the start of the next one too (the client edited
    or extended its own last message). Counted tokens need no such hint."""
    return (candidate.own and not candidate.exact and not candidate.whole and not in_slot.own
            and candidate.messages >= in_slot.messages > 0 and candidate.tokens >= in_slot.tokens - NEAR_TIE_TOKENS)


def _why(candidate: Candidate) -> Why:
    if candidate.own:
        return Why.OWN
    return Why.SYSTEM if candidate.snapshot.kind is SnapshotKind.SYSTEM else Why.PREFIX


def _outcome(candidate: Candidate) -> CacheOutcome:
    own = candidate.own or candidate.snapshot.kind is SnapshotKind.SYSTEM
    return CacheOutcome.RESTORED if own else CacheOutcome.PREFIX
