"""The slot pool: the single owner of "slot i holds session S's state up to message k, changed since its last save".

Every decision (which slot, hot or not, who to save, what to restore) is taken synchronously right after the pool
wakes up, never on a value read before an `await`; the slow work (save, restore) then runs while the slot is busy,
except a save's commit, which need not hold the slot (snapshots.py). See docs/design-pool.md for the rules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from slotkeeper.cache.budget import DiskBudget, SnapshotId
from slotkeeper.cache.capability import ArchKind, Capability, Strategy
from slotkeeper.cache.chain import Link, common_prefix
from slotkeeper.cache.events import CacheEvents
from slotkeeper.cache.evidence import CheckpointEvidence
from slotkeeper.cache.planner import Candidate, Plan, Request, Rules, plan
from slotkeeper.cache.proof import RestorePolicy
from slotkeeper.cache.reasons import Known, Reason, explain
from slotkeeper.cache.restoring import Restorer
from slotkeeper.cache.saving import Saver
from slotkeeper.cache.sidestates import SideStates, is_side_key
from slotkeeper.cache.slots import Held, SlotLease, SlotState, TurnEnd
from slotkeeper.cache.snapshots import Snapshots, key_of
from slotkeeper.cache.systemprompt import SystemPrompt
from slotkeeper.errors import NotFound, Overloaded, SaveFailed
from slotkeeper.types import CacheOutcome, SessionKey, Snapshot, SnapshotKind
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.health import BackendHealth

log = logging.getLogger("slotkeeper.pool")

# System prompts found too short to be worth a snapshot, remembered so they are not warmed up again.
_SHORT_SYSTEMS_KEPT = 1024
# The least a side task must share with a kept side state for a restore of it (the tasks' template alone, a few
# dozen tokens, is not worth one), whatever --min-restore-tokens says.
_SIDE_MIN_TOKENS = 64
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
        side_states: SideStates | None = None,
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
        # The states the last side tasks left, for the next ones that start the same way.
        self.side_states = side_states or SideStates()
        self._timers: set[asyncio.Task[None]] = set()
        # System prompts evaluated into a slot (a new one met by a turn, or an operator's pre-warm), and failures.
        self.warm_ups = 0
        self.failed_warm_ups = 0
        self.policy = RestorePolicy(capability or Capability("", ArchKind.UNKNOWN, None))
        self._evidence = CheckpointEvidence(self.policy, snapshots.slot_dir)
        self.events = CacheEvents()
        # The one holder of the snapshots: the pool saves and looks up through it, and so does the web layer.
        self.snapshots = snapshots
        self.saver = Saver(client, snapshots, self._evidence, self.policy, self.slots)
        self.restorer = Restorer(client, snapshots, self.events, self.policy, n_ctx_slot)
        snapshots.attach(client, fingerprint, budget or DiskBudget(), self.events,
                         lambda: [s.occupant for s in self.slots if s.occupant is not None], self._evidence.inspect)

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
                      system: SystemPrompt | None = None, side_text: str | None = None) -> SlotLease:
        """Wait for a slot for `key`, bring the best state for its messages (`chain`) into it, and lease it.

        `system` is the request's system part: a new conversation starts from its system snapshot, or, when there
        is none yet, the lease comes back with `warm_up` set (see `save_system`).

        A side request (a title or tag task sent under the conversation's id) must not become the session's state:
        it gets a slot that holds no unsaved session when there is one, the slot's changed occupant is saved first,
        nothing is restored but the state an earlier side task left that starts the same way (`side_text`: the
        request as text), and afterwards the slot holds the task's own state, kept as a side state when it is long
        enough to be worth one (sidestates.py), or is attributed to nobody.
        """
        if side and self._side_hold_seconds > 0:
            # OpenWebUI sends a new chat's title task a few ms before the chat's request: that one goes first.
            await self._hold_side()
        slot = await self._take((lambda: self._choose_side(key)) if side else lambda: self._choose(key), bounded=True,
                                side=side)
        previous, previous_dirty, in_slot = slot.occupant, slot.dirty, slot.chain
        held = Held.of(slot)
        slot.occupant, slot.dirty = (None if side else key), False
        slot.generation += 1
        lease = SlotLease(slot.slot_id, key, side=side, chain=list(chain), system=system, side_text=side_text,
                          _release=self._finish)
        if previous is not None and previous != key:
            taker = "a side task" if side else f"session {key.session_id}"
            self._remember(self._left, previous, (Reason.SLOT_TAKEN, f"slot {slot.slot_id} was taken by {taker}"))
        if side:
            lease.cache.why = Reason.SIDE_TASK
        if previous == key and not side:
            slot.dirty = previous_dirty
            lease.cache.outcome, lease.cache.why = CacheOutcome.HOT, Reason.HOT
            kept = common_prefix(in_slot, lease.chain)
            if lease.chain and kept < len(in_slot):  # the client changed a message the slot had
                lease.cache.why, lease.cache.changed_at = Reason.REWRITTEN, kept
                lease.cache.detail = f"message {kept + 1} differs from the history in the slot; reused up to there"
            self._remember(self._seen, key, None)
            return lease
        try:
            if previous is not None and previous_dirty:
                lease.cache.save_ms = await self.saver.save(slot.slot_id, previous, held, wait=False)
            if not side:
                await self._bring_in(slot, lease, in_slot)
            elif side_text is not None:
                await self._bring_in_side(slot, lease, side_text, previous)
        except BaseException:
            lease.release(TurnEnd.FAILED)
            raise
        return lease

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

    def _choose(self, key: SessionKey) -> SlotState | None:
        own = next((s for s in self.slots if s.occupant == key), None)
        if own is not None:
            return None if own.busy else own  # one session's turns run one after another, in its own slot
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        # An empty slot first; then the least recently used one.
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
        if lease.existing is not None:
            pass  # a pre-warm that found its snapshot on disk did not touch the slot
        elif end is TurnEnd.FAILED or slot.forgotten_in == slot.generation or lease.side:
            slot.occupant, slot.dirty, slot.n_tokens = None, False, 0
            # A completed pre-warm leaves its system part in the slot, for the next conversation on it.
            keeps_system = end is TurnEnd.COMPLETED and lease.side and lease.system is not None
            slot.chain = slot.chain if keeps_system else []
            slot.forgotten_in = None
            slot.n_prompt = slot.n_tokens if keeps_system else 0
            slot.replay, slot.at_prompt_end = None, keeps_system
            if end is TurnEnd.COMPLETED and lease.side and not keeps_system:
                self._keep_side_state(slot, lease, n_tokens, n_prompt)
        elif end in (TurnEnd.COMPLETED, TurnEnd.CANCELLED):
            slot.dirty = not lease.key.is_default
            slot.n_tokens = n_tokens or slot.n_tokens
            slot.chain = lease.chain
            slot.n_prompt = n_prompt
            # A cut-short turn is saved as it is: replaying its prompt could mean its whole prefill again.
            slot.replay = lease.replay if end is TurnEnd.COMPLETED else None
            slot.at_prompt_end = False
        if end is TurnEnd.COMPLETED and cache_n is not None and lease.cache.expected_reuse > 0:
            self.restorer.judge(lease, cache_n)
        self._dispatch()
        if slot.dirty:
            self._schedule_idle_save(slot)

    # -- bringing a state in --------------------------------------------------------------------------------

    async def _bring_in(self, slot: SlotState, lease: SlotLease, in_slot: Sequence[Link]) -> None:
        """Look up what the request could start from and do what the planner says (planner.py): restore the state
        that shares the longest prefix with it (the session's own snapshot, or another conversation's that shares
        more than the system part), or the system part's (or warm a new system part up first), or nothing."""
        key = lease.key
        known = Known(seen=key in self._seen)
        left = self._left.pop(key, None)
        if left is not None:
            known = Known(left=left[0], left_detail=left[1], seen=known.seen)
        self._remember(self._seen, key, None)
        kept = common_prefix(in_slot, lease.chain)  # what the slot's current content already gives for free
        if kept < len(in_slot) and self.policy.capability.needs_checkpoints:
            # A recurrent, hybrid or SWA slot rolls back only to its checkpoints (at the last user message and the
            # prompt's end): a request that leaves the slot's messages earlier than that reuses nothing of it.
            kept = 0
        system = lease.system if self._system_snapshots else None
        request = Request(len(lease.chain), kept, system.n_messages if system is not None else None,
                          default=key.is_default, worth_warming=system is not None and self._worth_warming(system))
        rules = Rules(self.policy.strategy, self._min_restore_tokens, self._n_ctx_slot)
        restoring = not key.is_default and rules.strategy is not Strategy.KEEP_HOT
        own: Candidate | None = None
        prefix: Candidate | None = None
        if restoring:
            own, fate = await self.snapshots.own(key, lease.chain)
            known = Known(fate, known.left, known.left_detail, known.seen)
            # Any conversation's state may share more than the own one (two agents that were one session, a fork):
            # the planner takes the longest. A match must share more messages than the slot and the system part.
            if lease.chain:
                floor = max(kept, request.n_system or 0)
                prefix = await self.snapshots.best_prefix(key.model, lease.chain, floor + 1)
        system_snapshot: Snapshot | None = None
        if system is not None and own is None and not key.is_default:
            # Where nothing is restored, only whether there is one matters: its row, unchecked.
            system_snapshot = await self.snapshots.system(SessionKey(key.model, system.digest), checked=restoring)
        await self._act(slot, lease, plan(request, rules, own, prefix, system_snapshot), own, known)

    async def _act(self, slot: SlotState, lease: SlotLease, chosen: Plan, own: Candidate | None,
                   known: Known) -> None:
        if chosen.held_back:
            self.policy.skipped()  # a chance for a trial of the strategy before a fallback, if there is one
        lease.warm_up = chosen.warm_up
        explained = explain(chosen, own, known)
        lease.cache.why, lease.cache.detail, lease.cache.changed_at = (explained.reason, explained.detail,
                                                                      explained.changed_at)
        if chosen.restore is not None:
            await self._restore(slot, lease, chosen.restore.snapshot, chosen.outcome, chosen.owes)

    async def _bring_in_side(self, slot: SlotState, lease: SlotLease, text: str, previous: SessionKey | None) -> None:
        """Restore the side state sharing the longest beginning with the task, where that is worth a restore (and
        the slot does not hold it already)."""
        if self.policy.strategy is not Strategy.RESTORE:
            return  # only a plain attention state can be cut back to the part the next task shares
        match = self.side_states.best(lease.key.model, text)
        if match is None or match.tokens < max(self._min_restore_tokens, _SIDE_MIN_TOKENS) or match.key == previous:
            return
        own, _ = await self.snapshots.own(match.key, [])
        if own is None:
            self.side_states.drop(match.key)
            return
        await self._restore(slot, lease, own.snapshot, CacheOutcome.PREFIX, 0)
        if lease.cache.outcome is CacheOutcome.PREFIX:
            self.side_states.used(match.key)
            lease.cache.detail = f"started from an earlier side task's state (about {match.tokens} tokens shared)"

    def _keep_side_state(self, slot: SlotState, lease: SlotLease, n_tokens: int, n_prompt: int) -> None:
        """A side task ended: where its prompt is long enough for a later task to be worth restoring from, the slot
        keeps its state under a side key, saved like a session's (on a switch, when idle, at exit)."""
        text = lease.side_text
        if text is None or self.policy.strategy is not Strategy.RESTORE:
            return
        if n_prompt < 2 * max(self._min_restore_tokens, _SIDE_MIN_TOKENS):
            return
        key, dropped = self.side_states.keep(lease.key.model, text, n_prompt)
        slot.occupant, slot.dirty = key, True
        slot.n_tokens, slot.n_prompt = n_tokens or n_prompt, n_prompt
        for old in dropped:
            self._drop_side_state(old)

    def _drop_side_state(self, key: SessionKey) -> None:
        self.forget(key)
        self._in_background(self._delete_quietly(key))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` as a task the pool keeps (aclose cancels and awaits them)."""
        task = asyncio.get_running_loop().create_task(work)
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    async def _delete_quietly(self, key: SessionKey) -> None:
        try:
            await self.snapshots.delete(key)
        except Exception as exc:  # bookkeeping: a side state left behind costs only disk, and ages out
            log.warning("deleting the side state %s failed: %s", key, exc)

    async def load_side_states(self) -> int:
        """At start: the side states an earlier run kept come back where their snapshot is still on disk (the rest are
        forgotten), and side snapshots no longer listed (what matched them is gone) are deleted. Returns how many came
        back."""
        listed = self.side_states.load()
        on_disk = {key_of(s) for s in await self.snapshots.list(None) if is_side_key(s.session_id)}
        for key in listed - on_disk:
            self.side_states.drop(key)
        for key in on_disk - listed:
            await self._delete_quietly(key)
        return len(listed & on_disk)

    def _worth_warming(self, system: SystemPrompt) -> bool:
        # About two characters of canonical JSON per token at the least: shorter prompts cannot reach the threshold.
        return system.chars >= 2 * self._min_restore_tokens and system.digest not in self._short_systems

    async def save_system(self, lease: SlotLease, n_tokens: int, wait: bool = True) -> Snapshot | None:
        """The caller warmed the leased slot up with the lease's system part (`n_tokens` prompt tokens): keep it as
        the system snapshot, unless it is too short to be worth one. Only called after a warm-up that succeeded.

        With `wait`, the snapshot is returned once committed (a pre-warm reports it). Without, only the backend's
        write of the slot is waited for, and the commit (the copy to the slot dir, fsync, checksum, index row) goes
        on behind the turn: a turn need not wait for it, and whoever looks the snapshot up waits for its commit."""
        system = lease.system
        assert system is not None
        self.warm_ups += 1
        slot = self.slots[lease.slot_id]
        slot.chain = system.chain()
        slot.n_tokens = slot.n_prompt = n_tokens
        slot.replay, slot.at_prompt_end = None, True
        if n_tokens < max(self._min_restore_tokens, 1):
            self._short_systems.append(system.digest)
            log.info("system prompt %s has %d tokens, fewer than --min-restore-tokens: no system snapshot",
                     system.short_id, n_tokens)
            return None
        key = SessionKey(lease.key.model, system.digest)
        lease.cache.save_ms += await self.saver.save(slot.slot_id, key, Held.of(slot), SnapshotKind.SYSTEM, wait=wait)
        return await self.snapshots.get(key, SnapshotKind.SYSTEM) if wait else None

    def warm_up_failed(self, lease: SlotLease) -> None:
        """The warm-up request failed: nothing is saved, and the slot's content is not known any more."""
        self.failed_warm_ups += 1
        self.slots[lease.slot_id].chain = []

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
        if restored is not None:
            slot.n_tokens = restored

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
        await self._save_held(slot)

    async def _save_held(self, slot: SlotState) -> None:
        """Take an idle slot, save its dirty occupant, and give the slot back. A save that failed because the
        backend went away leaves the slot changed, saved once the backend is back (or forgotten, if it restarted)."""
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
                              kind: SnapshotKind = SnapshotKind.SESSION, n_prompt: int = 0) -> Snapshot:
        """Make an uploaded file (`temp`, checked) `key`'s snapshot. The slots stop attributing the session first,
        so that no older state of it in a slot is saved over the import, and the commit lands after the saves of
        it already started (snapshots.py)."""
        if kind is SnapshotKind.SESSION:
            self.forget(key)
        self._evidence.saving()  # the imported file is inspected as a saved one is: it may tell about the build
        return await self.snapshots.commit_import(key, temp, n_tokens, chain, n_bytes, kind, n_prompt)

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
            slot.occupant, slot.dirty, slot.n_tokens, slot.chain = None, False, 0, []
            slot.n_prompt, slot.replay, slot.at_prompt_end = 0, None, False
            slot.forgotten_in = None
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
            slot.occupant, slot.dirty, slot.n_tokens, slot.chain = None, False, 0, []
            slot.n_prompt, slot.replay, slot.at_prompt_end = 0, None, False
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


class Flushed(NamedTuple):
    """What a flush did: the changed slots it saved, and those whose save failed (logged as each one failed)."""

    saved: int
    failed: int


def _ids(slot_ids: Sequence[int]) -> str:
    return ", ".join(str(i) for i in slot_ids)
