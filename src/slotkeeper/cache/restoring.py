"""Bringing a snapshot into a slot: the backend's restore, what a refusal says about the file, and the proof that
the restore helped (the backend reused what it owed). What to restore is the planner's answer (planner.py), and
the slot's bookkeeping the pool's."""

from __future__ import annotations

import logging
import time

from slotkeeper.cache.costs import CostMeter, Tier
from slotkeeper.cache.events import CacheEvents
from slotkeeper.cache.proof import RestorePolicy
from slotkeeper.cache.reasons import Reason
from slotkeeper.cache.slots import SlotLease, TurnCache
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.errors import UpstreamError
from slotkeeper.types import CacheOutcome, Snapshot, SnapshotKind
from slotkeeper.upstream.client import SlotActionResult, UpstreamClient

log = logging.getLogger("slotkeeper.pool")

# What llama-server says when it cannot restore a file: an invalid file, or (with several slots) no room in the KV
# cache for it.
_INVALID_FILE = "invalid slot save file"


class Restorer:
    def __init__(self, client: UpstreamClient, snapshots: Snapshots, events: CacheEvents, policy: RestorePolicy,
                 n_ctx_slot: int, costs: CostMeter | None = None) -> None:
        self._client = client
        self._costs = costs if costs is not None else CostMeter()
        self._snapshots = snapshots
        self._events = events
        self._policy = policy
        self._n_ctx_slot = n_ctx_slot
        self.restores = 0
        # Restores the backend refused or broke off (the turn ran without the snapshot).
        self.failed_restores = 0

    def fits(self, snapshot: Snapshot) -> bool:
        if snapshot.n_tokens <= self._n_ctx_slot:
            return True
        log.warning("snapshot of %s/%s has %d tokens, more than a slot's %d: not restored", snapshot.model,
                    snapshot.session_id, snapshot.n_tokens, self._n_ctx_slot)
        return False

    async def restore(self, slot_id: int, cache: TurnCache, snapshot: Snapshot, outcome: CacheOutcome,
                      expected: int, tier: Tier = Tier.DISK) -> int | None:
        """Restore `snapshot` (found in `tier`) into the slot and record it in the turn's `cache` (`expected`: the
        tokens the request shares with it) and in the measured costs; returns the tokens restored, or None when the
        backend refused (the turn runs cold)."""
        started = time.perf_counter()
        result = await self._restore_or_why(slot_id, snapshot)
        if not isinstance(result, SlotActionResult):
            cache.why = Reason.RESTORE_FAILED
            cache.detail = f"the {snapshot.kind} state of {snapshot.session_id} {result} (see the log)"
            return None
        cache.restore_ms = (time.perf_counter() - started) * 1000
        cache.outcome = outcome
        cache.restored_tokens = result.n_tokens
        cache.expected_reuse = min(expected, result.n_tokens)
        cache.restored_from = (f"system:{snapshot.session_id[:12]}" if snapshot.kind is SnapshotKind.SYSTEM
                               else snapshot.session_id)
        self.restores += 1
        self._events.restored(cache.restore_ms, snapshot.n_bytes, result.n_tokens)
        self._costs.restored(tier, snapshot.n_bytes, result.n_tokens, cache.restore_ms)
        self._snapshots.used(snapshot)
        return result.n_tokens

    async def _restore_or_why(self, slot_id: int, snapshot: Snapshot) -> SlotActionResult | str:
        """The backend's restore of `snapshot` into the slot, or why it failed, in words.

        Only a file the backend refuses as invalid twice, the second time into the slot the first attempt emptied
        (so lack of room in the KV cache is ruled out), is quarantined: the file passed our own checks, and any other
        failure (a busy or loading backend, a 500) says nothing about it."""
        if not await self._snapshots.materialize(snapshot):
            self.failed_restores += 1
            return "could not be assembled from its blocks"
        try:
            result = await self._restore_action(slot_id, snapshot)
            return result if result is not None else "was refused by the backend"
        finally:
            await self._snapshots.restored(snapshot)

    async def _restore_action(self, slot_id: int, snapshot: Snapshot) -> SlotActionResult | None:
        for attempt in (1, 2):
            try:
                return await self._client.slot_action(slot_id, "restore", snapshot.filename)
            except UpstreamError as exc:
                refused_file = exc.status_code == 400 and _INVALID_FILE in exc.message
                if refused_file and attempt == 1:
                    continue
                self.failed_restores += 1
                if refused_file:
                    await self._snapshots.quarantine(snapshot, f"backend refused the restore twice: {exc.message}")
                else:
                    log.warning("restoring %s/%s into slot %d failed (%s); the turn runs without it, and the "
                                "snapshot is kept", snapshot.model, snapshot.session_id, slot_id, exc.message)
                return None
        return None

    def judge(self, lease: SlotLease, cache_n: int) -> None:
        """The proof of reuse: the restore owed the tokens the request shares with it (`expected_reuse`)."""
        if not self._policy.judged(lease.cache.expected_reuse, cache_n):
            log.warning("restore for %s did not help: %d tokens restored, %d shared with the request, %d reused by "
                        "the backend", lease.key, lease.cache.restored_tokens, lease.cache.expected_reuse, cache_n)
