"""Every saved state a request could start from (the pool's look-ups): the pending writes the look-up could find
waited for, then the session's own state, those sharing the most leading messages and those sharing the most leading
tokens, found in one worker-thread call, each with the tokens it shares.

The store finds and checks (store.py, matching.py); this module puts what it finds together as the planner's
candidates (planner.py), as one of the snapshots' parts (snapshots.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

from slotkeeper.cache.budget import SnapshotId
from slotkeeper.cache.chain import Link, common_messages
from slotkeeper.cache.costs import Tier
from slotkeeper.cache.matching import shared_with
from slotkeeper.cache.pending import PendingWrites, key_of, snapshot_id
from slotkeeper.cache.planner import NEAR_TIE_TOKENS, Candidate
from slotkeeper.cache.reasons import Reason
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.cache.tokens import Tokens, common_tokens
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    """What a look-up found for a request: the session's own state (or what became of it: `fate`), every candidate
    (the own one included) with the tokens it shares, and whether the request's system part has a saved state."""

    own: Candidate | None
    fate: Reason | None
    saved: list[Candidate]
    system_saved: bool = False


class Lookups:
    """The look-ups of one backend's snapshots. `evicted` tells whether the disk budget evicted a snapshot (of those
    it remembers); the backend's fingerprint comes with `attach`."""

    def __init__(self, store: SnapshotStore, writes: PendingWrites, evicted: Callable[[SnapshotId], bool]) -> None:
        self._store = store
        self._writes = writes
        self._evicted = evicted
        self._fingerprint = ""

    def attach(self, fingerprint: str) -> None:
        self._fingerprint = fingerprint

    async def candidates(self, key: SessionKey, chain: Sequence[Link], tokens: Tokens | None = None,
                         system: SessionKey | None = None, n_system: int = 0) -> Found:
        """Every saved state a request could start from, each with the tokens it shares with the request: the
        session's own (its name is a hint, never the proof), and those of every kind that share the most leading
        messages (the chains) or, given the request's `tokens`, the most leading tokens, compared one by one.
        `system` names the request's system part, to tell whether a state of it is saved.

        Writes still pending that the look-up could find are waited for first: the session's own, the system
        part's, and those of states sharing more than the system part (`n_system` messages) with the request. A
        state found whose save started since (its file is about to be replaced) is waited for, and the look-up made
        again, only when it shares more than every other; else it is left out."""
        pending = [snapshot_id(key)] + ([snapshot_id(system, SnapshotKind.SYSTEM)] if system is not None else [])
        await self._writes.wait(pending)
        if chain:
            await self._writes.wait(self._writes.sharing(chain, n_system + 1))
        found = await asyncio.to_thread(self._find_now, key, chain, tokens, system)
        settled = [c for c in found.saved if snapshot_id(key_of(c.snapshot), c.snapshot.kind) not in self._writes]
        if len(settled) == len(found.saved):
            return found
        best = max((c.tokens for c in settled), default=0)
        if all(c.tokens <= best + NEAR_TIE_TOKENS for c in found.saved):
            # A state whose file a save is about to replace, and that shares no more than others: left out rather
            # than waited for (the save being committed is another conversation's, and its newer state no better).
            return dataclasses.replace(found, saved=settled)
        await self._writes.wait([snapshot_id(key_of(c.snapshot), c.snapshot.kind) for c in found.saved
                                 if c not in settled])
        return await asyncio.to_thread(self._find_now, key, chain, tokens, system)

    def _find_now(self, key: SessionKey, chain: Sequence[Link], tokens: Tokens | None,
                  system: SessionKey | None) -> Found:
        """In a worker thread, in one go."""
        own, fate = self._own_now(key, chain)
        found: dict[str, Candidate] = {} if own is None else {own.snapshot.filename: own}
        if chain:
            for match in self._store.prefix_matches(key.model, self._fingerprint, chain, domain=key.domain):
                if match.snapshot.filename not in found:
                    found[match.snapshot.filename] = Candidate(match.snapshot, match.messages, match.est_tokens,
                                                               match.whole, tier=self._tier(match.snapshot))
        found = _same_estimates(found)
        if tokens is not None:
            for name, candidate in list(found.items()):
                found[name] = self._exact(candidate, tokens)
            for token_match in self._store.best_by_tokens(key.model, self._fingerprint, tokens, key.domain):
                snapshot = token_match.snapshot
                if snapshot.filename in found:
                    continue
                messages = common_messages(self._store.chain_of(snapshot), chain) if chain else 0
                saved = self._store.tokens_of(snapshot)
                whole = saved is not None and token_match.tokens >= saved.size
                found[snapshot.filename] = Candidate(snapshot, messages, token_match.tokens, whole, exact=True,
                                                     tier=self._tier(snapshot), own=False)
        own = found.get(own.snapshot.filename) if own is not None else None
        system_saved = system is not None and self._store.get(system, SnapshotKind.SYSTEM) is not None
        return Found(own, fate, list(found.values()), system_saved)

    def _exact(self, candidate: Candidate, tokens: Tokens) -> Candidate:
        """The candidate with the tokens it shares counted one by one, when its file's tokens can be read."""
        saved = self._store.tokens_of(candidate.snapshot)
        if saved is None:
            return candidate
        shared = common_tokens(saved, tokens)
        return dataclasses.replace(candidate, tokens=shared, whole=shared >= saved.size, exact=True)

    def _tier(self, snapshot: Snapshot) -> Tier:
        return Tier.RAM if self._store.in_ram(snapshot) else Tier.DISK

    def _own_now(self, key: SessionKey, chain: Sequence[Link]) -> tuple[Candidate | None, Reason | None]:
        """The session's own conversation state and what of it the request still shares (a client may have
        edited or trimmed its history); without one, what became of it (evicted, not restorable here,
        quarantined), if anything is known. A request without messages (a raw prompt), or a state without a
        recorded chain, is taken as sharing all of it."""
        row = self._store.get(key)
        own = self._store.checked_snapshot(key, self._fingerprint) if row is not None else None
        if own is None:
            if row is None:
                return None, Reason.EVICTED if self._evicted(snapshot_id(key)) else None
            return None, Reason.NOT_RESTORABLE if row.fingerprint != self._fingerprint else Reason.QUARANTINED
        saved = self._store.chain_of(own) if chain else []
        shared = shared_with(own, saved, chain)  # one read of the recorded chain for both answers
        tier = self._tier(own)
        if shared is None:
            return Candidate(own, len(chain), own.owed_tokens, True, tier=tier, own=True), None
        return Candidate(own, shared[0], shared[1], shared[0] == len(saved), tier=tier, own=True), None


def _same_estimates(found: dict[str, Candidate]) -> dict[str, Candidate]:
    """Candidates that hold the same leading messages of a request share the same tokens of it (but for part of the
    next message, which only counting tells): they get the same estimate, the count of one the request holds whole
    where there is one (its prompt), else the largest, so that a near-tie between them is a tie the cheapest wins."""
    by_depth: dict[int, list[Candidate]] = {}
    for candidate in found.values():
        if not candidate.exact and candidate.messages > 0:
            by_depth.setdefault(candidate.messages, []).append(candidate)
    out = dict(found)
    for group in by_depth.values():
        whole = [c.tokens for c in group if c.whole]
        shared = max(whole) if whole else max(c.tokens for c in group)
        for candidate in group:
            out[candidate.snapshot.filename] = dataclasses.replace(candidate, tokens=shared)
    return out
