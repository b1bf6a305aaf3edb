"""System states: a system prompt's part held alone in a slot and saved as that prompt's system snapshot, which every
later conversation on the prompt starts from.

A slot comes to hold exactly a system part in two ways: an operator's pre-warm evaluates it into a slot the pool
leased (the service sends the request, then hands the result here), or an idle conversation's slot, once saved, is
cut back to it (cutting.py), off the requests' path. Both are counted here, and so are the system prompts found too
short to be worth a snapshot, so that the planner stops asking for them. Which slot, and when, is the pool's and the
idle saves' decision; this module only makes the state.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from slotkeeper.cache.bringing import SessionNotes
from slotkeeper.cache.capability import Strategy
from slotkeeper.cache.cutting import cut_to, system_prefix
from slotkeeper.cache.proof import RestorePolicy
from slotkeeper.cache.reasons import Reason
from slotkeeper.cache.saving import Saver
from slotkeeper.cache.slots import Held, SlotLease, SlotState
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.systemprompt import SystemPrompt
from slotkeeper.errors import SlotkeeperError
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.upstream.client import UpstreamClient

log = logging.getLogger("slotkeeper.pool")

# System prompts found too short to be worth a snapshot, remembered so they are not warmed up again.
_SHORT_SYSTEMS_KEPT = 1024


class WarmUps:
    def __init__(self, client: UpstreamClient, saver: Saver, snapshots: Snapshots, policy: RestorePolicy,
                 slots: Sequence[SlotState], floor: Callable[[], int], give_back: Callable[[SlotState], None],
                 notes: SessionNotes) -> None:
        self._client = client
        self._saver = saver
        self._snapshots = snapshots
        self._policy = policy
        self._slots = slots
        self._floor = floor  # the pool's: the fewest tokens a state must share for its restore to pay
        # The pool's: a slot taken for a cut is handed back through it (so a waiting request gets it at once).
        self._give_back = give_back
        self._notes = notes  # a cut takes a slot's state from its conversation: its next turn is told why
        self._short_systems: deque[str] = deque(maxlen=_SHORT_SYSTEMS_KEPT)
        # System parts evaluated into a slot (an operator's pre-warm, or a slot's state cut back to its system part
        # after a turn), and the failures of either: read by the metrics and the session API.
        self.warm_ups = 0
        self.cuts = 0
        self.failed_warm_ups = 0

    def worth(self, system: SystemPrompt) -> bool:
        """Whether `system` may be long enough for a system snapshot (the planner cuts a slot back only to one)."""
        # About two characters of canonical JSON per token at the least: shorter prompts cannot reach the threshold.
        return system.chars >= 2 * self._floor() and system.digest not in self._short_systems

    async def save_system(self, lease: SlotLease, n_tokens: int, wait: bool = True) -> Snapshot | None:
        """The caller warmed the leased slot up with the lease's system part (`n_tokens` prompt tokens): keep it as
        the system snapshot, unless it is too short to be worth one. Only called after a warm-up that succeeded.

        With `wait`, the snapshot is returned once committed (a pre-warm reports it). Without, only the backend's
        write of the slot is waited for, and the commit goes on in the background."""
        system = lease.system
        assert system is not None
        self.warm_ups += 1
        slot = self._slots[lease.slot_id]
        return await self._save_part(slot, lease.key, system, n_tokens, wait, lease)

    def failed(self, lease: SlotLease) -> None:
        """The warm-up request failed: nothing is saved, and the slot's content is not known any more."""
        self.failed_warm_ups += 1
        self._slots[lease.slot_id].chain = []
        self._slots[lease.slot_id].tokens = None

    async def cut_back(self, slot: SlotState) -> None:
        """The slot's conversation is saved and idle, and no saved state covers its system part: cut the slot's
        state back to that part (cutting.py) and save it as a system state, which every later conversation on it
        starts from, as does this one's next turn after restoring its own state. Off the requests' path; a failure
        costs only the system state."""
        system, key, generation = slot.cut, slot.occupant, slot.generation

        def still_idle() -> bool:
            """Whether the slot is still free and holds the saved conversation: each wait below lets a request
            lease it, and a cut then would change that request's state under it."""
            return not slot.busy and not slot.dirty and slot.occupant == key and slot.generation == generation

        slot.cut = None
        if system is None or key is None or not still_idle():
            return
        if self._policy.strategy is Strategy.KEEP_HOT:
            # The file just saved may tell that this build keeps checkpoints in its files (then restores help).
            await self._snapshots.settle(key)
            if self._policy.strategy is Strategy.KEEP_HOT or not still_idle():
                return  # under keep-hot no state is restored: a system state could never help
        if await self._snapshots.get(key.within(system.digest), SnapshotKind.SYSTEM) is not None:
            return  # another slot's cut saved it meanwhile
        if not still_idle():
            return  # a request took the slot meanwhile; a later turn on this system part is marked for the cut again
        slot.busy = True  # taken with no wait since the check above
        started = time.perf_counter()
        try:
            prefix = await system_prefix(self._client, system)
            if prefix is None:
                return
            slot.occupant, slot.chain, slot.tokens = None, [], None  # from here the slot holds no session's state
            self._notes.left(key, Reason.SLOT_TAKEN, f"slot {slot.slot_id} was cut back to its system part, which "
                                                     "was saved for later conversations")
            n_tokens = await cut_to(self._client, slot.slot_id, prefix)
            self.cuts += 1
            await self._save_part(slot, key, system, n_tokens, wait=False)
            log.info("slot %d cut back to system prompt %s after %s's turn: %d tokens in %.0f ms", slot.slot_id,
                     system.short_id, key.session_id, n_tokens, (time.perf_counter() - started) * 1000)
        except SlotkeeperError as exc:
            self.failed_warm_ups += 1
            slot.chain, slot.tokens, slot.n_tokens, slot.n_prompt, slot.at_prompt_end = [], None, 0, 0, False
            log.warning("cutting slot %d back to system prompt %s failed, so no system state was saved: %s",
                        slot.slot_id, system.short_id, exc.message)
        finally:
            self._give_back(slot)

    async def _save_part(self, slot: SlotState, owner: SessionKey, system: SystemPrompt, n_tokens: int, wait: bool,
                         lease: SlotLease | None = None) -> Snapshot | None:
        """The slot holds exactly `system`'s part (`n_tokens`): save it as a system state (in `owner`'s model and
        cache domain), unless it is too short."""
        slot.chain = system.chain()
        slot.n_tokens = slot.n_prompt = n_tokens
        slot.replay, slot.at_prompt_end, slot.tokens = None, True, None
        if n_tokens < self._floor():
            self._short_systems.append(system.digest)
            log.info("system prompt %s has %d tokens, fewer than a restore needs to pay (%d): no system snapshot",
                     system.short_id, n_tokens, self._floor())
            return None
        key = owner.within(system.digest)
        waited = await self._saver.save(slot.slot_id, key, Held.of(slot), SnapshotKind.SYSTEM, wait=wait)
        if lease is not None:
            lease.cache.save_ms += waited
        return await self._snapshots.get(key, SnapshotKind.SYSTEM) if wait else None
