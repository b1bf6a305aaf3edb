"""SnapshotIndex on its own: rows in a SQLite file, with no slot files behind them."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from slotkeeper.cache.chain import Link
from slotkeeper.cache.index import SnapshotIndex
from slotkeeper.types import IdSource, SessionKey, Snapshot, SnapshotKind

FP = "0123456789abcdef"


@pytest.fixture
def index(tmp_path: Path) -> Iterator[SnapshotIndex]:
    i = SnapshotIndex(tmp_path / "index.db")
    yield i
    i.close()


def key(session: str = "s1", model: str = "m") -> SessionKey:
    return SessionKey(model, session, IdSource.HEADER)


def put(index: SnapshotIndex, k: SessionKey, filename: str, kind: SnapshotKind = SnapshotKind.SESSION,
        chain: tuple[Link, ...] = ()) -> tuple[Snapshot | None, Snapshot]:
    return index.replace(k, kind, filename, FP, 10, 100, "c" * 16, chain, n_prompt=8)


def test_replace_then_get(index: SnapshotIndex) -> None:
    previous, snap = put(index, key(), "a.bin", chain=(Link("d0", 5), Link("d1", 12)))
    assert previous is None
    assert (snap.model, snap.session_id, snap.filename, snap.n_tokens, snap.n_bytes, snap.n_prompt) == (
        "m", "s1", "a.bin", 10, 100, 8)
    assert snap.kind is SnapshotKind.SESSION and snap.pinned is False and snap.hits == 0
    assert index.get(key()) == snap
    assert index.get(key("other")) is None
    assert index.get(key(), SnapshotKind.SYSTEM) is None
    assert index.chain_of("a.bin") == [Link("d0", 5), Link("d1", 12)]
    # A second save of the key replaces its row and its chain; the file of the first is the caller's to remove.
    previous, again = put(index, key(), "b.bin", chain=(Link("e0", 7),))
    assert previous == snap and again.filename == "b.bin"
    assert index.chain_of("a.bin") == [] and index.chain_of("b.bin") == [Link("e0", 7)]
    assert index.filenames() == {"b.bin"}


def test_list_by_kind(index: SnapshotIndex) -> None:
    put(index, key("a"), "a.bin")
    put(index, key("p", "m2"), "p.bin", SnapshotKind.SYSTEM)
    index.mark_used(key("a"))  # most recently used first
    assert [s.filename for s in index.snapshots()] == ["a.bin"]
    assert [s.filename for s in index.snapshots(kind=SnapshotKind.SYSTEM)] == ["p.bin"]
    assert [s.filename for s in index.snapshots(kind=None)] == ["a.bin", "p.bin"]
    assert index.snapshots("m2", kind=None) == index.snapshots(kind=SnapshotKind.SYSTEM)
    assert index.snapshots("nobody", kind=None) == []
    assert index.usage() == {"session": {"count": 1, "bytes": 100, "pinned": 0},
                             "system": {"count": 1, "bytes": 100, "pinned": 0},
                             "side": {"count": 0, "bytes": 0, "pinned": 0}}


def test_delete_and_drop(index: SnapshotIndex) -> None:
    _, a = put(index, key("a"), "a.bin", chain=(Link("d0", 5),))
    put(index, key("b"), "b.bin")
    assert index.delete(key("a")) == a
    assert index.get(key("a")) is None and index.chain_of("a.bin") == []
    assert index.delete(key("a")) is None
    assert index.drop("b.bin") is True
    assert index.drop("b.bin") is False
    assert index.snapshots(kind=None) == [] and index.total_bytes() == 0


def test_an_old_index_gets_the_pinned_and_prompt_columns(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE snapshots (model TEXT NOT NULL, session_id TEXT NOT NULL,
        kind TEXT NOT NULL DEFAULT 'session', filename TEXT NOT NULL UNIQUE, fingerprint TEXT NOT NULL,
        n_tokens INTEGER NOT NULL, n_bytes INTEGER NOT NULL, checksum TEXT NOT NULL, created REAL NOT NULL,
        last_used REAL NOT NULL, hits INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (model, session_id, kind));
        INSERT INTO snapshots VALUES ('m', 's1', 'session', 'f.bin', 'fp', 42, 7, 'c', 1.0, 1.0, 3);""")
    db.commit()
    db.close()
    index = SnapshotIndex(path)
    try:
        columns = {row[1] for row in index.connection.execute("PRAGMA table_info(snapshots)")}
        assert {"pinned", "n_prompt"} <= columns
        old = index.get(key())
        assert old is not None and old.pinned is False and old.n_prompt == 0
        assert (old.filename, old.n_tokens, old.hits, old.owed_tokens) == ("f.bin", 42, 3, 42)
        pinned = index.set_pinned(key(), True)
        assert pinned is not None and pinned.pinned is True
    finally:
        index.close()
    SnapshotIndex(path).close()  # opening it again finds the columns there


def test_identity_cache_round_trip(index: SnapshotIndex) -> None:
    assert index.cached_identity("/m.gguf", 10, 5) is None
    index.remember_identity("/m.gguf", 10, 5, "file:abc")
    assert index.cached_identity("/m.gguf", 10, 5) == "file:abc"
    assert index.cached_identity("/m.gguf", 11, 5) is None
    assert index.cached_identity("/m.gguf", 10, 6) is None
    index.remember_identity("/m.gguf", 10, 5, "file:def")
    assert index.cached_identity("/m.gguf", 10, 5) == "file:def"
