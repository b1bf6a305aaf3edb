"""The disk budget: the policy (which snapshots go) and the store applying it (row, file and sidecar together)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from slotkeeper.cache.budget import DiskBudget, choose_evictions
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind

NOW = 1_000_000.0


def snap(name: str, last_used: float, n_bytes: int = 100, kind: SnapshotKind = SnapshotKind.SESSION,
         model: str = "m", pinned: bool = False) -> Snapshot:
    return Snapshot(model, name, f"{name}.bin", "fp", 10, n_bytes, "c", 0.0, last_used, 0, kind, pinned)


def names(evictions: list) -> list[str]:
    return [e.snapshot.session_id for e in evictions]


def test_no_limits_evict_nothing() -> None:
    assert choose_evictions([snap("a", 0), snap("b", 1)], DiskBudget(), set(), NOW) == []


def test_byte_budget_evicts_least_recently_used_until_it_fits() -> None:
    rows = [snap("old", NOW - 30), snap("mid", NOW - 20), snap("new", NOW - 10)]
    assert names(choose_evictions(rows, DiskBudget(max_bytes=150), set(), NOW)) == ["old", "mid"]
    assert names(choose_evictions(rows, DiskBudget(max_bytes=300), set(), NOW)) == []


def test_active_and_pinned_snapshots_are_never_evicted() -> None:
    rows = [snap("active", NOW - 50), snap("pinned", NOW - 40, pinned=True), snap("old", NOW - 30),
            snap("new", NOW - 10)]
    evicted = choose_evictions(rows, DiskBudget(max_bytes=100, max_age_seconds=5), {("m", "active", "session", "")},
                               NOW)
    assert names(evicted) == ["old", "new"]  # over budget even then: what is left is protected


def test_max_age_evicts_what_was_not_used_recently() -> None:
    rows = [snap("stale", NOW - 7200), snap("fresh", NOW - 60)]
    evicted = choose_evictions(rows, DiskBudget(max_age_seconds=3600), set(), NOW)
    assert names(evicted) == ["stale"] and "max age" in evicted[0].reason


def test_a_system_limit_of_one_keeps_exactly_the_most_recent_per_model() -> None:
    system = SnapshotKind.SYSTEM
    rows = [snap("s1", NOW - 30, kind=system), snap("s2", NOW - 20, kind=system), snap("s3", NOW - 10, kind=system),
            snap("t1", NOW - 5, kind=system, model="other"), snap("conv", NOW - 40)]
    evicted = choose_evictions(rows, DiskBudget(max_system_snapshots=1), set(), NOW)
    assert names(evicted) == ["s1", "s2"]
    assert names(choose_evictions(rows, DiskBudget(max_system_snapshots=2), set(), NOW)) == ["s1"]


def saved(store: SnapshotStore, session: str, kind: SnapshotKind = SnapshotKind.SESSION, size: int = 1000) -> Snapshot:
    key = SessionKey("m", session)
    temp = store.temp_name(key, "fp", kind)
    (store.slot_dir / temp).write_bytes(os.urandom(size))
    return store.commit(key, temp, "fp", 50, (), size, kind)


def test_store_eviction_removes_row_file_and_sidecar_together(store: SnapshotStore) -> None:
    old = saved(store, "old")
    (store.slot_dir / (old.filename + ".ckpt")).write_bytes(b"checkpoints")
    time.sleep(0.01)
    kept = saved(store, "kept")
    evicted = store.enforce_budget(DiskBudget(max_bytes=1500))
    assert [e.snapshot.session_id for e in evicted] == ["old"]
    assert store.get(SessionKey("m", "old")) is None and store.get(SessionKey("m", "kept")) is not None
    assert sorted(p.name for p in store.slot_dir.iterdir()) == [kept.filename]


def test_pinned_snapshots_survive_and_usage_counts_them(store: SnapshotStore) -> None:
    saved(store, "a")
    time.sleep(0.01)
    saved(store, "b", SnapshotKind.SYSTEM)
    assert store.set_pinned(SessionKey("m", "a"), True) is not None
    assert store.enforce_budget(DiskBudget(max_bytes=1)) != []
    assert [s.session_id for s in store.list(kind=None)] == ["a"]
    usage = store.usage()
    assert usage["session"] == {"count": 1, "bytes": 1000, "pinned": 1}
    assert usage["system"] == {"count": 0, "bytes": 0, "pinned": 0}


def test_reconcile_removes_orphan_sidecars_but_not_foreign_files(store: SnapshotStore, slot_dir: Path) -> None:
    live = saved(store, "live")
    (slot_dir / (live.filename + ".ckpt")).write_bytes(b"x")
    orphan = "0" * 40 + "-0badf00d.bin"
    (slot_dir / (orphan + ".ckpt")).write_bytes(b"x")
    (slot_dir / "someone-elses.bin.ckpt").write_bytes(b"x")
    report = store.reconcile()
    assert report.orphans_removed == 1
    assert sorted(p.name for p in slot_dir.iterdir()) == sorted(
        [live.filename, live.filename + ".ckpt", "someone-elses.bin.ckpt"])


def test_an_index_from_before_pinning_gets_the_column(tmp_path: Path) -> None:
    import sqlite3

    index = tmp_path / "old.sqlite3"
    db = sqlite3.connect(index)
    db.execute("CREATE TABLE snapshots (model TEXT NOT NULL, session_id TEXT NOT NULL, kind TEXT NOT NULL DEFAULT "
               "'session', filename TEXT NOT NULL UNIQUE, fingerprint TEXT NOT NULL, n_tokens INTEGER NOT NULL, "
               "n_bytes INTEGER NOT NULL, checksum TEXT NOT NULL, created REAL NOT NULL, last_used REAL NOT NULL, "
               "hits INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (model, session_id, kind))")
    db.execute("INSERT INTO snapshots VALUES ('m', 'a', 'session', 'f.bin', 'fp', 1, 1, 'c', 0, 0, 0)")
    db.commit()
    db.close()
    store = SnapshotStore(tmp_path / "slots", index)
    try:
        [row] = store.list()
        assert row.pinned is False and row.session_id == "a"
    finally:
        store.close()


def test_a_budget_that_holds_is_checked_without_listing_every_snapshot(store: SnapshotStore, monkeypatch) -> None:
    # Every save enforces the budget; listing all snapshots to find nothing to evict took 40-100 ms at 10,000.
    saved(store, "a")
    time.sleep(0.01)
    saved(store, "b", SnapshotKind.SYSTEM)
    listed: list[object] = []
    real_list = store.list
    monkeypatch.setattr(store, "list", lambda *args, **kwargs: listed.append(1) or real_list(*args, **kwargs))
    holds = [DiskBudget(max_bytes=2000), DiskBudget(max_age_seconds=3600), DiskBudget(max_system_snapshots=1),
             DiskBudget(max_bytes=5000, max_age_seconds=60, max_system_snapshots=3)]
    for budget in holds:
        assert store.enforce_budget(budget) == []
    assert listed == []
    # Each limit, once broken, still evicts.
    assert names(store.enforce_budget(DiskBudget(max_age_seconds=1e-6))) == ["a", "b"] and listed == [1]
    saved(store, "c")
    saved(store, "d", SnapshotKind.SYSTEM)
    saved(store, "e", SnapshotKind.SYSTEM)
    assert names(store.enforce_budget(DiskBudget(max_system_snapshots=1))) == ["d"]
    assert names(store.enforce_budget(DiskBudget(max_bytes=1000))) == ["c"]
