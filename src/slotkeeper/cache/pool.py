"""The slot pool: the single owner of "slot i holds session S's state up to message k, changed since its last save".

Every decision (which slot, hot or not, who to save, what to restore) is taken synchronously right after the pool
wakes up, never on a value read before an `await`; the slow work (save, restore) then runs while the slot is busy,
except a save's commit, which need not hold the slot (snapshots.py). See docs/design-pool.md for the rules.

The pool keeps the slots, their queue and their leases. What a leased slot starts from is decided and brought in by
bringing.py; what happens to a slot between leases has owners of its own, which the pool holds too: the idle saves
(idlesaves.py) and the system states (warmups.py). An operator's actions on the slots go through the pool's queue
(operations.py). A slot is changed only by whoever holds it: a turn's lease, or a slot marked busy in one
synchronous step (an idle save, a cut, an operator's take through the queue), given back through the pool. Counters
are read where they are counted: the snapshots (saves, evictions), the saver (prompt-end
steps), the restorer, the bringer (token look-ups) and the warm-ups.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slotkeeper.cache.bringing import SIDE_MIN_TOKENS, Bringer, SessionNotes, TokenSource
from slotkeeper.cache.budget import DiskBudget
from slotkeeper.cache.capability import ArchKind, Capability, Strategy
from slotkeeper.cache.chain import Link, common_messages
from slotkeeper.cache.costs import CostMeter, floor_tokens
from slotkeeper.cache.events import CacheEvents
from slotkeeper.cache.evidence import CheckpointEvidence
from slotkeeper.cache.idlesaves import IdleSaves
from slotkeeper.cache.proof import RestorePolicy
from slotkeeper.cache.reasons import Reason
from slotkeeper.cache.restoring import Restorer
from slotkeeper.cache.saving import Saver
from slotkeeper.cache.sidestates import side_key
from slotkeeper.cache.slots import Held, SlotLease, SlotState, TurnEnd
from slotkeeper.cache.snapshots import Snapshots, snapshot_id
from slotkeeper.cache.systemprompt import SystemPrompt
from slotkeeper.cache.tokens import Tokens
from slotkeeper.cache.warmups import WarmUps
from slotkeeper.errors import Overloaded
from slotkeeper.types import CacheOutcome, SessionKey, SnapshotKind
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.health import BackendHealth

log = logging.getLogger("slotkeeper.pool")

# A side task waits for a conversation's request only when none ran within this long: a task sent just after an
# answer (follow-ups, tags) has nothing to wait for; a new chat's title, sent just before its first request, has.
SIDE_FOLLOWS_SECONDS = 2.0


@dataclass(eq=False)
class _Waiter:
    """A queued request for a slot: `choose` says which slot would do right now, or None."""

    choose: Callable[[], SlotState | None]
    future: asyncio.Future[SlotState]
    side: bool = False
    # The conversation the slot is for: the slot is claimed for it in the step that hands it out.
    key: SessionKey | None = None


class SlotPool:
    def __init__(self, n_slots: int, client: UpstreamClient, snapshots: Snapshots, fingerprint: str, n_ctx_slot: int,
                 save_idle_seconds: float = 2.0, min_restore_tokens: int | None = 0, max_queue: int = 0,
                 system_snapshots: bool = True, budget: DiskBudget | None = None, capability: Capability | None = None,
                 health: BackendHealth | None = None, side_hold_seconds: float = 0.0,
                 domains: bool = False) -> None:
        # With cache domains kept apart (`domains`), what the slots hold at start is of no known domain: each is
        # erased before its first request (see `_enter_domain`).
        self.slots = [SlotState(i, domain=None if domains else "") for i in range(n_slots)]
        self.client = client
        self._min_restore_tokens = min_restore_tokens
        self._max_queue = max_queue
        self._side_hold_seconds = side_hold_seconds
        self._system_snapshots = system_snapshots
        # What the next turn of each session is told about it (a slot taken, the backend restarted): reasons.py.
        self.notes = SessionNotes()
        self._waiters: deque[_Waiter] = deque()
        # Side tasks held back (see `_hold_side`), each woken when a conversation's request is queued.
        self._held_sides: set[asyncio.Event] = set()
        # When a conversation's turn last ended (monotonic), and the conversations' leases running now, by slot: a
        # side task waits for a conversation's request only when neither says one was just answered. A request
        # turned into a side request as it is brought in (bringing.py) stops counting as its lease says so.
        self._turns: dict[int, SlotLease] = {}
        self._last_turn_end = float("-inf")
        self.policy = RestorePolicy(capability or Capability("", ArchKind.UNKNOWN, None))
        # What a restore and a prefill cost on this backend, measured as it runs: when a restore pays (costs.py).
        self.costs = CostMeter()
        self.evidence = CheckpointEvidence(self.policy, snapshots.appendix_extent)
        self.events = CacheEvents()
        # The one holder of the snapshots: the pool saves and looks up through it, and so does the web layer.
        self.snapshots = snapshots
        self.saver = Saver(client, snapshots, self.evidence, self.policy, self.slots)
        self.restorer = Restorer(client, snapshots, self.events, self.policy, n_ctx_slot, self.costs)
        snapshots.attach(client, fingerprint, budget or DiskBudget(), self.events,
                         lambda: [snapshot_id(s.occupant, s.kind) for s in self.slots if s.occupant is not None],
                         self.evidence.inspect, self.costs.saved)
        # What a slot goes through between leases: its system part kept as a system state, and its idle save.
        self.warmups = WarmUps(client, self.saver, snapshots, self.policy, self.slots, self.floor,
                               self.give_back, self.notes)
        self.idle_saves = IdleSaves(self.saver, self.slots, save_idle_seconds, health, self.give_back,
                                    self.warmups.cut_back, self._side_task_follows)
        self.bringer = Bringer(snapshots, self.policy, self.evidence, self.restorer, self.notes, self.warmups.worth,
                               min_restore_tokens, n_ctx_slot, system_snapshots, self.costs)

    def floor(self) -> int:
        """The fewest tokens a saved state must share with a request for its restore to pay, measured (costs.py) or
        the operator's --min-restore-tokens: what keeping a small state (a side task's, a system part's) is weighed
        against."""
        return floor_tokens(self.costs.now(), self._min_restore_tokens)

    @property
    def queue_length(self) -> int:
        # The queue's own state, so the pool's: requests waiting for a slot.
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
        slot = await self._take(choose, bounded=True, side=side, key=None if side else key)
        early = None
        if (tokens is not None and (side or not self.notes.was_seen(key)) and not key.is_default
                and self.policy.strategy is not Strategy.KEEP_HOT):
            # A side task or a conversation not seen yet (a new chat, a client without ids) is the request whose
            # exact tokens the planner most likely asks for: the backend renders and tokenizes them meanwhile
            # (while the slot's occupant is saved, and the saved states are looked up), not after.
            early = asyncio.ensure_future(tokens())
            early.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved, if not used
            tokens = _awaiting(early)
        try:
            return await self._lease(slot, key, chain, side, system, tokens)
        finally:
            if early is not None and not early.done():
                early.cancel()  # not needed after all

    async def _lease(self, slot: SlotState, key: SessionKey, chain: Sequence[Link], side: bool,
                     system: SystemPrompt | None, tokens: TokenSource | None) -> SlotLease:
        """The slot is taken for `key`'s request: save its changed occupant (while the request's look-ups run), bring
        in what the request starts from (bringing.py), and lease it."""
        previous, previous_dirty, in_slot = slot.occupant, slot.dirty, slot.chain
        held = Held.of(slot)
        if (previous is not None and held.kind is SnapshotKind.SESSION
                and time.monotonic() - slot.last_used <= SIDE_FOLLOWS_SECONDS):
            # Only the conversation's own side tasks (sent under its id) say that they follow its turns: another
            # chat's title task that comes after an agent's turn says nothing of the agent's next one.
            self.notes.taken_after_turn(previous, side and key == previous)
        extended = _extends(in_slot, chain, previous == key and not side)
        slot.occupant, slot.kind, slot.dirty = (None if side else key), SnapshotKind.SESSION, False
        slot.side_content = False
        slot.generation += 1
        pending_cut, slot.cut = slot.cut, None
        lease = SlotLease(slot.slot_id, key, side=side, chain=list(chain), system=system, _release=self._finish)
        if not side:
            self._turns[slot.slot_id] = lease
        if previous is not None and previous != key:
            # Never another cache domain's session name: this note reaches the previous session's journal entry.
            taker = ("a side task" if side else f"session {key.session_id}" if key.domain == previous.domain
                     else "a request of another cache domain")
            self.notes.left(previous, Reason.SLOT_TAKEN, f"slot {slot.slot_id} was taken by {taker}")
        if side:
            lease.cache.why = Reason.SIDE_TASK
        if extended and previous == key and not side:
            # The request holds every message the slot's state was made of: nothing saved can share more (it would
            # have to hold this request's new messages already).
            slot.dirty = previous_dirty
            lease.cache.outcome, lease.cache.why = CacheOutcome.HOT, Reason.HOT
            self.notes.seen(key)
            lease.tokens = slot.tokens
            lease.cut_system = pending_cut is not None  # still to be cut once the conversation pauses
            return lease
        saving: asyncio.Task[float] | None = None
        try:
            if previous is not None and previous_dirty:
                if slot.domain == key.domain:
                    # The request's look-ups and the planner's decision need nothing of the save: they run while
                    # the backend writes, and the restore waits for the write (bringing.py).
                    saving = self.saver.begin(slot.slot_id, previous, held)
                if saving is None:
                    lease.cache.save_ms = await self.saver.save(slot.slot_id, previous, held, wait=False)
            if await self._enter_domain(slot, key.domain):
                in_slot, extended = [], False
            await self.bringer.bring_in(slot, lease, in_slot, previous, extended, tokens, saving)
        except BaseException:
            if saving is not None and not saving.done():
                await asyncio.wait({saving})  # the backend's write of the occupant ends before the slot is handed on
            lease.release(TurnEnd.FAILED)
            raise
        return lease

    async def _enter_domain(self, slot: SlotState, domain: str) -> bool:
        """The slot is about to run a request of cache domain `domain`: when what it holds is another domain's
        (saved by then, if it had changed), erase it on the backend, which would otherwise reuse the tokens the two
        share (and answer faster: a side channel). True when it was erased. When the erase fails the request fails
        too (UpstreamError): it must not run over another domain's tokens."""
        if slot.domain == domain:
            return False
        await self.client.slot_action(slot.slot_id, "erase")  # raised: the lease fails, and the slot is reset
        slot.chain, slot.tokens, slot.n_tokens, slot.n_prompt, slot.cut = [], None, 0, 0, None
        slot.replay, slot.at_prompt_end, slot.side_content = None, False, False
        slot.domain = domain
        log.debug("slot %d erased: it held another cache domain's tokens", slot.slot_id)
        return True

    def _side_task_follows(self, slot: SlotState) -> bool:
        """Whether a side task is expected to take the slot right after its occupant's turn, as one did last time."""
        return slot.occupant is not None and self.notes.side_task_follows(slot.occupant)

    def _may_be_followed(self) -> bool:
        """Whether a conversation's request may follow a side task: none is running, and none was just answered."""
        return (all(lease.side for lease in self._turns.values())
                and time.monotonic() - self._last_turn_end > SIDE_FOLLOWS_SECONDS)

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
        # One session, at most one slot: one handed out for the session's request and not yet given back (its
        # occupant is set only once that request resumes) is its own as much as one it occupies.
        own = next((s for s in self.slots if s.claimed == key), None) or next(
            (s for s in self.slots if s.occupant == key), None)
        if own is not None:
            return None if own.busy else own  # one session's turns run one after another, in its own slot
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        # An idle slot holding a state the request extends (whatever its name: a client that changed its id); then
        # an empty slot; then the least recently used one.
        extended = [s for s in idle if s.chain and s.domain == key.domain and _extends(s.chain, chain, own=False)]
        if extended:
            return max(extended, key=lambda s: len(s.chain))
        return min(idle, key=lambda s: (s.occupant is not None, s.last_used))

    def _choose_side(self, key: SessionKey | None = None) -> SlotState | None:
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        # Best: a slot that holds no conversation, the one a side task left last first (the next task may begin
        # the same way: the backend reuses what they share), then an empty one; then the slot of the conversation
        # the task belongs to (`key`): its user is reading the answer the task is about, while another
        # conversation in its slot (an agent) may be back at once; then one whose state is already on disk; last,
        # the least recently used.
        return min(idle, key=lambda s: (s.occupant is not None and s.kind is not SnapshotKind.SIDE,
                                        key is None or s.occupant != key, not s.side_content, s.dirty,
                                        -s.last_used if s.side_content else s.last_used))

    async def _take(self, choose: Callable[[], SlotState | None], bounded: bool = False,
                    side: bool = False, key: SessionKey | None = None) -> SlotState:
        """Queue for a slot; slots are handed out in arrival order to the first waiter that can use them, side tasks
        after every conversation's request (when side tasks are held back at all). A slot handed out for
        conversation `key` is claimed for it until it is given back."""
        waiter = _Waiter(choose, asyncio.get_running_loop().create_future(), side, key)
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
                self.free(waiter.future.result())  # handed a slot, but cancelled before using it
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
                slot.busy, slot.claimed = True, waiter.key
                self._waiters.remove(waiter)
                waiter.future.set_result(slot)

    def _finish(self, lease: SlotLease, end: TurnEnd, n_tokens: int, cache_n: int | None, n_prompt: int,
                prompt_ms: float | None = None) -> None:
        slot = self.slots[lease.slot_id]
        if end is TurnEnd.COMPLETED:
            self.costs.prefilled(n_prompt - (cache_n or 0), prompt_ms)
        slot.busy, slot.claimed = False, None
        slot.last_used = time.monotonic()
        self._turns.pop(lease.slot_id, None)
        if not lease.side:
            self._last_turn_end = slot.last_used
        if lease.existing is not None:
            pass  # a pre-warm that found its snapshot on disk did not touch the slot
        elif lease.side and lease.system is not None:
            # A pre-warm: a completed one leaves its system part in the slot, for the next conversation on it.
            slot.occupant, slot.dirty, slot.forgotten_in, slot.replay = None, False, None, None
            if end is not TurnEnd.COMPLETED:
                slot.chain, slot.tokens, slot.n_tokens, slot.n_prompt, slot.at_prompt_end = [], None, 0, 0, False
        elif (end is TurnEnd.FAILED or slot.forgotten_in == slot.generation or lease.side
              or (end is not TurnEnd.COMPLETED and lease.cache.why is Reason.RESTORE_FAILED)):
            # (After a failed restore the slot holds nothing of the conversation's saved state, which the failure
            # left whole on disk: a turn cut short holds part of a prompt prefilled from nothing, which saved would
            # replace that state, and a refused one holds nothing, which kept as the conversation's would make its
            # next turn run hot over an empty slot.)
            slot.occupant, slot.dirty, slot.n_tokens, slot.n_prompt = None, False, 0, 0
            slot.chain, slot.tokens, slot.forgotten_in = [], None, None
            slot.replay, slot.at_prompt_end = None, False
            if end is TurnEnd.COMPLETED and lease.side:
                # The slot holds the task's prompt and answer, attributed to nobody: what the next request finds
                # in it (it may begin the same way), and a side state when it is long enough to pay.
                slot.chain, slot.tokens, slot.side_content = lease.chain, lease.tokens, True
                slot.n_tokens, slot.n_prompt = n_tokens or n_prompt, n_prompt
                self._keep_side_state(slot, lease, n_prompt)
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
            self.idle_saves.schedule(slot)

    def _keep_side_state(self, slot: SlotState, lease: SlotLease, n_prompt: int) -> None:
        """A side task ended: where its prompt is long enough for a later task to be worth restoring from, the slot
        keeps its state as a side state (saved like a conversation's: on a switch, when idle, at exit; the disk
        budget keeps the last few per model)."""
        if not lease.chain or self.policy.strategy is not Strategy.RESTORE:
            return
        if n_prompt < max(self.floor(), SIDE_MIN_TOKENS):
            return  # no later task could share enough of it for its restore to pay
        slot.occupant, slot.kind, slot.dirty = side_key(lease.key, lease.chain), SnapshotKind.SIDE, True

    async def warm_lease(self, model: str, system: SystemPrompt, domain: str = "") -> SlotLease:
        """Lease a slot to warm `system` up ahead of time (an operator's pre-warm) in cache domain `domain`. The
        lease's `existing` is the system snapshot already on disk, if any (then there is nothing to do). Release it
        like a side request."""
        slot = await self._take(self._choose_side, bounded=True)
        previous, previous_dirty, held = slot.occupant, slot.dirty, Held.of(slot)
        slot.occupant, slot.dirty = None, False
        slot.generation += 1
        key = SessionKey(model, system.digest, domain=domain)
        lease = SlotLease(slot.slot_id, key, side=True, chain=system.chain(), system=system, _release=self._finish)
        try:
            lease.existing = await self.snapshots.system(key)
            if lease.existing is None and previous is not None and previous_dirty:
                lease.cache.save_ms = await self.saver.save(slot.slot_id, previous, held, wait=False)
            if lease.existing is None:
                slot.side_content = False  # the pre-warm replaces it with the system part
                await self._enter_domain(slot, domain)
        except BaseException:
            lease.release(TurnEnd.FAILED)
            raise
        if lease.existing is not None:
            # Nothing to do: the slot keeps what it held, unsaved changes included.
            slot.occupant, slot.dirty = previous, previous_dirty
        return lease

    def learn_from_disk(self) -> None:
        """In a worker thread at start: what the newest snapshots of this backend tell about its build."""
        self.evidence.from_files(self.snapshots.mine_now())

    # -- slots taken outside a lease ------------------------------------------------------------------------

    async def take(self, slot: SlotState) -> None:
        """Wait for `slot` to be free, in turn with the requests queued before, and take it for work that is no turn
        (an operator's save or erase: operations.py); `give_back` frees it."""
        await self._take(lambda: None if slot.busy else slot)

    def give_back(self, slot: SlotState) -> None:
        """Free a slot taken for a save (not leased): if its session was deleted meanwhile, the slot no longer holds
        it (its state stays in the slot, attributed to nobody)."""
        if slot.forgotten_in == slot.generation:
            slot.occupant, slot.dirty, slot.forgotten_in = None, False, None
        self.free(slot)

    def free(self, slot: SlotState) -> None:
        """The slot is free again: hand it to the first queued request that can use it."""
        slot.busy, slot.claimed = False, None
        self._dispatch()

    # -- what the slots hold --------------------------------------------------------------------------------

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
                self.notes.left(slot.occupant, Reason.BACKEND_RESTARTED, reason)
                reset.append(slot.slot_id)
            empty_slot(slot)
        return reset

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
        await self.idle_saves.aclose()
        return await self.snapshots.settle(timeout=timeout)


def _awaiting(early: asyncio.Future[Tokens | None]) -> TokenSource:
    """A token source whose answer was asked for ahead (see `acquire`)."""

    async def tokens() -> Tokens | None:
        return await early

    return tokens


def empty_slot(slot: SlotState) -> None:
    """The slot holds nothing known any more (erased, or lost with the backend)."""
    slot.occupant, slot.kind, slot.dirty, slot.n_tokens, slot.chain, slot.tokens = (None, SnapshotKind.SESSION, False,
                                                                                     0, [], None)
    slot.n_prompt, slot.replay, slot.at_prompt_end, slot.forgotten_in, slot.cut = 0, None, False, None, None
    slot.side_content = False


def _extends(in_slot: Sequence[Link], chain: Sequence[Link], own: bool) -> bool:
    """Whether the request holds every message of the slot's state (a raw prompt, or a slot of no known messages:
    taken as doing so when the slot is the session's own)."""
    if not in_slot or not chain:
        return own
    return common_messages(in_slot, chain) == len(in_slot)
