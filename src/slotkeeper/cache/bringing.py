"""Bringing a state into a leased slot: of what the slot holds and the saved states that share something with the
request (conversations', system parts', side tasks'), the one the request starts from, and its restore.

The saved states are looked up by the request's message chains first; when those cannot tell which state shares the
most, by the request's exact tokens, asked of the backend (counted here). The planner decides (planner.py), the
reasons say why in words (reasons.py), the restorer restores (restoring.py). The pool leased the slot and keeps its
bookkeeping; this module only decides what the slot starts from, and brings it in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from slotkeeper.cache.capability import Strategy
from slotkeeper.cache.chain import Link, common_messages
from slotkeeper.cache.costs import CostMeter, Tier, floor_tokens
from slotkeeper.cache.evidence import CheckpointEvidence
from slotkeeper.cache.planner import InSlot, Plan, Request, Rules, plan
from slotkeeper.cache.proof import RestorePolicy
from slotkeeper.cache.reasons import Known, Reason, explain
from slotkeeper.cache.restoring import Restorer
from slotkeeper.cache.sidestates import side_key
from slotkeeper.cache.slots import SlotLease, SlotState
from slotkeeper.cache.snapshots import Found, Snapshots
from slotkeeper.cache.systemprompt import SystemPrompt
from slotkeeper.cache.tokens import Tokens, common_tokens
from slotkeeper.types import CacheOutcome, SessionKey, Snapshot

# The least a side task's prompt must have for its state to be kept for the next one, and the least a message must
# hold for the request's exact tokens to be asked for (a look-up costs a render and a tokenization), however little
# a restore costs (costs.py).
SIDE_MIN_TOKENS = 64
# Characters of canonical JSON per token, at the least (a token of text is a character or more): a message of N
# characters holds at most N tokens. What the chains leave unexplained is worth asking the backend's tokens for
# only when it may hold enough tokens; a request is surely smaller than a state only when its characters are.
_CHARS_PER_TOKEN = 1

# The request's tokens, asked for only when the message chains cannot tell which state shares the most.
TokenSource = Callable[[], Awaitable[Tokens | None]]
# Sessions remembered for their next turn's reason: seen since start, and what became of their slot state.
_SESSIONS_KEPT = 4096


class SessionNotes:
    """What the pool knew about each session besides its saved states, for its next turn's reason (reasons.py):
    whether it was seen since start, and what became of its state in its slot since its last turn. Noted by the
    pool (a slot taken, lost with the backend) and the warm-ups (a slot cut back to its system part)."""

    def __init__(self) -> None:
        self._seen: OrderedDict[SessionKey, None] = OrderedDict()
        # What became of a session's state in its slot since its last turn: another session took the slot, or the
        # backend lost it (reason and words), for that session's next turn.
        self._left: OrderedDict[SessionKey, tuple[Reason, str]] = OrderedDict()
        # The sessions whose slot was last taken, just after their turn, by a side task of theirs (OpenWebUI's
        # follow-ups and tags come after every answer): their next turn's state is saved at once (idlesaves.py).
        self._side_follows: OrderedDict[SessionKey, None] = OrderedDict()

    def seen(self, key: SessionKey) -> None:
        _remember(self._seen, key, None)

    def was_seen(self, key: SessionKey) -> bool:
        return key in self._seen

    def left(self, key: SessionKey, reason: Reason, detail: str) -> None:
        _remember(self._left, key, (reason, detail))

    def taken_after_turn(self, key: SessionKey, by_side_task: bool) -> None:
        """`key`'s slot was taken just after its turn ended, by a side task of its own or by anything else (its own
        next turn, another conversation's turn or side task)."""
        if by_side_task:
            _remember(self._side_follows, key, None)
        else:
            self._side_follows.pop(key, None)

    def side_task_follows(self, key: SessionKey) -> bool:
        """Whether the last time `key`'s turn ended, a side task took its slot right after."""
        return key in self._side_follows

    def continues(self, key: SessionKey, saved: SessionKey) -> None:
        """`key`'s turn starts from the state `saved` left (a chat without an id is known by another name at each
        turn): what followed that state's turn is expected to follow this one's."""
        if saved in self._side_follows:
            _remember(self._side_follows, key, None)

    def known(self, key: SessionKey, side: bool) -> Known:
        """What is known of `key` as its turn starts; a conversation's turn (not a side task's) is told what became
        of its slot state once, and is seen from now on."""
        known = Known(seen=key in self._seen)
        left = None if side else self._left.pop(key, None)
        if left is not None:
            known = Known(left=left[0], left_detail=left[1], seen=known.seen)
        if not side:
            self.seen(key)
        return known


class Bringer:
    def __init__(self, snapshots: Snapshots, policy: RestorePolicy, evidence: CheckpointEvidence, restorer: Restorer,
                 notes: SessionNotes, worth: Callable[[SystemPrompt], bool], min_restore_tokens: int | None,
                 n_ctx_slot: int, system_snapshots: bool, costs: CostMeter | None = None) -> None:
        self._snapshots = snapshots
        self._policy = policy
        self._evidence = evidence
        self._restorer = restorer
        self._notes = notes
        self._worth = worth  # the warm-ups': whether a system part may be long enough for a system state
        self._min_restore_tokens = min_restore_tokens
        self._n_ctx_slot = n_ctx_slot
        self._system_snapshots = system_snapshots
        self._costs = costs if costs is not None else CostMeter()
        # Requests whose tokens the planner asked the backend for (the chains could not tell), and the time it took.
        self.token_lookups = 0
        self.token_lookup_ms = 0.0

    async def bring_in(self, slot: SlotState, lease: SlotLease, in_slot: Sequence[Link],
                       previous: SessionKey | None, extended: bool, tokens: TokenSource | None,
                       saving: asyncio.Future[float] | None = None) -> None:
        """Find the saved states the request could start from, each with the tokens it shares with the request
        (the chains first; the request's exact tokens when they cannot tell), and do what the planner says
        (planner.py): restore the state that shares the most, or keep what the slot holds. `saving`: the backend's
        write of the slot's previous occupant, begun by the pool; the look-ups run beside it, and what the planner
        says is done once it is over (its time is the turn's `save_ms`)."""
        started = time.perf_counter()
        key = lease.key
        known = self._notes.known(key, lease.side)
        chain = lease.chain
        kept = shared = common_messages(in_slot, chain)  # what the slot's current content already gives for free
        if kept < len(in_slot) and self._policy.capability.needs_checkpoints:
            # A recurrent, hybrid or SWA slot rolls back only to its checkpoints (at the last user message and the
            # prompt's end): a request that leaves the slot's messages earlier than that reuses nothing of it.
            kept = 0
        system = lease.system if self._system_snapshots and not lease.side else None
        system_key = key.within(system.digest) if system is not None else None
        n_system = system.n_messages if system is not None else 0
        if self._policy.strategy is Strategy.KEEP_HOT and self._evidence.wanted and not key.is_default:
            # Whether this build keeps checkpoints in its slot files is learned from a save's file as it is
            # committed: a commit still running may change what this turn can do. Any commit, not only this
            # conversation's: its first turn was saved under a name of its own (serving/identity.py). Only until
            # the build is known, and bounded.
            await self._snapshots.caught_up()
        strategy = self._policy.strategy
        rules = Rules(strategy, self._min_restore_tokens, self._n_ctx_slot, self._costs.now())
        # A side task has no state of its own: what its name could find is the state an identical task left.
        named = side_key(key, chain) if lease.side else key
        found = Found(None, None, [])
        looks = not key.is_default and strategy is not Strategy.KEEP_HOT
        exact: Tokens | None = None
        if looks and lease.side and tokens is not None and not extended:
            # A side task's one message is held whole by no saved state but an identical task's, so its exact tokens
            # (asked of the backend since its slot was taken) are what finds what it shares: one look-up with them
            # instead of one by the chains and a second with the tokens.
            exact = await self._ask(tokens)
            lease.tokens = exact
        if looks:
            found = await self._snapshots.candidates(named, chain, exact, system_key, n_system)
        if not lease.side and self._one_off(slot, lease, in_slot, shared, previous, found):
            named, system, system_key = side_key(key, chain), None, None
            found = await self._snapshots.candidates(named, chain, None, None, 0)
        slot_tokens = _in_slot_tokens(slot, in_slot, kept)
        if (looks and exact is None and tokens is not None and not extended
                and self._needs_tokens(chain, kept, previous == key, found, lease.side)):
            exact = await self._ask(tokens)
            if exact is not None:
                lease.tokens = exact
                fate = found.fate  # what the first look-up found of the own state (a quarantine is done by then)
                found = await self._snapshots.candidates(named, chain, exact, system_key, n_system)
                found = found if found.fate is not None else dataclasses.replace(found, fate=fate)
        if (exact is not None and slot.tokens is not None
                and (kept == len(in_slot) or not self._policy.capability.needs_checkpoints)):
            slot_tokens = common_tokens(slot.tokens, exact)
        saved = found.saved
        # The slot shares at least what a saved state made of messages it holds too has (a count, not an estimate).
        slot_tokens = max([slot_tokens, *(c.tokens for c in saved if c.whole and 0 < c.messages <= kept)])
        request = Request(len(chain), system.n_messages if system is not None else None, default=key.is_default,
                          system_saved=found.system_saved, worth_cutting=system is not None and self._worth(system))
        chosen = plan(request, rules, InSlot(slot_tokens, kept, previous == key), saved)
        lease.cache.decide_ms = (time.perf_counter() - started) * 1000
        if saving is not None:
            # Shielded: a turn given up now still lets the save end (the pool waits for it before the slot is free).
            lease.cache.save_ms = await asyncio.shield(saving)
        await self._act(slot, lease, chosen, found, known, in_slot, kept, previous)

    async def _ask(self, tokens: TokenSource) -> Tokens | None:
        """The request's exact tokens, counted in the look-up statistics."""
        asked = time.perf_counter()
        exact = await tokens()
        self.token_lookups += 1
        self.token_lookup_ms += (time.perf_counter() - asked) * 1000
        return exact

    def _one_off(self, slot: SlotState, lease: SlotLease, in_slot: Sequence[Link], in_common: int,
                 previous: SessionKey | None, found: Found) -> bool:
        """A request under a conversation's name that shares no message with the conversation's state, and is
        much smaller than it (a client's title or summary request that no shape rule knew): it runs as a side request,
        so that the conversation's state is not replaced by it (its next request then finds its own state again).
        Turned into one here, its slot no longer attributes the conversation. `in_common`: the messages the request
        shares with the slot's, whatever the backend can roll back to (a compacted conversation that kept its system
        prompt is the conversation on every kind of model)."""
        chain = lease.chain
        if lease.key.is_default or not chain:
            return False
        if previous == lease.key and in_slot:
            shared, size = in_common, slot.n_prompt or slot.n_tokens
        elif found.own is not None and not found.own.whole:
            shared, size = found.own.messages, found.own.snapshot.owed_tokens
        else:
            return False
        if shared > 0 or chain[-1].chars // _CHARS_PER_TOKEN * 2 > size:
            return False
        lease.side, lease.system = True, None
        lease.cache.why = Reason.SIDE_TASK
        lease.cache.detail = (f"shares no message with its session's state ({size} tokens): run as a side request, "
                              "which leaves that state alone")
        slot.occupant = None  # and, its lease a side one now, it no longer counts as a conversation's turn (pool.py)
        return True

    def _needs_tokens(self, chain: Sequence[Link], kept: int, own_slot: bool, found: Found, side: bool) -> bool:
        """Whether the chains leave open which state shares the most with the request, by enough to matter: the
        first message that no state holds whole is long (a new conversation opening with reminders or a pasted
        document another one opened with too, a moved reminder block, dropped tool messages, an edited history),
        and it is not the session's own state that holds the most messages (its own version of that message shares
        the most of it)."""
        deepest = max([kept, *(c.messages for c in found.saved)])
        if deepest >= len(chain):
            return False
        own = max([kept if own_slot else -1, *(c.messages for c in found.saved if c.own)])
        if not side and own == deepest and deepest > 0:
            return False
        stake = chain[deepest].chars - (chain[deepest - 1].chars if deepest > 0 else 0)
        floor = floor_tokens(self._costs.now(), self._min_restore_tokens, Tier.RAM)
        return stake >= _CHARS_PER_TOKEN * max(floor, SIDE_MIN_TOKENS)

    async def _act(self, slot: SlotState, lease: SlotLease, chosen: Plan, found: Found, known: Known,
                   in_slot: Sequence[Link], kept: int, previous: SessionKey | None) -> None:
        if chosen.held_back:
            self._policy.skipped()  # a chance for a trial of the strategy before a fallback, if there is one
        lease.cut_system = chosen.cut_system
        if not lease.side:
            if chosen.restore is None and previous == lease.key and kept > 0:
                # The slot held the session's own state and still gives the most: the backend reuses up to the
                # message the client changed.
                lease.cache.outcome, lease.cache.why, lease.cache.changed_at = (CacheOutcome.HOT, Reason.REWRITTEN,
                                                                                kept)
                lease.cache.detail = f"message {kept + 1} differs from the history in the slot; reused up to there"
                return
            explained = explain(chosen, found.own, Known(found.fate, known.left, known.left_detail, known.seen))
            lease.cache.why, lease.cache.detail, lease.cache.changed_at = (explained.reason, explained.detail,
                                                                          explained.changed_at)
        if chosen.restore is None:
            return
        snapshot = chosen.restore.snapshot
        await self._restore(slot, lease, snapshot, chosen.outcome, chosen.owes, chosen.restore.tier)
        if not lease.side and lease.cache.restored_tokens > 0:
            self._notes.continues(lease.key, snapshot.key)
        if lease.side and lease.cache.outcome is not CacheOutcome.COLD:
            lease.cache.detail = (f"started from a saved state sharing {chosen.owes} tokens with the task "
                                  f"({snapshot.kind} {snapshot.session_id})")

    async def _restore(self, slot: SlotState, lease: SlotLease, snapshot: Snapshot, outcome: CacheOutcome,
                       expected: int, tier: Tier) -> None:
        if not self._restorer.fits(snapshot):
            return
        restored = await self._restorer.restore(slot.slot_id, lease.cache, snapshot, outcome, expected, tier)
        # A restore replaces the slot's content, a failed one empties it. The restored state's tokens are not read
        # here, on the turn's path: the turn's end records what the slot then holds (the request's tokens, when
        # they were asked for).
        slot.chain, slot.tokens = [], None
        if restored is not None:
            slot.n_tokens = restored


def _remember(memory: OrderedDict[SessionKey, Any], key: SessionKey, value: Any) -> None:
    memory.pop(key, None)
    memory[key] = value
    while len(memory) > _SESSIONS_KEPT:
        memory.popitem(last=False)


def _in_slot_tokens(slot: SlotState, in_slot: Sequence[Link], kept: int) -> int:
    """About how many tokens the slot's content gives a request that shares `kept` of its messages: its last prompt
    when the request has all of them, else that prompt's share by characters."""
    if kept <= 0 or not in_slot:
        return 0
    if kept >= len(in_slot):
        return slot.n_prompt or slot.n_tokens
    return int((slot.n_prompt or slot.n_tokens) * in_slot[kept - 1].chars / max(in_slot[-1].chars, 1))
