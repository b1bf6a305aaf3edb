"""A saved state's version (version.py): the one rule for which of two copies is newer, and the index that
refuses to let an older copy replace a newer one."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotkeeper.cache.index import SnapshotIndex
from slotkeeper.errors import OlderVersion
from slotkeeper.types import IdSource, SessionKey, SnapshotKind
from slotkeeper.version import UNVERSIONED, Version, newer, next_version

KEY = SessionKey("m", "s", IdSource.HEADER)


def test_a_newer_lease_wins_whatever_the_clock_says() -> None:
    assert newer(Version(2, 1), Version(1, 10**15))
    assert not newer(Version(1, 10**15), Version(2, 1))
    assert newer(Version(1, 6), Version(1, 5)) and not newer(Version(1, 5), Version(1, 5))
    assert newer(UNVERSIONED, None) and newer(Version(0, 1), UNVERSIONED)


def test_the_next_version_is_newer_than_the_previous_one_in_every_case() -> None:
    assert next_version(None, None, now=2.0) == Version(0, 2_000_000)
    assert next_version(None, 4, now=2.0) == Version(4, 2_000_000)
    # A clock that went back, or two saves within a microsecond: the stamp still grows.
    assert next_version(Version(0, 5_000_000), None, now=1.0) == Version(0, 5_000_001)
    # The lease is not known now (the directory is down): the version keeps the token it had.
    assert next_version(Version(7, 5), None, now=1.0) == Version(7, 1_000_000)
    assert next_version(Version(7, 5_000_000), 3, now=1.0) == Version(7, 5_000_001)
    # A newer lease: its token, the clock's stamp.
    assert next_version(Version(7, 9_000_000), 8, now=1.0) == Version(8, 1_000_000)
    for previous in (Version(0, 0), Version(3, 10**16), Version(9, 1)):
        for fence in (None, 0, 2, 9, 12):
            assert newer(next_version(previous, fence, now=0.5), previous)


@pytest.mark.parametrize("data", [None, [1], [1, 2, 3], ["1", 2], [True, 2], [-1, 2], [2**63, 0], {"fence": 1}])
def test_a_malformed_version_reads_as_the_oldest(data: object) -> None:
    assert Version.from_json(data) == UNVERSIONED
    assert Version.from_json(Version(3, 4).to_json()) == Version(3, 4)


def test_the_index_gives_saves_growing_versions_and_refuses_an_older_copy(tmp_path: Path) -> None:
    index = SnapshotIndex(tmp_path / "index.db")
    try:
        _, first = index.replace(KEY, SnapshotKind.SESSION, "a.bin", "fp", 10, 100, "c1", fence=3)
        _, second = index.replace(KEY, SnapshotKind.SESSION, "b.bin", "fp", 20, 100, "c2")
        assert first.version.fence == 3 and second.version.fence == 3 and newer(second.version, first.version)
        # A copy from elsewhere, at the version this one replaced (a late upload, a stale backend): refused.
        with pytest.raises(OlderVersion):
            index.replace(KEY, SnapshotKind.SESSION, "old.bin", "fp", 10, 100, "c1", version=first.version)
        with pytest.raises(OlderVersion):
            index.replace(KEY, SnapshotKind.SESSION, "same.bin", "fp", 20, 100, "c2", version=second.version)
        row = index.get(KEY)
        assert row is not None and (row.filename, row.version) == ("b.bin", second.version)
        # A newer copy (saved under a newer lease elsewhere) replaces it, and keeps its version.
        _, taken = index.replace(KEY, SnapshotKind.SESSION, "new.bin", "fp", 30, 100, "c3", version=Version(4, 1))
        assert taken.version == Version(4, 1)
        # The next save here is newer than that copy, though this host's lease token is older.
        _, after = index.replace(KEY, SnapshotKind.SESSION, "c.bin", "fp", 40, 100, "c4", fence=3)
        assert after.version.fence == 4 and newer(after.version, taken.version)
    finally:
        index.close()


def test_an_index_from_before_versions_reads_its_rows_as_unversioned(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "index.db"
    index = SnapshotIndex(path)
    index.replace(KEY, SnapshotKind.SESSION, "a.bin", "fp", 10, 100, "c1")
    index.close()
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE snapshots DROP COLUMN fence")
    db.execute("ALTER TABLE snapshots DROP COLUMN stamp")
    db.commit()
    db.close()
    index = SnapshotIndex(path)
    try:
        row = index.get(KEY)
        assert row is not None and row.version == UNVERSIONED
        _, saved = index.replace(KEY, SnapshotKind.SESSION, "b.bin", "fp", 10, 100, "c2")
        assert newer(saved.version, UNVERSIONED)
    finally:
        index.close()
