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
        chain: tuple[Link, ...] = (), keep_branches: bool = False) -> tuple[list[Snapshot], Snapshot]:
    return index.replace(k, kind, filename, FP, 10, 100, "c" * 16, chain, n_prompt=8, keep_branches=keep_branches)


def _links(*digests: str) -> tuple[Link, ...]:
    return tuple(Link(d, 5 * (i + 1)) for i, d in enumerate(digests))


def test_a_derived_name_keeps_the_state_another_conversation_left_as_a_branch(index: SnapshotIndex) -> None:
    """Confirmed at 99614b5 (#38): two chats that opened alike had one name, and each save replaced the other's
    state. Under a name slotkeeper derived, a save whose messages do not begin with the row's keeps that row as a
    branch (found by its tokens like any state); a save that extends a branch replaces it."""
    chat = SessionKey("m", "chat-0123456789abcdef", IdSource.MESSAGES)
    _, first = put(index, chat, "one-0000aaaa.bin", chain=_links("hi", "r1", "q2"), keep_branches=True)
    replaced, second = put(index, chat, "two-0000bbbb.bin", chain=_links("hi", "r1", "q2b"), keep_branches=True)
    assert replaced == [] and index.get(chat) == second
    branch = index.get(SessionKey("m", "chat-0123456789abcdef~0000aaaa"))
    assert branch is not None and branch.filename == first.filename and index.chain_of(first.filename)
    assert index.filenames() == {"one-0000aaaa.bin", "two-0000bbbb.bin"}
    # Chat one goes on: its new state begins with its branch's messages, which goes; chat two's becomes a branch.
    replaced, third = put(index, chat, "one-0000cccc.bin", chain=_links("hi", "r1", "q2", "r2", "q3"),
                          keep_branches=True)
    assert [r.filename for r in replaced] == ["one-0000aaaa.bin"]
    assert index.get(SessionKey("m", "chat-0123456789abcdef~0000bbbb")) is not None
    assert index.filenames() == {"two-0000bbbb.bin", "one-0000cccc.bin"} and index.chain_of("one-0000aaaa.bin") == []
    # A save that extends the row under the name replaces it, as any save does.
    replaced, _ = put(index, chat, "one-0000dddd.bin", chain=_links("hi", "r1", "q2", "r2", "q3", "r3", "q4"),
                      keep_branches=True)
    assert replaced == [third] and index.filenames() == {"two-0000bbbb.bin", "one-0000dddd.bin"}
    # An id the client chose names one conversation: its save replaces the row whatever its messages.
    mine = SessionKey("m", "mine", IdSource.HEADER)
    _, kept = put(index, mine, "m1-0000eeee.bin", chain=_links("hi", "a"))
    replaced, _ = put(index, mine, "m2-0000ffff.bin", chain=_links("hi", "b"))
    assert replaced == [kept]


def test_replace_then_get(index: SnapshotIndex) -> None:
    replaced, snap = put(index, key(), "a.bin", chain=(Link("d0", 5), Link("d1", 12)))
    assert replaced == []
    assert (snap.model, snap.session_id, snap.filename, snap.n_tokens, snap.n_bytes, snap.n_prompt) == (
        "m", "s1", "a.bin", 10, 100, 8)
    assert snap.kind is SnapshotKind.SESSION and snap.pinned is False and snap.hits == 0
    assert index.get(key()) == snap
    assert index.get(key("other")) is None
    assert index.get(key(), SnapshotKind.SYSTEM) is None
    assert index.chain_of("a.bin") == [Link("d0", 5), Link("d1", 12)]
    # A second save of the key replaces its row and its chain; the file of the first is the caller's to remove.
    replaced, again = put(index, key(), "b.bin", chain=(Link("e0", 7),))
    assert replaced == [snap] and again.filename == "b.bin"
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
