"""The store re-hashes a snapshot file before a restore only when its stat identity moved since this process hashed
it; every way of changing the file in place still gets it refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slotkeeper.cache import store as store_mod
from slotkeeper.cache.hashmemo import FileIdentity, HashMemo, fine_timestamps, read_identity
from slotkeeper.cache.store import QUARANTINE_DIR, SnapshotStore
from slotkeeper.types import IdSource, SessionKey, Snapshot

FP = "0123456789abcdef"
K = SessionKey("m", "s1", IdSource.HEADER)


def save(store: SnapshotStore, data: bytes, key: SessionKey = K) -> Snapshot:
    temp = store.temp_name(key, FP)
    (store.slot_dir / temp).write_bytes(data)
    return store.commit(key, temp, FP, 10)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every whole-file hash the store takes, by path."""
    seen: list[Path] = []
    real = store_mod.file_checksum

    def counting(path: Path) -> str:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(store_mod, "file_checksum", counting)
    return seen


def _flip_in_place(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x01]), offset)
    finally:
        os.close(fd)


def test_a_file_hashed_at_commit_is_not_hashed_again_until_it_changes(store: SnapshotStore,
                                                                      hashed: list[Path]) -> None:
    store.hashes = HashMemo(fine=True)  # what the probe finds on Linux 6.13+ (ext4, xfs, btrfs, tmpfs)
    snap = save(store, os.urandom(64 * 1024))
    assert len(hashed) == 1  # the commit's
    for _ in range(3):
        assert store.checked_snapshot(K, FP) == snap
    assert len(hashed) == 1
    path = store.slot_dir / snap.filename
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same times, but the ctime moves: hashed again
    assert store.checked_snapshot(K, FP) == snap
    assert len(hashed) == 2


def test_pwrite_in_place_moves_the_identity(tmp_path: Path) -> None:
    """What the memo relies on: a same-size write through an open descriptor, right after the identity was read,
    gives the file another mtime and ctime; where the file system cannot promise that, the memo does not trust an
    identity read that close to the file's last change."""
    path = tmp_path / "file"
    path.write_bytes(os.urandom(4096))
    _, before = read_identity(path)
    _flip_in_place(path, 100)
    _, after = read_identity(path)
    assert (after.ino, after.size) == (before.ino, before.size)
    if fine_timestamps(tmp_path):
        assert after.ctime_ns != before.ctime_ns and after.mtime_ns != before.mtime_ns
        assert not after.same_file_state(before)
    else:
        assert not before.settled()


@pytest.mark.parametrize("put_mtime_back", [False, True], ids=["pwrite", "pwrite-then-utime"])
def test_a_file_changed_after_it_was_hashed_is_still_refused(store: SnapshotStore, slot_dir: Path,
                                                             put_mtime_back: bool) -> None:
    snap = save(store, os.urandom(64 * 1024))
    assert store.checked_snapshot(K, FP) == snap  # hashed at commit, and checked once since
    path = slot_dir / snap.filename
    st = path.stat()
    _flip_in_place(path, 1234)  # same size, same inode
    if put_mtime_back:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # ctime cannot be put back
    assert path.stat().st_size == st.st_size and path.stat().st_ino == st.st_ino
    assert store.checked_snapshot(K, FP) is None
    assert store.get(K) is None
    assert [n for n in os.listdir(slot_dir / QUARANTINE_DIR) if n.startswith(snap.filename)]


def test_a_file_replaced_by_a_copy_of_itself_is_hashed_again(store: SnapshotStore, slot_dir: Path,
                                                             hashed: list[Path]) -> None:
    snap = save(store, os.urandom(8192))
    path = slot_dir / snap.filename
    copy = slot_dir / "copy"
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)  # another inode under the name
    before = len(hashed)
    assert store.checked_snapshot(K, FP) == snap
    assert len(hashed) == before + 1


def test_coarse_timestamps_trust_only_a_settled_identity() -> None:
    """Without fine-grained timestamps, a change in the same clock tick as the reading keeps the ctime: an identity
    read within a tick of its ctime is never trusted, an older one is."""
    memo = HashMemo(fine=False)
    now = 1_700_000_000_123_456_789
    fresh = FileIdentity(1, 10, now - 1_000_000, now - 1_000_000, now)  # ctime 1 ms before the reading
    memo.remember("f", fresh, "sum")
    assert memo.checksum("f", fresh) is None
    old = FileIdentity(1, 10, now - 50_000_000, now - 50_000_000, now)
    memo.remember("f", old, "sum")
    assert memo.checksum("f", FileIdentity(1, 10, old.mtime_ns, old.ctime_ns, now + 5)) == "sum"
    assert memo.checksum("f", FileIdentity(1, 10, old.mtime_ns, old.ctime_ns + 1, now + 5)) is None
    # A file system that keeps whole seconds: two of them.
    second = 1_700_000_000_000_000_000
    memo.remember("g", FileIdentity(2, 10, second, second, second + 1_500_000_000), "sum")
    assert memo.checksum("g", FileIdentity(2, 10, second, second, second + 1_500_000_000)) is None
    memo.remember("g", FileIdentity(2, 10, second, second, second + 2_000_000_000), "sum")
    assert memo.checksum("g", FileIdentity(2, 10, second, second, second + 3_000_000_000)) == "sum"
    # With fine timestamps the same fresh identity is trusted.
    fine = HashMemo(fine=True)
    fine.remember("f", fresh, "sum")
    assert fine.checksum("f", fresh) == "sum"


def test_the_memo_is_bounded_and_forgets_removed_snapshots(store: SnapshotStore) -> None:
    memo = HashMemo(fine=True, limit=2)
    ident = FileIdentity(1, 1, 1, 1, 1)
    for name in ("a", "b", "c"):
        memo.remember(name, ident, name)
    assert len(memo) == 2 and memo.checksum("a", ident) is None and memo.checksum("c", ident) == "c"

    first = save(store, os.urandom(1000))
    assert len(store.hashes) == 1
    second = save(store, os.urandom(1000))  # replaces the first snapshot and its file
    assert len(store.hashes) == 1 and second.filename != first.filename
    store.delete(K)
    assert len(store.hashes) == 0


def test_the_timestamp_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    assert isinstance(fine_timestamps(tmp_path), bool)
    assert list(tmp_path.iterdir()) == []
    assert fine_timestamps(tmp_path / "missing") is False
