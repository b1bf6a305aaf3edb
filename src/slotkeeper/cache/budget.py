"""The disk budget: which snapshots to evict so the slot directory stays within its limits.

Four limits, each off at 0: a maximum age since last use, a number of system states per model, a number of side
states per model (what side tasks left: only the last few are worth keeping), and a total size. Least recently
used first; pinned snapshots and the ones in use (a slot holds their session) are never evicted.
Pure: the store applies the decision.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from slotkeeper.types import Snapshot, SnapshotKind

# (model, session id, kind): how the pool names the snapshots it must keep.
SnapshotId = tuple[str, str, SnapshotKind, str]  # model, session id, kind, cache domain


@dataclass(frozen=True, slots=True)
class DiskBudget:
    max_bytes: int = 0
    max_age_seconds: float = 0.0
    max_system_snapshots: int = 0  # per model
    max_side_states: int = 0  # per model

    @property
    def limited(self) -> bool:
        return (self.max_bytes > 0 or self.max_age_seconds > 0 or self.max_system_snapshots > 0
                or self.max_side_states > 0)


@dataclass(frozen=True, slots=True)
class Eviction:
    snapshot: Snapshot
    reason: str


def identity(snapshot: Snapshot) -> SnapshotId:
    return snapshot.model, snapshot.session_id, snapshot.kind, snapshot.domain


def choose_evictions(snapshots: Sequence[Snapshot], budget: DiskBudget, protected: Collection[SnapshotId],
                     now: float, total: int | None = None) -> list[Eviction]:
    """The snapshots to evict, each with the limit it broke, least recently used first within each limit. Each
    snapshot's `n_bytes` is what evicting it frees; `total` what they all take (their sum when None; less when they
    share KV blocks)."""
    if total is None:
        total = sum(s.n_bytes for s in snapshots)
    by_age = sorted(snapshots, key=lambda s: s.last_used)
    evicted: list[Eviction] = []
    gone: set[str] = set()

    def evict(snapshot: Snapshot, reason: str) -> None:
        evicted.append(Eviction(snapshot, reason))
        gone.add(snapshot.filename)

    def evictable(snapshot: Snapshot) -> bool:
        return not snapshot.pinned and identity(snapshot) not in protected and snapshot.filename not in gone

    if budget.max_age_seconds > 0:
        for snapshot in by_age:
            if evictable(snapshot) and now - snapshot.last_used > budget.max_age_seconds:
                evict(snapshot, f"unused for more than {budget.max_age_seconds:.0f} s (max age)")
    for kind, most, what in ((SnapshotKind.SYSTEM, budget.max_system_snapshots, "system snapshot(s)"),
                             (SnapshotKind.SIDE, budget.max_side_states, "side states")):
        if most <= 0:
            continue
        per_model: dict[str, list[Snapshot]] = defaultdict(list)
        for snapshot in by_age:
            if snapshot.kind is kind and snapshot.filename not in gone:
                per_model[snapshot.model].append(snapshot)
        for model_states in per_model.values():
            excess = len(model_states) - most
            for snapshot in model_states:
                if excess <= 0:
                    break
                if evictable(snapshot):
                    evict(snapshot, f"more than {most} {what} for the model")
                    excess -= 1
    if budget.max_bytes > 0:
        total -= sum(s.n_bytes for s in snapshots if s.filename in gone)
        for snapshot in by_age:
            if total <= budget.max_bytes:
                break
            if evictable(snapshot):
                evict(snapshot, f"the snapshots take more than {budget.max_bytes} bytes (disk budget)")
                total -= snapshot.n_bytes
    return evicted
