"""SnapshotStore against a real directory: the backend's writes are simulated by writing the temp file ourselves."""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from pathlib import Path

import pytest

from slotkeeper.cache import fingerprint as fp_mod
from slotkeeper.cache.chain import Link
from slotkeeper.cache.fingerprint import backend_fingerprint, model_file_identity
from slotkeeper.cache.reconcile import ReconcileReport
from slotkeeper.cache.store import QUARANTINE_DIR, SnapshotStore, file_checksum
from slotkeeper.errors import SnapshotError
from slotkeeper.types import IdSource, SessionKey, Snapshot

FP = "0123456789abcdef"
FINAL_RE = re.compile(r"^[0-9a-f]{40}-[0-9a-f]{8}\.bin$")


@pytest.fixture
def slot_dir(tmp_path: Path) -> Path:
    return tmp_path / "slots"


@pytest.fixture
def store(tmp_path: Path, slot_dir: Path):
    s = SnapshotStore(slot_dir, tmp_path / "index" / "index.db")
    yield s
    s.close()


def key(session: str = "s1", model: str = "m") -> SessionKey:
    return SessionKey(model, session, IdSource.HEADER)


def save(store: SnapshotStore, k: SessionKey, data: bytes, n_tokens: int = 10, fingerprint: str = FP) -> Snapshot:
    temp = store.temp_name(k, fingerprint)
    (store.slot_dir / temp).write_bytes(data)
    return store.commit(k, temp, fingerprint, n_tokens)


def quarantined(slot_dir: Path) -> list[str]:
    qdir = slot_dir / QUARANTINE_DIR
    return sorted(os.listdir(qdir)) if qdir.exists() else []


# -- commit -----------------------------------------------------------------------------------------------------


def test_commit_makes_final_file_and_row(store: SnapshotStore, slot_dir: Path) -> None:
    k = key()
    temp = store.temp_name(k, FP)
    assert re.fullmatch(r"[0-9a-f]{40}\.tmp-[0-9a-f]{8}\.bin", temp)
    data = os.urandom(5000)
    (slot_dir / temp).write_bytes(data)
    snap = store.commit(k, temp, FP, 123)

    assert FINAL_RE.match(snap.filename)
    assert not (slot_dir / temp).exists()
    final = slot_dir / snap.filename
    assert final.read_bytes() == data
    assert sorted(os.listdir(slot_dir)) == [snap.filename]
    assert snap.n_tokens == 123
    assert snap.n_bytes == 5000
    assert snap.checksum == file_checksum(final)
    assert len(snap.checksum) == 32
    assert snap.fingerprint == FP
    assert (snap.model, snap.session_id) == ("m", "s1")
    assert snap.hits == 0
    assert store.get(k) == snap


def test_second_commit_replaces_row_and_previous_file(store: SnapshotStore, slot_dir: Path) -> None:
    k = key()
    first = save(store, k, b"a" * 100, n_tokens=5)
    time.sleep(0.01)
    second = save(store, k, b"b" * 200, n_tokens=9)

    assert second.filename != first.filename
    assert not (slot_dir / first.filename).exists()
    assert sorted(os.listdir(slot_dir)) == [second.filename]
    assert second.n_tokens == 9 and second.n_bytes == 200
    assert second.checksum == file_checksum(slot_dir / second.filename)
    assert second.created == first.created
    assert second.last_used > first.last_used
    assert store.list() == [second]


def test_commit_zero_tokens_keeps_previous(store: SnapshotStore, slot_dir: Path) -> None:
    k = key()
    good = save(store, k, b"good-state" * 10, n_tokens=7)
    temp = store.temp_name(k, FP)
    (slot_dir / temp).write_bytes(b"empty")
    with pytest.raises(SnapshotError):
        store.commit(k, temp, FP, 0)
    assert not (slot_dir / temp).exists()
    assert store.get(k) == good
    assert (slot_dir / good.filename).read_bytes() == b"good-state" * 10
    assert sorted(os.listdir(slot_dir)) == [good.filename]
    assert store.checked_snapshot(k, FP) == good


def test_commit_missing_temp_raises(store: SnapshotStore) -> None:
    k = key()
    with pytest.raises(SnapshotError):
        store.commit(k, store.temp_name(k, FP), FP, 3)
    assert store.get(k) is None


def test_commit_writes_the_index_in_one_transaction(store: SnapshotStore, slot_dir: Path) -> None:
    # Each transaction appends the pages it changed to the write-ahead log and fsyncs it. The chain rows used to be
    # inserted as autocommitted statements, one transaction and one fsync each: a save of a 200-message conversation
    # took about 0.5 s on the benchmark machine. In one transaction the log grows by a few pages.
    save(store, key("first"), b"x" * 100)
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    k = key("long")
    temp = store.temp_name(k, FP)
    (slot_dir / temp).write_bytes(b"y" * 100)
    store.commit(k, temp, FP, 100, [Link(f"{i:032x}", 10 * (i + 1)) for i in range(200)])
    _, wal_frames, _ = store._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert wal_frames < 40
    assert store.shared_prefix(store.get(k), [Link(f"{i:032x}", 0) for i in range(200)]) == (200, 100)


# -- checked_snapshot -------------------------------------------------------------------------------------------


def test_checked_snapshot_intact(store: SnapshotStore, slot_dir: Path) -> None:
    k = key()
    snap = save(store, k, os.urandom(4096))
    assert store.checked_snapshot(k, FP) == snap
    assert (slot_dir / snap.filename).exists()
    assert quarantined(slot_dir) == []
    assert store.checked_snapshot(key("unknown"), FP) is None


def _truncate_one(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-1])


def _truncate_zero(path: Path) -> None:
    path.write_bytes(b"")


def _random_same_size(path: Path) -> None:
    size = path.stat().st_size
    path.write_bytes(os.urandom(size))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [_truncate_one, _truncate_zero, _random_same_size, _flip_byte],
    ids=["truncated-1", "truncated-0", "random-same-size", "flipped-byte"],
)
def test_checked_snapshot_quarantines_damaged_file(
    store: SnapshotStore, slot_dir: Path, damage, caplog: pytest.LogCaptureFixture
) -> None:
    k = key("sess-damaged")
    snap = save(store, k, os.urandom(8192))
    path = slot_dir / snap.filename
    damage(path)
    damaged = path.read_bytes()

    with caplog.at_level(logging.WARNING, logger="slotkeeper.store"):
        assert store.checked_snapshot(k, FP) is None
    assert store.get(k) is None
    assert not path.exists() and not path.is_symlink()
    moved = quarantined(slot_dir)
    assert len(moved) == 1 and moved[0].startswith(snap.filename)
    assert (slot_dir / QUARANTINE_DIR / moved[0]).read_bytes() == damaged
    records = [r for r in caplog.records if r.levelno == logging.WARNING and "sess-damaged" in r.getMessage()]
    assert records, caplog.text
    # a second lookup finds nothing and does not fail
    assert store.checked_snapshot(k, FP) is None


def test_checked_snapshot_file_deleted(store: SnapshotStore, slot_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    k = key("sess-gone")
    snap = save(store, k, b"x" * 100)
    (slot_dir / snap.filename).unlink()
    with caplog.at_level(logging.WARNING, logger="slotkeeper.store"):
        assert store.checked_snapshot(k, FP) is None
    assert store.get(k) is None
    assert store.list() == []
    assert any(r.levelno == logging.WARNING and "sess-gone" in r.getMessage() and "missing" in r.getMessage()
               for r in caplog.records)


def test_checked_snapshot_symlink_outside(
    store: SnapshotStore, slot_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    k = key("sess-link")
    data = os.urandom(1000)
    snap = save(store, k, data)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data)  # same bytes: size and checksum would match through the link
    path = slot_dir / snap.filename
    path.unlink()
    path.symlink_to(outside)

    with caplog.at_level(logging.WARNING, logger="slotkeeper.store"):
        assert store.checked_snapshot(k, FP) is None
    assert store.get(k) is None
    assert not path.exists() and not path.is_symlink()
    assert outside.is_file() and not outside.is_symlink()
    assert outside.read_bytes() == data
    moved = quarantined(slot_dir)
    assert len(moved) == 1
    assert (slot_dir / QUARANTINE_DIR / moved[0]).is_symlink()
    assert any(r.levelno == logging.WARNING and "sess-link" in r.getMessage() for r in caplog.records)


def test_a_snapshot_of_another_fingerprint_is_not_restored_here_and_kept(
    store: SnapshotStore, slot_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another model, build or slot count made it: nothing says the file is bad, so it is not quarantined; it stays
    for the backend it was made for, and the disk budget ages it out."""
    k = key("sess-fp")
    data = os.urandom(1000)
    snap = save(store, k, data)
    path = slot_dir / snap.filename
    with caplog.at_level(logging.WARNING, logger="slotkeeper.store"):
        assert store.checked_snapshot(k, "fedcba9876543210") is None
        assert store.checked_snapshot(k, "fedcba9876543210") is None
    assert store.get(k) == snap and path.read_bytes() == data and quarantined(slot_dir) == []
    said = [r for r in caplog.records if "sess-fp" in r.getMessage() and "another model" in r.getMessage()]
    assert len(said) == 1  # once per snapshot
    assert store.checked_snapshot(k, FP) == snap  # still restorable by its own backend


# -- mark_used, list, get, delete -------------------------------------------------------------------------------


def test_mark_used_increments_hits(store: SnapshotStore) -> None:
    k = key()
    snap = save(store, k, b"abc")
    store.mark_used(k)
    store.mark_used(k)
    after = store.get(k)
    assert after is not None
    assert after.hits == 2
    assert after.last_used >= snap.last_used
    store.mark_used(key("nobody"))  # no row: nothing happens
    assert store.get(key("nobody")) is None


def test_list_orders_and_filters(store: SnapshotStore) -> None:
    a = key("a", "m1")
    b = key("b", "m1")
    c = key("c", "m2")
    save(store, a, b"a")
    time.sleep(0.01)
    save(store, b, b"b")
    time.sleep(0.01)
    save(store, c, b"c")
    time.sleep(0.01)
    store.mark_used(a)

    assert [s.session_id for s in store.list()] == ["a", "c", "b"]
    assert [s.session_id for s in store.list("m1")] == ["a", "b"]
    assert [s.session_id for s in store.list("m2")] == ["c"]
    assert store.list("other") == []
    got = store.get(b)
    assert got is not None and got.session_id == "b" and got.model == "m1"
    assert store.get(key("b", "m2")) is None


def test_delete(store: SnapshotStore, slot_dir: Path) -> None:
    k = key()
    other = key("other")
    snap = save(store, k, b"state")
    keep = save(store, other, b"keep")
    removed = store.delete(k)
    assert removed == snap
    assert store.get(k) is None
    assert not (slot_dir / snap.filename).exists()
    assert store.get(other) == keep
    assert (slot_dir / keep.filename).exists()
    assert store.delete(k) is None
    assert store.delete(key("never")) is None


def test_delete_path_like_session_touches_nothing_outside(store: SnapshotStore, slot_dir: Path,
                                                          tmp_path: Path) -> None:
    k = key("../x")
    sentinels = [tmp_path / "x", tmp_path / "x.bin", slot_dir.parent / "index" / "x"]
    for s in sentinels:
        s.parent.mkdir(parents=True, exist_ok=True)
        s.write_bytes(b"sentinel")
    snap = save(store, k, b"state")
    assert FINAL_RE.match(snap.filename)
    assert (slot_dir / snap.filename).exists()
    before = sorted(str(p) for p in tmp_path.rglob("*") if slot_dir not in p.parents and p != slot_dir)

    assert store.delete(k) == snap
    assert not (slot_dir / snap.filename).exists()
    for s in sentinels:
        assert s.read_bytes() == b"sentinel"
    after = sorted(str(p) for p in tmp_path.rglob("*") if slot_dir not in p.parents and p != slot_dir)
    assert after == before
    assert store.delete(key("../x")) is None


# -- reconcile --------------------------------------------------------------------------------------------------


def test_reconcile(store: SnapshotStore, slot_dir: Path) -> None:
    kept = save(store, key("kept"), b"kept")
    lost = save(store, key("lost"), b"lost")
    (slot_dir / lost.filename).unlink()
    temps = [f"{'a' * 40}.tmp-0123abcd.bin", f"{'b' * 40}.tmp-deadbeef.bin"]
    orphans = [f"{'c' * 40}-0badf00d.bin"]
    foreign = ["qwen--chat.bin", "notes.txt", f"{'d' * 40}.bin", f"{'A' * 40}-0badf00d.bin"]
    for name in temps + orphans + foreign:
        (slot_dir / name).write_bytes(b"junk")

    report = store.reconcile()
    assert report == ReconcileReport(temporaries_removed=2, orphans_removed=1, rows_dropped=1)
    for name in temps + orphans:
        assert not (slot_dir / name).exists()
    for name in foreign:
        assert (slot_dir / name).read_bytes() == b"junk"
    assert (slot_dir / kept.filename).read_bytes() == b"kept"
    assert store.get(key("kept")) == kept
    assert store.get(key("lost")) is None
    assert store.reconcile() == ReconcileReport(0, 0, 0)


def test_dirs_created_private(tmp_path: Path) -> None:
    slot_dir = tmp_path / "a" / "slots"
    index = tmp_path / "b" / "idx" / "index.db"
    s = SnapshotStore(slot_dir, index)
    try:
        assert stat.S_IMODE(slot_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(index.parent.stat().st_mode) == 0o700
        assert index.exists()
    finally:
        s.close()


# -- identities and fingerprints --------------------------------------------------------------------------------


def test_identity_cache_round_trip(store: SnapshotStore) -> None:
    assert store.cached_identity("/m.gguf", 10, 5) is None
    store.remember_identity("/m.gguf", 10, 5, "file:abc")
    assert store.cached_identity("/m.gguf", 10, 5) == "file:abc"
    assert store.cached_identity("/m.gguf", 11, 5) is None
    assert store.cached_identity("/m.gguf", 10, 6) is None
    assert store.cached_identity("/other.gguf", 10, 5) is None
    store.remember_identity("/m.gguf", 10, 5, "file:def")
    assert store.cached_identity("/m.gguf", 10, 5) == "file:def"


HEAD = 4 * 1024 * 1024


def _patch_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_model_identity_small_file(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    path.write_bytes(os.urandom(10_000))
    first = model_file_identity(path)
    assert first.startswith("file:")
    assert model_file_identity(path) == first
    _patch_byte(path, 5000)
    assert model_file_identity(path) != first


def test_model_identity_large_file_sampled_bytes(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    size = HEAD + 3 * 1024 * 1024 + 12345
    path.write_bytes(os.urandom(size))
    base = model_file_identity(path)
    assert model_file_identity(path) == base
    span = size - HEAD
    # a byte in the head, in the first tensor sample, in a middle sample and in the final sample
    for offset in (100, HEAD, HEAD + span * 8 // 16 + 10, size - 1):
        _patch_byte(path, offset)
        changed = model_file_identity(path)
        assert changed != base, offset
        _patch_byte(path, offset)  # undo
        assert model_file_identity(path) == base


def test_model_identity_cached_in_store(store: SnapshotStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.gguf"
    path.write_bytes(os.urandom(HEAD + 1024 * 1024))
    first = model_file_identity(path, store)
    st = path.stat()
    assert store.cached_identity(str(path.resolve()), st.st_size, st.st_mtime_ns) == first

    def no_open(self: Path, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"{self} was read although its identity is cached")

    monkeypatch.setattr(fp_mod.Path, "open", no_open)
    assert model_file_identity(path, store) == first
    monkeypatch.undo()

    # a changed mtime invalidates the cache: the file is read again
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    _patch_byte(path, 10)
    assert model_file_identity(path, store) != first


def test_backend_fingerprint() -> None:
    layout = {"n_slots": 2, "n_ctx_slot": 4096, "build": "b1", "cache_type_k": "f16"}
    fp = backend_fingerprint("file:abc", layout)
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    assert backend_fingerprint("file:abc", dict(reversed(list(layout.items())))) == fp
    assert backend_fingerprint("file:abc", {**layout, "n_ctx_slot": 8192}) != fp
    assert backend_fingerprint("file:abc", {**layout, "n_slots": 3}) != fp
    assert backend_fingerprint("file:abd", layout) != fp


# -- prompt token counts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n_tokens", "n_prompt", "owed", "at_end"), [
    (500, 100, 100, False),  # 400 generated tokens: a request owes only the prompt
    (100, 100, 100, True),  # saved at the prompt's end
    (90, 100, 90, True),  # a cut-short prefill: fewer tokens than the prompt
    (500, 0, 500, False),  # not known (an index or bundle from before the count): the whole state
])
def test_a_snapshot_owes_its_prompt_not_what_was_generated(store: SnapshotStore, n_tokens: int, n_prompt: int,
                                                           owed: int, at_end: bool) -> None:
    k = key()
    temp = store.temp_name(k, FP)
    (store.slot_dir / temp).write_bytes(b"x" * 100)
    chain = [Link(f"{i:032x}", 10 * (i + 1)) for i in range(4)]
    snap = store.commit(k, temp, FP, n_tokens, chain, n_prompt=n_prompt)
    assert (snap.n_prompt, snap.owed_tokens, snap.at_prompt_end) == (n_prompt, owed, at_end)
    assert store.shared_prefix(snap, [*chain, Link("f" * 32, 99)]) == (4, owed)  # a request that extends it
    assert store.shared_prefix(snap, [*chain[:2], Link("e" * 32, 1)]) == (2, owed * 20 // 40)  # an edited one
    match = store.best_prefix("m", FP, [*chain, Link("f" * 32, 99)])
    assert match is not None and match.whole and match.est_tokens == owed
    match = store.best_prefix("m", FP, chain[:3])
    assert match is not None and not match.whole


def test_an_index_from_before_prompt_counts_gets_the_column(tmp_path: Path, slot_dir: Path) -> None:
    import sqlite3

    index = tmp_path / "old" / "index.db"
    index.parent.mkdir()
    db = sqlite3.connect(index)
    db.executescript("""CREATE TABLE snapshots (model TEXT NOT NULL, session_id TEXT NOT NULL,
        kind TEXT NOT NULL DEFAULT 'session', filename TEXT NOT NULL UNIQUE, fingerprint TEXT NOT NULL,
        n_tokens INTEGER NOT NULL, n_bytes INTEGER NOT NULL, checksum TEXT NOT NULL, created REAL NOT NULL,
        last_used REAL NOT NULL, hits INTEGER NOT NULL DEFAULT 0, pinned INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (model, session_id, kind));
        INSERT INTO snapshots VALUES ('m', 's1', 'session', 'f.bin', 'fp', 42, 7, 'c', 1.0, 1.0, 0, 0);""")
    db.commit()
    db.close()
    store = SnapshotStore(slot_dir, index)
    try:
        old = store.get(key())
        assert old is not None and old.n_prompt == 0 and old.owed_tokens == 42
    finally:
        store.close()


# -- the quarantine and the disk budget -------------------------------------------------------------------------


def test_quarantined_files_age_out_and_count_in_the_disk_budget(store: SnapshotStore, slot_dir: Path) -> None:
    from slotkeeper.cache.budget import DiskBudget
    from slotkeeper.cache.quarantine import QUARANTINE_KEEP_SECONDS

    qdir = slot_dir / QUARANTINE_DIR
    qdir.mkdir(parents=True)
    now = time.time()
    ages = {"old": QUARANTINE_KEEP_SECONDS + 60, "older-than-max-age": 7200, "recent": 60, "newest": 1}
    for name, age in ages.items():
        (qdir / f"{name}.bin.{int(now - age)}").write_bytes(b"q" * 1000)
    save(store, key("live"), b"s" * 3000)
    # No budget: only what is older than a week goes.
    assert store.trim_quarantine(DiskBudget(), now) == 1
    assert sorted(p.split(".")[0] for p in os.listdir(qdir)) == ["newest", "older-than-max-age", "recent"]
    # A max age: older quarantined files go too.
    assert store.trim_quarantine(DiskBudget(max_age_seconds=3600), now) == 1
    # A total of 4500 bytes: 3000 of snapshots + 2000 quarantined is over it; the oldest quarantined file goes,
    # never the snapshot.
    assert store.enforce_budget(DiskBudget(max_bytes=4500)) == []
    assert [p.split(".")[0] for p in os.listdir(qdir)] == ["newest"]
    assert store.get(key("live")) is not None
