"""The pool under random schedules (hypothesis's stateful testing): turns of four conversations on two slots,
started, answered, cancelled and failed in random interleavings, a second request of a conversation while its first
runs, saves and restores that fail, flushes and slot clears, against a fake backend that keeps each slot's tokens the
way llama-server does. After every step:

- one session, at most one slot: no two slots are occupied or claimed by one conversation;
- every acknowledged turn is restorable: when a conversation's request gets its slot, the slot holds every token of
  its last acknowledged turn (kept or restored), unless a fault since may have lost it (a save of it that failed, a
  turn that failed), or its restore failed (the turn runs cold); and while none of its requests runs, those tokens
  are in the slot it occupies or in its saved state.

Hypothesis draws a fresh seed each run; a failing run prints the steps that broke it (and `@seed` to replay it).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import struct
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from slotkeeper.cache.chain import Link, message_chain
from slotkeeper.cache.operations import clear_slot, flush
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.slots import SlotLease, TurnEnd
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.errors import SlotkeeperError, UpstreamError
from slotkeeper.types import IdSource, SessionKey
from slotkeeper.upstream.client import SlotActionResult

FP = "00112233aabbccdd"
N_SLOTS = 2
SESSIONS = [SessionKey("m", name, IdSource.HEADER) for name in ("A", "B", "C", "D")]
SYSTEM = list(range(1, 41))  # a system prompt every conversation opens with: prefix restores across conversations
_MAGIC, _VERSION = 0x67677371, 4


def slot_file(tokens: list[int]) -> bytes:
    words = [-1, 1, len(tokens), *tokens]
    return struct.pack(f"<III{len(words)}i", _MAGIC, _VERSION, len(words), *words) + bytes(64)


def file_tokens(data: bytes) -> list[int]:
    _, _, n_words = struct.unpack_from("<III", data)
    words = struct.unpack_from(f"<{n_words}i", data, 12)
    return list(words[3:3 + words[2]])


class Backend:
    """A fake llama-server's slots: each slot's tokens; a save writes them as a slot file, a restore reads one back
    into the slot, an erase empties it. Saves and restores fail while told to."""

    def __init__(self, slot_dir: Path) -> None:
        self.slot_dir = slot_dir
        self.content: list[list[int]] = [[] for _ in range(N_SLOTS)]
        self.fail_saves = False
        self.fail_restores = False
        self.failed_saves: list[list[int]] = []  # the tokens of each save that failed
        self.failed_restores = 0

    async def slot_action(self, slot_id: int, action: str, filename: str | None = None) -> SlotActionResult:
        await asyncio.sleep(0)  # an answer comes after a round trip: other tasks run meanwhile
        if action == "save":
            held = list(self.content[slot_id])
            if self.fail_saves:
                self.failed_saves.append(held)
                raise UpstreamError(500, b'{"error": {"message": "save failed (injected)"}}')
            assert filename is not None
            data = slot_file(held)
            (self.slot_dir / filename).write_bytes(data)
            return SlotActionResult(len(held), len(data), 1.0)
        if action == "restore":
            if self.fail_restores:
                self.failed_restores += 1
                self.content[slot_id] = []
                raise UpstreamError(500, b'{"error": {"message": "restore failed (injected)"}}')
            assert filename is not None
            tokens = file_tokens((self.slot_dir / filename).read_bytes())
            self.content[slot_id] = tokens
            return SlotActionResult(len(tokens), len(slot_file(tokens)), 1.0)
        if action == "erase":
            self.content[slot_id] = []
        return SlotActionResult(0, 0, 0.0)


@dataclass
class Conversation:
    """One conversation's history: its acknowledged tokens, and its requests' message texts."""

    index: int
    acked: list[int] = field(default_factory=list)  # the tokens of its last acknowledged turn (prompt + answer)
    turns: int = 0
    excused: bool = False  # a fault since its last acknowledged turn may have lost it

    def prompt(self) -> list[int]:
        base = self.acked or SYSTEM
        return [*base, *(1000 * (self.index + 1) + 10 * self.turns + i for i in range(6))]

    def answered(self, prompt: list[int]) -> list[int]:
        return [*prompt, 1000 * (self.index + 1) + 10 * self.turns + 9]

    def chain(self) -> list[Link]:
        users = ({"role": "user", "content": f"conversation {self.index} turn {t}"} for t in range(self.turns + 1))
        return message_chain([{"role": "system", "content": "shared"}, *users])


@dataclass
class Request:
    conversation: Conversation
    task: asyncio.Task[SlotLease]
    prompt: list[int]
    checked: bool = False
    cold: bool = False  # a restore failed while it was brought in


class PoolSchedules(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.root = Path(tempfile.mkdtemp(prefix="pool-schedules-"))
        slot_dir = self.root / "slots"
        slot_dir.mkdir()
        self.store = SnapshotStore(slot_dir, self.root / "index.db")
        self.backend = Backend(slot_dir)
        self.pool = SlotPool(N_SLOTS, self.backend, Snapshots(self.store), FP, 1 << 16,  # type: ignore[arg-type]
                             save_idle_seconds=-1, min_restore_tokens=0)
        self.conversations = [Conversation(i) for i in range(len(SESSIONS))]
        self.requests: list[Request] = []

    def teardown(self) -> None:
        for request in self.requests:
            if request.task.done() and not request.task.cancelled() and request.task.exception() is None:
                request.task.result().release(TurnEnd.FAILED)
            request.task.cancel()
        self.loop.run_until_complete(self._settle())
        self.loop.run_until_complete(self.pool.aclose(5))
        self.loop.close()
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- running the loop until nothing more happens without a step ---------------------------------------------

    async def _settle(self) -> None:
        """Let every task run as far as it can: until each request has its slot or waits in the pool's queue for
        one, and no commit is pending (30 s at most: a loaded machine's threads are slow)."""
        stable = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            await self.pool.snapshots.settle()
            await asyncio.sleep(0.001)
            waiting = sum(not r.task.done() for r in self.requests)
            stable = stable + 1 if waiting == self.pool.queue_length else 0
            if stable >= 3:
                return
        raise AssertionError("the pool did not settle within 30 s")

    def run(self, coroutine: Coroutine[Any, Any, object]) -> None:
        """Run one step's work, let the pool settle, then check what the requests granted meanwhile found."""
        self.loop.run_until_complete(coroutine)
        self.loop.run_until_complete(self._settle())
        self._note_faults()
        self._check_granted()

    def _granted(self) -> list[Request]:
        return [r for r in self.requests if r.task.done() and not r.task.cancelled() and r.task.exception() is None]

    def _running(self, conversation: Conversation) -> bool:
        return any(r.conversation is conversation for r in self.requests)

    def _check_granted(self) -> None:
        """A request that just got its slot finds there what it shares of its conversation's last acknowledged turn.
        A request that does not extend that turn (a second one sent before the first was answered: a retry) leaves
        it: the backend runs over the answer, and only what the two share is owed from then on."""
        for request in self._granted():
            if request.checked:
                continue
            request.checked = True
            lease = request.task.result()
            if currently_in_test_context():
                event(f"granted: {lease.cache.outcome}")  # shown by --hypothesis-show-statistics
            conversation = request.conversation
            shared = _common(conversation.acked, request.prompt)
            held = self.backend.content[lease.slot_id]
            if shared and not conversation.excused and not request.cold:
                assert held[:shared] == conversation.acked[:shared], (
                    f"conversation {conversation.index}'s request got slot {lease.slot_id} holding "
                    f"{_common(held, request.prompt)} of the {shared} tokens it shares with its last acknowledged "
                    f"turn ({lease.cache.outcome}, {lease.cache.why})")
            conversation.acked = conversation.acked[:shared]

    # -- the steps --------------------------------------------------------------------------------------------

    @rule(which=st.integers(0, len(SESSIONS) - 1))
    def request(self, which: int) -> None:
        """A conversation's next request (a second one while its first runs waits for the first's slot)."""
        self._send(which)
        self.run(asyncio.sleep(0))

    @rule(which=st.integers(0, len(SESSIONS) - 1))
    def retry(self, which: int) -> None:
        """A conversation's request sent twice at once (a client's retry racing its original)."""
        self._send(which)
        self._send(which)
        self.run(asyncio.sleep(0))

    def _send(self, which: int) -> None:
        conversation = self.conversations[which]
        if sum(r.conversation is conversation for r in self.requests) >= 2:
            return
        task = self.loop.create_task(self.pool.acquire(SESSIONS[which], conversation.chain()))
        self.requests.append(Request(conversation, task, conversation.prompt()))

    @rule(pick=st.integers(0, 7), end=st.sampled_from(list(TurnEnd)), cut=st.floats(0, 1))
    def end(self, pick: int, end: TurnEnd, cut: float) -> None:
        """A granted request's turn ends: answered, cancelled part way through its prefill, refused, or failed."""
        granted = self._granted()
        if granted:
            self._end(granted[pick % len(granted)], end, cut)
        self.run(asyncio.sleep(0))

    @rule(ends=st.tuples(st.sampled_from(list(TurnEnd)), st.sampled_from(list(TurnEnd))))
    def end_together(self, ends: tuple[TurnEnd, TurnEnd]) -> None:
        """Two turns end in one step of the event loop (two slots free at once, before any waiter resumes)."""
        for request, end in zip(self._granted(), ends, strict=False):
            self._end(request, end, 0.5)
        self.run(asyncio.sleep(0))

    def _end(self, request: Request, end: TurnEnd, cut: float) -> None:
        lease = request.task.result()
        conversation = request.conversation
        shared = _common(self.backend.content[lease.slot_id], request.prompt)
        if end is TurnEnd.COMPLETED:
            answered = conversation.answered(request.prompt)
            self.backend.content[lease.slot_id] = answered
            conversation.acked, conversation.excused = answered, False
            conversation.turns += 1
            lease.release(end, len(answered), shared, len(request.prompt))
        elif end is TurnEnd.REJECTED:
            lease.release(end)  # refused before it ran: the slot is as it was
        else:
            # The backend stopped somewhere in the prompt's prefill: it holds what it reused and part of the rest.
            stop = shared + int((len(request.prompt) - shared) * cut)
            self.backend.content[lease.slot_id] = request.prompt[:stop]
            lease.release(end, stop, shared, stop)
            # A failed turn (the backend broke off or died) leaves the slot unknown: what was only in it is lost,
            # as a backend killed loses its turns since the last save.
            conversation.excused = conversation.excused or end is TurnEnd.FAILED
        self.requests.remove(request)

    @rule(pick=st.integers(0, 7))
    def hang_up(self, pick: int) -> None:
        """A client hangs up while its request waits for a slot or is being brought in."""
        waiting = [r for r in self.requests if not r.task.done()]
        if not waiting:
            return
        request = waiting[pick % len(waiting)]
        request.task.cancel()
        self.requests.remove(request)
        self.run(asyncio.sleep(0))

    @rule(saves=st.booleans(), restores=st.booleans())
    def faults(self, saves: bool, restores: bool) -> None:
        self.backend.fail_saves, self.backend.fail_restores = saves, restores
        self.run(asyncio.sleep(0))

    @rule()
    def flush(self) -> None:
        """The flush at exit (when no turn runs: it waits for running turns)."""
        if not self.requests:
            self.run(flush(self.pool))

    @rule(slot_id=st.integers(0, N_SLOTS - 1))
    def clear(self, slot_id: int) -> None:
        """An operator clears a slot (when no turn runs: it waits for the slot's)."""
        if self.requests:
            return

        async def cleared() -> None:
            with contextlib.suppress(SlotkeeperError):  # its save failed: the slot keeps its state
                await clear_slot(self.pool, slot_id)

        self.run(cleared())

    # -- what must hold after every step ----------------------------------------------------------------------

    def _note_faults(self) -> None:
        """A failed save of a conversation's tokens may lose its last turn (marked, not checked from then until its
        next acknowledged turn). A failed restore loses nothing (the state stays on disk, and is checked as always),
        but the request it was for runs cold: what its slot holds when granted is not checked."""
        for tokens in self.backend.failed_saves:
            for conversation in self.conversations:
                if conversation.acked and tokens[:len(conversation.acked)] == conversation.acked:
                    conversation.excused = True
        self.backend.failed_saves.clear()
        if self.backend.failed_restores:
            for request in self.requests:
                request.cold = True  # (the requests granted in this step are checked after this)
            self.backend.failed_restores = 0

    @invariant()
    def one_session_one_slot(self) -> None:
        for key in SESSIONS:
            holding = [s.slot_id for s in self.pool.slots if s.occupant == key or s.claimed == key]
            assert len(holding) <= 1, f"session {key.session_id} is in slots {holding}"

    @invariant()
    def acknowledged_turns_are_kept(self) -> None:
        for index, conversation in enumerate(self.conversations):
            if not conversation.acked or conversation.excused or self._running(conversation):
                continue
            key = SESSIONS[index]
            size = len(conversation.acked)
            if any(s.occupant == key and self.backend.content[s.slot_id][:size] == conversation.acked
                   for s in self.pool.slots):
                continue
            saved = self.store.get(key)
            tokens = self.store.tokens_of(saved) if saved is not None else None
            assert tokens is not None and tokens.tolist()[:size] == conversation.acked, (
                f"conversation {index}'s last acknowledged turn ({size} tokens) is in no slot it occupies, and its "
                f"saved state holds {None if tokens is None else len(tokens)} tokens")


def test_a_turn_cut_short_after_its_restore_failed_does_not_replace_the_saved_state() -> None:
    """Found by the machine's invariant, in a schedule written out (the random search had not reached it): a restore
    fails, the turn runs cold and its client hangs up part way through the prefill; the slot then held 15 tokens of
    the conversation's 47, and the next switch saved them over its state on disk."""
    machine = PoolSchedules()
    try:
        machine.request(0)
        machine.end(0, TurnEnd.COMPLETED, 0)
        for first, second in ((1, 2), (3, 1)):  # conversation 0's state saved, and its slot taken
            machine.request(first)
            machine.request(second)
            machine.end(0, TurnEnd.COMPLETED, 0)
            machine.end(0, TurnEnd.COMPLETED, 0)
        machine.faults(saves=False, restores=True)
        machine.request(0)
        machine.end(0, TurnEnd.CANCELLED, 0.3)
        machine.faults(saves=False, restores=False)
        machine.request(1)
        machine.request(2)
        machine.end(0, TurnEnd.COMPLETED, 0)
        machine.end(0, TurnEnd.COMPLETED, 0)
        machine.flush()
        machine.acknowledged_turns_are_kept()
    finally:
        machine.teardown()


def test_a_turn_refused_after_its_restore_failed_leaves_its_slot_to_nobody() -> None:
    """Found by the machine (a fresh seed in CI's full run, then written out): a restore fails, which leaves the slot
    empty, and the backend refuses the turn; the slot still named the conversation, holding none of it, so its next
    request counted the slot as its own, extended by the request, and ran hot over nothing (47 tokens prefilled again
    where the state on disk had them all)."""
    machine = PoolSchedules()
    try:
        machine.request(0)
        machine.end(0, TurnEnd.COMPLETED, 0)
        machine.request(1)
        machine.request(2)  # conversation 0's state saved, and its slot taken
        machine.end(0, TurnEnd.COMPLETED, 0)
        machine.end(0, TurnEnd.COMPLETED, 0)
        machine.faults(saves=False, restores=True)
        machine.request(0)
        machine.end(0, TurnEnd.REJECTED, 0)
        machine.faults(saves=False, restores=False)
        machine.request(0)  # checked as it is granted: its slot holds the 47 tokens again
        assert str(machine.requests[-1].task.result().cache.outcome) == "restored"
    finally:
        machine.teardown()


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


PoolSchedules.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None, database=None,
                                           print_blob=True, suppress_health_check=[HealthCheck.too_slow])
test_pool_schedules = PoolSchedules.TestCase
