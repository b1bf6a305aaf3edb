"""The slot pool: the single owner of "slot i holds session S's state up to message k, changed since its last save".

Every decision (which slot, hot or not, who to save, what to restore) is taken synchronously right after the pool
wakes up, never on a value read before an `await`; the slow work (save, restore) then runs while the slot is busy,
except a save's commit, which need not hold the slot (snapshots.py). See docs/design-pool.md for the rules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from slotkeeper.cache.budget import DiskBudget, SnapshotId
from slotkeeper.cache.capability import ArchKind, Capability, Strategy
from slotkeeper.cache.chain import Link, common_prefix
from slotkeeper.cache.cutting import cut_to, system_prefix
from slotkeeper.cache.events import CacheEvents
from slotkeeper.cache.evidence import CheckpointEvidence
from slotkeeper.cache.planner import InSlot, Plan, Request, Rules, plan
from slotkeeper.cache.proof import RestorePolicy
from slotkeeper.cache.reasons import Known, Reason, explain
from slotkeeper.cache.restoring import Restorer
from slotkeeper.cache.saving import Saver
from slotkeeper.cache.sidestates import side_key
from slotkeeper.cache.slots import Held, SlotLease, SlotState, TurnEnd
from slotkeeper.cache.snapshots import Found, Snapshots, key_of, snapshot_id
from slotkeeper.cache.systemprompt import SystemPrompt
from slotkeeper.cache.tokens import Tokens
from slotkeeper.cache.tokens import common_prefix as common_tokens
from slotkeeper.errors import NotFound, Overloaded, SaveFailed, SlotkeeperError
from slotkeeper.types import CacheOutcome, SessionKey, Snapshot, SnapshotKind
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.health import BackendHealth
from slotkeeper.version import Version

log = logging.getLogger("slotkeeper.pool")

# System prompts found too short to be worth a snapshot, remembered so they are not warmed up again.
_SHORT_SYSTEMS_KEPT = 1024
# The least a side task's prompt must have for its state to be kept for the next one (the tasks' template alone, a
# few dozen tokens, is not worth one), whatever --min-restore-tokens says.
_SIDE_MIN_TOKENS = 64
# A side task waits for a conversation's request only when none ran within this long: a task sent just after an
# answer (follow-ups, tags) has nothing to wait for; a new chat's title, sent just before its first request, has.
SIDE_FOLLOWS_SECONDS = 2.0
# Characters of canonical JSON per token, at the least (a token of text is a character or more): a message of N
# characters holds at most N tokens. What the chains leave unexplained is worth asking the backend's tokens for
# only when it may hold enough tokens; a request is surely smaller than a state only when its characters are.
_CHARS_PER_TOKEN = 1

# The request's tokens, asked for only when the message chains cannot tell which state shares the most.
TokenSource = Callable[[], Awaitable[Tokens | None]]
# Sessions remembered for their next turn's reason: seen since start, and what became of their slot state.
_SESSIONS_KEPT = 4096
# The shortest idle time before a changed slot is saved (when --save-idle-seconds is longer): an agent's next request
# after a quick tool call, or a side task right after the answer, comes back within it and waits for no save.
IDLE_SAVE_FLOOR_SECONDS = 0.25


@dataclass(eq=False)
class _Waiter:
    """A queued request for a slot: `choose` says which slot would do right now, or None."""

    choose: Callable[[], SlotState | None]
    future: asyncio.Future[SlotState]
    side: bool = False


class SlotPool:
    def __init__(
        self,
        n_slots: int,
        client: UpstreamClient,
        snapshots: Snapshots,
        fingerprint: str,
        n_ctx_slot: int,
        save_idle_seconds: float = 2.0,
        min_restore_tokens: int = 0,
        max_queue: int = 0,
        system_snapshots: bool = True,
        budget: DiskBudget | None = None,
        capability: Capability | None = None,
        health: BackendHealth | None = None,
        side_hold_seconds: float = 0.0,
    ) -> None:
        self.slots = [SlotState(i) for i in range(n_slots)]
        self._client = client
        # Whether the backend is up: an idle save waits for it, and one that failed while it was away is tried again.
        self._health = health
        self._n_ctx_slot = n_ctx_slot
        self._save_idle_seconds = save_idle_seconds
        self._min_restore_tokens = min_restore_tokens
        self._max_queue = max_queue
        self._side_hold_seconds = side_hold_seconds
        self._system_snapshots = system_snapshots
        self._short_systems: deque[str] = deque(maxlen=_SHORT_SYSTEMS_KEPT)
        self._seen: OrderedDict[SessionKey, None] = OrderedDict()
        # What became of a session's state in its slot since its last turn: another session took the slot, or the
        # backend lost it (reason and words), for that session's next turn.
        self._left: OrderedDict[SessionKey, tuple[Reason, str]] = OrderedDict()
        self._waiters: deque[_Waiter] = deque()
        # Side tasks held back (see `_hold_side`), each woken when a conversation's request is queued.
        self._held_sides: set[asyncio.Event] = set()
        # When a conversation's turn last ended (monotonic), and how many run now: a side task waits for a
        # conversation's request only when neither says one was just answered.
        self._turns_running = 0
        self._last_turn_end = float("-inf")
        self._timers: set[asyncio.Task[None]] = set()
        # System parts evaluated into a slot (an operator's pre-warm, or a slot's state cut back to its system part
        # after a turn), and failures.
        self.warm_ups = 0
        self.failed_warm_ups = 0
        self.cuts = 0
        # Requests whose tokens the planner asked the backend for (the chains could not tell), and the time it took.
        self.token_lookups = 0
        self.token_lookup_ms = 0.0
        self.policy = RestorePolicy(capability or Capability("", ArchKind.UNKNOWN, None))
        self._evidence = CheckpointEvidence(self.policy, snapshots.appendix_extent)
        self.events = CacheEvents()
        # The one holder of the snapshots: the pool saves and looks up through it, and so does the web layer.
        self.snapshots = snapshots
        self.saver = Saver(client, snapshots, self._evidence, self.policy, self.slots)
        self.restorer = Restorer(client, snapshots, self.events, self.policy, n_ctx_slot)
        snapshots.attach(client, fingerprint, budget or DiskBudget(), self.events,
                         lambda: [snapshot_id(s.occupant, s.kind) for s in self.slots if s.occupant is not None],
                         self._evidence.inspect)

    # Saves, failed saves and budget evictions: counted by the snapshots when a save's commit is done.
    @property
    def saves(self) -> int:
        return self.snapshots.saves

    @property
    def failed_saves(self) -> int:
        return self.snapshots.failed_saves

    @property
    def evictions(self) -> int:
        return self.snapshots.evictions

    # Restores, and those the backend refused or broke off: counted by the restorer.
    @property
    def restores(self) -> int:
        return self.restorer.restores

    @property
    def failed_restores(self) -> int:
        return self.restorer.failed_restores

    # Prompt-end steps made before saves, the tokens they processed and the time they took: counted by the saver.
    @property
    def prompt_end_steps(self) -> int:
        return self.saver.prompt_end_steps

    @property
    def prompt_end_tokens(self) -> int:
        return self.saver.prompt_end_tokens

    @property
    def prompt_end_ms(self) -> float:
        return self.saver.prompt_end_ms

    @property
    def budget(self) -> DiskBudget:
        return self.snapshots.budget

    @property
    def queue_length(self) -> int:
        return len(self._waiters)

    # -- leasing --------------------------------------------------------------------------------------------

    async def acquire(self, key: SessionKey, chain: Sequence[Link] = (), side: bool = False,
                      system: SystemPrompt | None = None, tokens: TokenSource | None = None) -> SlotLease:
        """Wait for a slot for `key`, bring the state that shares the most with the request into it, and lease it.

        `chain` is the request's message chain, `system` its system part (what the slot's state is cut back to
        after the turn when no saved state covers it yet), and `tokens` gives the request's tokens when the chains
        cannot tell which state shares the most (planner.py; docs/design-pool.md).

        A side request (a title or tag task sent under a conversation's id, or a one-off request that shares little
        with it) must not take the conversation's state away: it gets a slot that holds no unsaved session when
        there is one, the slot's changed occupant is saved first, and afterwards the slot holds the task's own
        state, kept as a side state when it is long enough to be worth one, never as the conversation's.
        """
        if side and self._side_hold_seconds > 0 and self._may_be_followed():
            # OpenWebUI sends a new chat's title task a few ms before the chat's request: that one goes first.
            await self._hold_side()
        choose = (lambda: self._choose_side(key)) if side else (lambda: self._choose(key, chain))
        slot = await self._take(choose, bounded=True, side=side)
        previous, previous_dirty, in_slot = slot.occupant, slot.dirty, slot.chain
        held = Held.of(slot)
        extended = _extends(in_slot, chain, previous == key and not side)
        slot.occupant, slot.kind, slot.dirty = (None if side else key), SnapshotKind.SESSION, False
        slot.generation += 1
        pending_cut, slot.cut = slot.cut, None
        lease = SlotLease(slot.slot_id, key, side=side, chain=list(chain), system=system, _release=self._finish)
        if not side:
            self._turns_running += 1
        if previous is not None and previous != key:
            taker = "a side task" if side else f"session {key.session_id}"
            self._remember(self._left, previous, (Reason.SLOT_TAKEN, f"slot {slot.slot_id} was taken by {taker}"))
        if side:
            lease.cache.why = Reason.SIDE_TASK
        if extended and previous == key and not side:
            # The request holds every message the slot's state was made of: nothing saved can share more (it would
            # have to hold this request's new messages already).
            slot.dirty = previous_dirty
            lease.cache.outcome, lease.cache.why = CacheOutcome.HOT, Reason.HOT
            self._remember(self._seen, key, None)
            lease.tokens = slot.tokens
            lease.cut_system = pending_cut is not None  # still to be cut once the conversation pauses
            return lease
        try:
            if previous is not None and previous_dirty:
                lease.cache.save_ms = await self.saver.save(slot.slot_id, previous, held, wait=False)
            await self._bring_in(slot, lease, in_slot, previous, extended, tokens)
        except BaseException:
            lease.release(TurnEnd.FAILED)
            raise
        return lease

    def _may_be_followed(self) -> bool:
        """Whether a conversation's request may follow a side task: none is running, and none was just answered."""
        return self._turns_running == 0 and time.monotonic() - self._last_turn_end > SIDE_FOLLOWS_SECONDS

    async def _hold_side(self) -> None:
        """Hold a side task back until a conversation's request is queued (side tasks are served after it), or for
        at most the hold: the task waits for that request, never for the rest of the hold once it came."""
        came = asyncio.Event()
        self._held_sides.add(came)
        try:
            await asyncio.wait_for(came.wait(), self._side_hold_seconds)
        except TimeoutError:
            pass
        finally:
            self._held_sides.discard(came)

    def _choose(self, key: SessionKey, chain: Sequence[Link] = ()) -> SlotState | None:
        own = next((s for s in self.slots if s.occupant == key), None)
        if own is not None:
            return None if own.busy else own  # one session's turns run one after another, in its own slot
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        # An idle slot holding a state the request extends (whatever its name: a client that changed its id); then
        # an empty slot; then the least recently used one.
        extended = [s for s in idle if s.chain and common_prefix(s.chain, chain) == len(s.chain)]
        if extended:
            return max(extended, key=lambda s: len(s.chain))
        return min(idle, key=lambda s: (s.occupant is not None, s.last_used))

    def _choose_side(self, key: SessionKey | None = None) -> SlotState | None:
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        # Best: an empty slot; then the slot of the conversation the task belongs to (`key`): its user is reading
        # the answer the task is about, while another conversation in its slot (an agent) may be back at once;
        # then one whose state is already on disk; last, the least recently used.
        return min(idle, key=lambda s: (s.occupant is not None, key is None or s.occupant != key, s.dirty,
                                        s.last_used))

    async def _take(self, choose: Callable[[], SlotState | None], bounded: bool = False,
                    side: bool = False) -> SlotState:
        """Queue for a slot; slots are handed out in arrival order to the first waiter that can use them, side tasks
        after every conversation's request (when side tasks are held back at all)."""
        waiter = _Waiter(choose, asyncio.get_running_loop().create_future(), side)
        self._waiters.append(waiter)
        self._dispatch()
        if not side:
            for held in self._held_sides:
                held.set()  # this request is served first now: the held side tasks may queue behind it
        if bounded and self._max_queue and not waiter.future.done() and len(self._waiters) > self._max_queue:
            self._waiters.remove(waiter)
            raise Overloaded(f"{self._max_queue} requests are already waiting for a slot; try again shortly")
        try:
            return await waiter.future
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().busy = False  # handed a slot, but cancelled before using it
                self._dispatch()
            raise

    def _dispatch(self) -> None:
        """Give free slots to queued waiters, oldest first (side tasks last, when they are held back). Synchronous:
        no state is read across an await."""
        waiters = list(self._waiters)
        if self._side_hold_seconds > 0:
            waiters.sort(key=lambda w: w.side)  # stable: arrival order within each
        for waiter in waiters:
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            slot = waiter.choose()
            if slot is not None:
                slot.busy = True
                self._waiters.remove(waiter)
                waiter.future.set_result(slot)

    def _finish(self, lease: SlotLease, end: TurnEnd, n_tokens: int, cache_n: int | None, n_prompt: int) -> None:
        slot = self.slots[lease.slot_id]
        slot.busy = False
        slot.last_used = time.monotonic()
        if not lease.side:
            self._turns_running -= 1
            self._last_turn_end = slot.last_used
        if lease.existing is not None:
            pass  # a pre-warm that found its snapshot on disk did not touch the slot
        elif lease.side and lease.system is not None:
            # A pre-warm: a completed one leaves its system part in the slot, for the next conversation on it.
            slot.occupant, slot.dirty, slot.forgotten_in, slot.replay = None, False, None, None
            if end is not TurnEnd.COMPLETED:
                slot.chain, slot.tokens, slot.n_tokens, slot.n_prompt, slot.at_prompt_end = [], None, 0, 0, False
        elif end is TurnEnd.FAILED or slot.forgotten_in == slot.generation or lease.side:
            slot.occupant, slot.dirty, slot.n_tokens, slot.n_prompt = None, False, 0, 0
            slot.chain, slot.tokens, slot.forgotten_in = [], None, None
            slot.replay, slot.at_prompt_end = None, False
            if end is TurnEnd.COMPLETED and lease.side:
                self._keep_side_state(slot, lease, n_tokens, n_prompt)
        elif end in (TurnEnd.COMPLETED, TurnEnd.CANCELLED):
            slot.dirty = not lease.key.is_default
            slot.n_tokens = n_tokens or slot.n_tokens
            slot.chain = lease.chain
            slot.tokens = lease.tokens
            slot.n_prompt = n_prompt
            # A cut-short turn is saved as it is: replaying its prompt could mean its whole prefill again.
            slot.replay = lease.replay if end is TurnEnd.COMPLETED else None
            slot.at_prompt_end = False
            if end is TurnEnd.COMPLETED and lease.cut_system and slot.dirty and lease.system is not None:
                slot.cut = lease.system
        if end is TurnEnd.COMPLETED and cache_n is not None and lease.cache.expected_reuse > 0:
            self.restorer.judge(lease, cache_n)
        self._dispatch()
        if slot.dirty:
            self._schedule_idle_save(slot)

    # -- bringing a state in --------------------------------------------------------------------------------

    async def _bring_in(self, slot: SlotState, lease: SlotLease, in_slot: Sequence[Link],
                        previous: SessionKey | None, extended: bool, tokens: TokenSource | None) -> None:
        """Find the saved states the request could start from, each with the tokens it shares with the request
        (the chains first; the request's exact tokens when they cannot tell), and do what the planner says
        (planner.py): restore the state that shares the most, or keep what the slot holds."""
        started = time.perf_counter()
        key = lease.key
        known = Known(seen=key in self._seen)
        left = None if lease.side else self._left.pop(key, None)
        if left is not None:
            known = Known(left=left[0], left_detail=left[1], seen=known.seen)
        if not lease.side:
            self._remember(self._seen, key, None)
        chain = lease.chain
        kept = common_prefix(in_slot, chain)  # what the slot's current content already gives for free
        if kept < len(in_slot) and self.policy.capability.needs_checkpoints:
            # A recurrent, hybrid or SWA slot rolls back only to its checkpoints (at the last user message and the
            # prompt's end): a request that leaves the slot's messages earlier than that reuses nothing of it.
            kept = 0
        system = lease.system if self._system_snapshots and not lease.side else None
        system_key = SessionKey(key.model, system.digest) if system is not None else None
        n_system = system.n_messages if system is not None else 0
        if self.policy.strategy is Strategy.KEEP_HOT and self._evidence.wanted and not key.is_default:
            # Whether this build keeps checkpoints in its slot files is learned from a save's file as it is
            # committed: a commit of this conversation's state still running may change what this turn can do.
            await self.snapshots.settled(key)
        strategy = self.policy.strategy
        rules = Rules(strategy, self._min_restore_tokens, self._n_ctx_slot)
        # A side task has no state of its own: what its name could find is the state an identical task left.
        named = side_key(key.model, chain) if lease.side else key
        found = Found(None, None, [])
        if not key.is_default and strategy is not Strategy.KEEP_HOT:
            found = await self.snapshots.candidates(named, chain, None, system_key, n_system)
        if not lease.side and self._one_off(slot, lease, in_slot, kept, previous, found):
            named, system, system_key = side_key(key.model, chain), None, None
            found = await self.snapshots.candidates(named, chain, None, None, 0)
        slot_tokens = _in_slot_tokens(slot, in_slot, kept)
        if (not key.is_default and strategy is not Strategy.KEEP_HOT and tokens is not None and not extended
                and self._needs_tokens(chain, kept, previous == key, found, lease.side)):
            asked = time.perf_counter()
            exact = await tokens()
            self.token_lookups += 1
            self.token_lookup_ms += (time.perf_counter() - asked) * 1000
            if exact is not None:
                lease.tokens = exact
                fate = found.fate  # what the first look-up found of the own state (a quarantine is done by then)
                found = await self.snapshots.candidates(named, chain, exact, system_key, n_system)
                found = found if found.fate is not None else dataclasses.replace(found, fate=fate)
                if slot.tokens is not None and (kept == len(in_slot) or not self.policy.capability.needs_checkpoints):
                    slot_tokens = common_tokens(slot.tokens, exact)
        saved = found.saved
        # The slot shares at least what a saved state made of messages it holds too has (a count, not an estimate).
        slot_tokens = max([slot_tokens, *(c.tokens for c in saved if c.whole and 0 < c.messages <= kept)])
        request = Request(len(chain), system.n_messages if system is not None else None, default=key.is_default,
                          system_saved=found.system_saved, worth_cutting=system is not None and self._worth(system))
        chosen = plan(request, rules, InSlot(slot_tokens, kept, previous == key), saved)
        lease.cache.decide_ms = (time.perf_counter() - started) * 1000
        await self._act(slot, lease, chosen, found, known, in_slot, kept, previous)

    def _one_off(self, slot: SlotState, lease: SlotLease, in_slot: Sequence[Link], kept: int,
                 previous: SessionKey | None, found: Found) -> bool:
        """A request under a conversation's name that shares no message with the conversation's state, and is
        much smaller than it (a client's title or summary request that no shape rule knew): it runs as a side request,
        so that the conversation's state is not replaced by it (its next request then finds its own state again).
        Turned into one here, its slot no longer attributes the conversation."""
        chain = lease.chain
        if lease.key.is_default or not chain:
            return False
        if previous == lease.key and in_slot:
            shared, size = kept, slot.n_prompt or slot.n_tokens
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
        slot.occupant = None
        self._turns_running -= 1
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
        return stake >= _CHARS_PER_TOKEN * max(self._min_restore_tokens, _SIDE_MIN_TOKENS)

    async def _act(self, slot: SlotState, lease: SlotLease, chosen: Plan, found: Found, known: Known,
                   in_slot: Sequence[Link], kept: int, previous: SessionKey | None) -> None:
        if chosen.held_back:
            self.policy.skipped()  # a chance for a trial of the strategy before a fallback, if there is one
        lease.cut_system = chosen.cut_system
        if lease.side:
            if chosen.restore is not None:
                await self._restore(slot, lease, chosen.restore.snapshot, chosen.outcome, chosen.owes)
                if lease.cache.outcome is not CacheOutcome.COLD:
                    lease.cache.detail = (f"started from a saved state sharing {chosen.owes} tokens with the task "
                                          f"({chosen.restore.snapshot.kind} {chosen.restore.snapshot.session_id})")
            return
        if chosen.restore is None and previous == lease.key and kept > 0:
            # The slot held the session's own state and still gives the most: the backend reuses up to the message
            # the client changed.
            lease.cache.outcome, lease.cache.why, lease.cache.changed_at = CacheOutcome.HOT, Reason.REWRITTEN, kept
            lease.cache.detail = f"message {kept + 1} differs from the history in the slot; reused up to there"
            return
        explained = explain(chosen, found.own, Known(found.fate, known.left, known.left_detail, known.seen))
        lease.cache.why, lease.cache.detail, lease.cache.changed_at = (explained.reason, explained.detail,
                                                                      explained.changed_at)
        if chosen.restore is not None:
            await self._restore(slot, lease, chosen.restore.snapshot, chosen.outcome, chosen.owes)

    def _keep_side_state(self, slot: SlotState, lease: SlotLease, n_tokens: int, n_prompt: int) -> None:
        """A side task ended: where its prompt is long enough for a later task to be worth restoring from, the slot
        keeps its state as a side state (saved like a conversation's: on a switch, when idle, at exit; the disk
        budget keeps the last few per model)."""
        if not lease.chain or self.policy.strategy is not Strategy.RESTORE:
            return
        if n_prompt < 2 * max(self._min_restore_tokens, _SIDE_MIN_TOKENS):
            return
        slot.occupant, slot.kind, slot.dirty = side_key(lease.key.model, lease.chain), SnapshotKind.SIDE, True
        slot.chain, slot.tokens = lease.chain, lease.tokens
        slot.n_tokens, slot.n_prompt = n_tokens or n_prompt, n_prompt

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` as a task the pool keeps (aclose cancels and awaits them)."""
        task = asyncio.get_running_loop().create_task(work)
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    def _worth(self, system: SystemPrompt) -> bool:
        # About two characters of canonical JSON per token at the least: shorter prompts cannot reach the threshold.
        return system.chars >= 2 * self._min_restore_tokens and system.digest not in self._short_systems

    async def save_system(self, lease: SlotLease, n_tokens: int, wait: bool = True) -> Snapshot | None:
        """The caller warmed the leased slot up with the lease's system part (`n_tokens` prompt tokens): keep it as
        the system snapshot, unless it is too short to be worth one. Only called after a warm-up that succeeded.

        With `wait`, the snapshot is returned once committed (a pre-warm reports it). Without, only the backend's
        write of the slot is waited for, and the commit goes on in the background."""
        system = lease.system
        assert system is not None
        self.warm_ups += 1
        slot = self.slots[lease.slot_id]
        return await self._save_system_part(slot, lease.key.model, system, n_tokens, wait, lease)

    async def _save_system_part(self, slot: SlotState, model: str, system: SystemPrompt, n_tokens: int, wait: bool,
                                lease: SlotLease | None = None) -> Snapshot | None:
        """The slot holds exactly `system`'s part (`n_tokens`): save it as a system state, unless it is too short."""
        slot.chain = system.chain()
        slot.n_tokens = slot.n_prompt = n_tokens
        slot.replay, slot.at_prompt_end, slot.tokens = None, True, None
        if n_tokens < max(self._min_restore_tokens, 1):
            self._short_systems.append(system.digest)
            log.info("system prompt %s has %d tokens, fewer than --min-restore-tokens: no system snapshot",
                     system.short_id, n_tokens)
            return None
        key = SessionKey(model, system.digest)
        waited = await self.saver.save(slot.slot_id, key, Held.of(slot), SnapshotKind.SYSTEM, wait=wait)
        if lease is not None:
            lease.cache.save_ms += waited
        return await self.snapshots.get(key, SnapshotKind.SYSTEM) if wait else None

    def warm_up_failed(self, lease: SlotLease) -> None:
        """The warm-up request failed: nothing is saved, and the slot's content is not known any more."""
        self.failed_warm_ups += 1
        self.slots[lease.slot_id].chain = []
        self.slots[lease.slot_id].tokens = None

    async def warm_lease(self, model: str, system: SystemPrompt) -> SlotLease:
        """Lease a slot to warm `system` up ahead of time (an operator's pre-warm). The lease's `existing` is the
        system snapshot already on disk, if any (then there is nothing to do). Release it like a side request."""
        slot = await self._take(self._choose_side, bounded=True)
        previous, previous_dirty, held = slot.occupant, slot.dirty, Held.of(slot)
        slot.occupant, slot.dirty = None, False
        slot.generation += 1
        key = SessionKey(model, system.digest)
        lease = SlotLease(slot.slot_id, key, side=True, chain=system.chain(), system=system, _release=self._finish)
        try:
            lease.existing = await self.snapshots.system(key)
            if lease.existing is None and previous is not None and previous_dirty:
                lease.cache.save_ms = await self.saver.save(slot.slot_id, previous, held, wait=False)
        except BaseException:
            lease.release(TurnEnd.FAILED)
            raise
        if lease.existing is not None:
            # Nothing to do: the slot keeps what it held, unsaved changes included.
            slot.occupant, slot.dirty = previous, previous_dirty
        return lease

    async def _restore(self, slot: SlotState, lease: SlotLease, snapshot: Snapshot, outcome: CacheOutcome,
                       expected: int) -> None:
        if not self.restorer.fits(snapshot):
            return
        restored = await self.restorer.restore(slot.slot_id, lease.cache, snapshot, outcome, expected)
        slot.chain = []  # a restore replaces the slot's content, a failed one empties it
        slot.tokens = None
        if restored is not None:
            slot.n_tokens = restored
            slot.tokens = await self.snapshots.tokens_of(snapshot)

    def learn_from_disk(self) -> None:
        """In a worker thread at start: what the newest snapshots of this backend tell about its build."""
        self._evidence.from_files(self.snapshots.mine_now())

    # -- idle saves ----------------------------------------------------------------------------------------

    def _schedule_idle_save(self, slot: SlotState) -> None:
        if self._save_idle_seconds < 0:
            return
        self._in_background(self._idle_save(slot, slot.generation))

    def _idle_delay(self, slot: SlotState) -> float:
        """How long a changed slot stays idle before it is saved: `save_idle_seconds` at most; a state the backend
        writes quickly sooner, after twice its expected save time and at least IDLE_SAVE_FLOOR_SECONDS. A
        conversation that comes back within that finds its slot unsaved and hot; one that comes back later, or
        another conversation that needs the slot, finds the state on disk already and waits for no save."""
        cap = self._save_idle_seconds
        expected = self.saver.expected_seconds(slot.n_tokens)
        if expected is None:
            return cap
        return min(cap, max(IDLE_SAVE_FLOOR_SECONDS, 2 * expected))

    async def _idle_save(self, slot: SlotState, generation: int) -> None:
        delay = self._idle_delay(slot)
        await asyncio.sleep(delay)
        if delay < self._save_idle_seconds and any(s.busy for s in self.slots if s is not slot):
            # The backend writes a slot between decode steps of every slot: while another slot generates, the save
            # pauses it (docs/design-pool.md), so it waits the full idle time as it always did.
            await asyncio.sleep(self._save_idle_seconds - delay)
        if self._health is not None:
            await self._health.wait_up()  # a save sent to a backend that is away would fail and lose the turn
        if slot.busy or slot.generation != generation or not slot.dirty or slot.occupant is None:
            return
        if await self._save_held(slot) and slot.cut is not None and slot.generation == generation:
            await self._cut_held(slot)

    async def _save_held(self, slot: SlotState) -> bool:
        """Take an idle slot, save its dirty occupant, and give the slot back; True when the backend wrote it. A
        save that failed because the backend went away leaves the slot changed, saved once the backend is back (or
        forgotten, if it restarted)."""
        key = slot.occupant
        assert key is not None
        slot.busy = True
        slot.dirty = False
        generation = slot.generation
        saved = 0.0
        try:
            saved = await self.saver.save(slot.slot_id, key, Held.of(slot), wait=False)  # free again once written
        finally:
            self._give_back(slot)
        if (not saved and self._health is not None and not self._health.up and slot.generation == generation
                and slot.occupant == key and not slot.busy):
            slot.dirty = True
            self._schedule_idle_save(slot)
        return bool(saved)

    async def _cut_held(self, slot: SlotState) -> None:
        """The slot's conversation is saved and idle, and no saved state covers its system part: cut the slot's
        state back to that part (cutting.py) and save it as a system state, which every later conversation on it
        starts from, as does this one's next turn after restoring its own state. Off the requests' path; a failure
        costs only the system state."""
        system, key = slot.cut, slot.occupant
        slot.cut = None
        if system is None or key is None or slot.busy or slot.dirty:
            return
        if self.policy.strategy is Strategy.KEEP_HOT:
            # The file just saved may tell that this build keeps checkpoints in its files (then restores help).
            await self.snapshots.settle(key)
            if self.policy.strategy is Strategy.KEEP_HOT or slot.busy or slot.occupant != key or slot.dirty:
                return  # under keep-hot no state is restored: a system state could never help
        if await self.snapshots.get(SessionKey(key.model, system.digest), SnapshotKind.SYSTEM) is not None:
            return  # another slot's cut saved it meanwhile
        slot.busy = True
        started = time.perf_counter()
        try:
            prefix = await system_prefix(self._client, system)
            if prefix is None:
                return
            slot.occupant, slot.chain, slot.tokens = None, [], None  # from here the slot holds no session's state
            self._remember(self._left, key, (Reason.SLOT_TAKEN, f"slot {slot.slot_id} was cut back to its system "
                                                                "part, which was saved for later conversations"))
            n_tokens = await cut_to(self._client, slot.slot_id, prefix)
            self.cuts += 1
            await self._save_system_part(slot, key.model, system, n_tokens, wait=False)
            log.info("slot %d cut back to system prompt %s after %s's turn: %d tokens in %.0f ms", slot.slot_id,
                     system.short_id, key.session_id, n_tokens, (time.perf_counter() - started) * 1000)
        except SlotkeeperError as exc:
            self.failed_warm_ups += 1
            slot.chain, slot.tokens, slot.n_tokens, slot.n_prompt, slot.at_prompt_end = [], None, 0, 0, False
            log.warning("cutting slot %d back to system prompt %s failed, so no system state was saved: %s",
                        slot.slot_id, system.short_id, exc.message)
        finally:
            self._give_back(slot)

    def _give_back(self, slot: SlotState) -> None:
        """Free a slot taken for a save (not leased): if its session was deleted meanwhile, the slot no longer holds
        it (its state stays in the slot, attributed to nobody)."""
        slot.busy = False
        if slot.forgotten_in == slot.generation:
            slot.occupant, slot.dirty, slot.forgotten_in = None, False, None
        self._dispatch()

    async def pin(self, snapshot: Snapshot) -> Snapshot | None:
        """Keep a snapshot from the disk budget; returns it as indexed now (None if it is gone)."""
        return await self.snapshots.set_pinned(key_of(snapshot), True, snapshot.kind)

    async def import_snapshot(self, key: SessionKey, temp: str, n_tokens: int, chain: Sequence[Link], n_bytes: int,
                              kind: SnapshotKind = SnapshotKind.SESSION, n_prompt: int = 0,
                              version: Version | None = None) -> Snapshot:
        """Make an uploaded file (`temp`, checked) `key`'s snapshot: a copy at `version` (refused with OlderVersion
        unless newer than the state here), or with None a new version, as a save made here. The slots stop
        attributing the session first, so that no older state of it in a slot is saved over the import, and the
        commit lands after the saves of it already started (snapshots.py)."""
        if kind is SnapshotKind.SESSION:
            self.forget(key)
        self._evidence.saving()  # the imported file is inspected as a saved one is: it may tell about the build
        return await self.snapshots.commit_import(key, temp, n_tokens, chain, n_bytes, kind, n_prompt, version)

    async def settle(self, key: SessionKey | None = None, kind: SnapshotKind = SnapshotKind.SESSION,
                     timeout: float | None = None) -> bool:
        """Wait for the saves started so far (of `key`'s snapshot of `kind`, or of every snapshot) to be committed
        or to fail; True when none of them is left running."""
        return await self.snapshots.settle(key, kind, timeout)

    async def enforce_budget(self, also_keep: set[SnapshotId] | None = None) -> int:
        """Evict what the disk budget does not allow, never a snapshot whose session a slot holds (nor `also_keep`).
        Returns how many were evicted; a failure is logged and leaves everything in place."""
        return await self.snapshots.enforce_budget(also_keep)

    # -- operator actions -----------------------------------------------------------------------------------

    async def flush(self) -> Flushed:
        """Save every changed slot (waiting for running turns), and wait until every save started so far is
        committed; returns how many of those slots were saved, and how many failed. Used at shutdown."""
        commits: list[asyncio.Task[bool]] = []
        failed = 0
        for slot in self.slots:
            await self._take(lambda s=slot: None if s.busy else s)  # type: ignore[misc]
            try:
                if slot.dirty and slot.occupant is not None:
                    slot.dirty = False
                    # Not waited for here: the next slot's save overlaps this one's commit.
                    commit = await self.saver.start(slot.slot_id, slot.occupant, Held.of(slot))
                    if commit is None:
                        failed += 1
                    else:
                        commits.append(commit)
            finally:
                self._give_back(slot)
        await self.snapshots.settle()
        saved = sum(1 for c in commits if c.done() and not c.cancelled() and c.exception() is None and c.result())
        return Flushed(saved, failed + len(commits) - saved)

    async def save_session(self, key: SessionKey) -> bool:
        """Save `key`'s state if a slot holds it changed (waiting for its running turn), and wait for the commit:
        before the session moves to another backend of its model. True when its newest state is on disk."""
        slot = next((s for s in self.slots if s.occupant == key), None)
        if slot is None:
            return await self.snapshots.settle(key)
        await self._take(lambda: None if slot.busy else slot)
        try:
            if not (slot.dirty and slot.occupant == key):
                return await self.snapshots.settle(key)
            slot.dirty = False
            commit = await self.saver.start(slot.slot_id, key, Held.of(slot))
        finally:
            self._give_back(slot)
        return commit is not None and await asyncio.shield(commit)

    async def clear(self) -> list[int]:
        """Save changed slots, then erase every slot, one after the other; returns the slot ids erased. A slot whose
        save fails is left as it is, the others are erased, and then SaveFailed says which."""
        erased, kept = [], []
        for slot in self.slots:
            try:
                await self.clear_slot(slot.slot_id)
            except SaveFailed:
                kept.append(slot.slot_id)
                continue
            erased.append(slot.slot_id)
        if kept:
            raise SaveFailed(f"slot(s) {_ids(kept)} were not erased: saving their changed state failed (see the "
                             f"log); erased: {_ids(erased) or 'none'}")
        return erased

    async def clear_slot(self, slot_id: int) -> SessionKey | None:
        """Wait for the slot to be free, save its occupant if changed, then erase it; no other slot is touched.
        Returns the session the slot held (None when it held none). When the save fails, the slot is not erased
        (it keeps its unsaved state) and SaveFailed is raised."""
        if not 0 <= slot_id < len(self.slots):
            raise NotFound(f"no slot {slot_id}: the backend has {len(self.slots)} slot(s), numbered from 0")
        slot = self.slots[slot_id]
        await self._take(lambda: None if slot.busy else slot)
        try:
            held = slot.occupant  # read after taking the slot: nothing else can change it now
            # An operator's action: done when it answers, commit included. 0 ms waited: the save failed.
            if slot.dirty and held is not None and not await self.saver.save(slot.slot_id, held, Held.of(slot)):
                raise SaveFailed(f"saving slot {slot_id} ({held}) failed, so it was not erased: it keeps its "
                                 "unsaved state (see the log for why)")
            await self._client.slot_action(slot.slot_id, "erase")
            _empty(slot)
        finally:
            slot.busy = False
            self._dispatch()
        return held

    def generations(self) -> dict[int, int]:
        """Each slot's lease generation, to tell later whether a slot was used in between."""
        return {slot.slot_id: slot.generation for slot in self.slots}

    def reset_slots(self, observed: dict[int, int], reason: str) -> list[int]:
        """The backend lost the state of these slots: stop treating what they held as hot or as worth saving.

        Only slots that are idle and unused since `observed` was taken are reset, so a decision is never made on a
        reading that a lease has overtaken.
        """
        reset = []
        for slot in self.slots:
            if slot.slot_id not in observed or slot.busy or slot.generation != observed[slot.slot_id]:
                continue
            if slot.occupant is not None:
                log.warning("slot %d no longer holds %s (%s); its next turn restores from disk", slot.slot_id,
                            slot.occupant, reason)
                self._remember(self._left, slot.occupant, (Reason.BACKEND_RESTARTED, reason))
                reset.append(slot.slot_id)
            _empty(slot)
        return reset

    @staticmethod
    def _remember(memory: OrderedDict[SessionKey, Any], key: SessionKey, value: Any) -> None:
        memory.pop(key, None)
        memory[key] = value
        while len(memory) > _SESSIONS_KEPT:
            memory.popitem(last=False)

    @property
    def system_snapshots(self) -> bool:
        """Whether new conversations start from their system prompt's snapshot (--system-snapshots)."""
        return self._system_snapshots

    def running(self, model: str, session_id: str) -> bool:
        """Whether a turn of the session runs in a slot now (the session directory keeps its lease meanwhile)."""
        return any(slot.busy and slot.occupant is not None and slot.occupant.model == model
                   and slot.occupant.session_id == session_id for slot in self.slots)

    def holds(self, key: SessionKey) -> bool:
        """Whether a slot holds `key`'s state now (its next turn is hot there)."""
        return any(slot.occupant == key for slot in self.slots)

    def forget(self, key: SessionKey) -> None:
        """Stop attributing any slot to `key` (its snapshot was deleted), so nothing saves it again."""
        for slot in self.slots:
            if slot.occupant == key:
                slot.dirty = False
                if slot.busy:
                    slot.forgotten_in = slot.generation
                else:
                    slot.occupant = None

    async def aclose(self, timeout: float | None = None) -> bool:
        """Stop the idle-save timers and wait for the commits still running (the store closes after this), for at
        most `timeout` seconds; True when none is left running."""
        for task in list(self._timers):
            task.cancel()
        await asyncio.gather(*self._timers, return_exceptions=True)
        return await self.snapshots.settle(timeout=timeout)


def _empty(slot: SlotState) -> None:
    """The slot holds nothing known any more (erased, or lost with the backend)."""
    slot.occupant, slot.kind, slot.dirty, slot.n_tokens, slot.chain, slot.tokens = (None, SnapshotKind.SESSION, False,
                                                                                     0, [], None)
    slot.n_prompt, slot.replay, slot.at_prompt_end, slot.forgotten_in, slot.cut = 0, None, False, None, None


def _extends(in_slot: Sequence[Link], chain: Sequence[Link], own: bool) -> bool:
    """Whether the request holds every message of the slot's state (a raw prompt, or a slot of no known messages:
    taken as doing so when the slot is the session's own)."""
    if not in_slot or not chain:
        return own
    return common_prefix(in_slot, chain) == len(in_slot)


def _in_slot_tokens(slot: SlotState, in_slot: Sequence[Link], kept: int) -> int:
    """About how many tokens the slot's content gives a request that shares `kept` of its messages: its last prompt
    when the request has all of them, else that prompt's share by characters."""
    if kept <= 0 or not in_slot:
        return 0
    if kept >= len(in_slot):
        return slot.n_prompt or slot.n_tokens
    return int((slot.n_prompt or slot.n_tokens) * in_slot[kept - 1].chars / max(in_slot[-1].chars, 1))


class Flushed(NamedTuple):
    """What a flush did: the changed slots it saved, and those whose save failed (logged as each one failed)."""

    saved: int
    failed: int


def _ids(slot_ids: Sequence[int]) -> str:
    return ", ".join(str(i) for i in slot_ids)
