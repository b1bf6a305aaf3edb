"""Message chains and the store's longest-prefix lookup."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slotkeeper.cache.chain import Link, common_messages, message_chain
from slotkeeper.cache.matching import PrefixMatch
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.types import IdSource, SessionKey

SYS = {"role": "system", "content": "rules"}
U1 = {"role": "user", "content": "hello"}
A1 = {"role": "assistant", "content": "hi"}
U2 = {"role": "user", "content": "more"}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(("a", "b", "expected"), [
    ([SYS, U1, A1, U2], [SYS, U1, A1, U2], 4),
    ([SYS, U1, A1, U2], [SYS, U1, A1], 3),
    ([SYS, U1, A1, U2], [SYS, U1, {"role": "assistant", "content": "edited"}, U2], 2),
    ([SYS, U1], [{"role": "system", "content": "other"}, U1], 0),
    ([SYS, U1], [], 0),
    ([{"role": "system", "content": "rules", "cache_control": {"type": "ephemeral"}}, U1], [SYS, U1], 2),
    ([{"content": "rules", "role": "system"}, U1], [SYS, U1], 2),  # key order does not matter
], ids=["same", "shorter", "edited-third", "other-system", "empty", "cache-control-ignored", "key-order"])
def test_common_messages(a: list[dict[str, str]], b: list[dict[str, str]], expected: int) -> None:
    assert common_messages(message_chain(a), message_chain(b)) == expected


def test_tools_are_part_of_every_link() -> None:
    assert common_messages(message_chain([SYS, U1], TOOLS), message_chain([SYS, U1])) == 0
    assert common_messages(message_chain([SYS, U1], TOOLS), message_chain([SYS, U1], TOOLS)) == 2


def test_chars_grow_and_digests_are_hex() -> None:
    chain = message_chain([SYS, U1, A1])
    assert [link.chars for link in chain] == sorted(link.chars for link in chain)
    assert all(len(link.digest) == 32 and int(link.digest, 16) >= 0 for link in chain)


def test_lone_surrogates_hash_instead_of_failing() -> None:
    assert len(message_chain([{"role": "user", "content": "bad \ud800 text"}])) == 1


@pytest.fixture
def store(tmp_path: Path):
    s = SnapshotStore(tmp_path / "slots", tmp_path / "index.db")
    yield s
    s.close()


def _save(store: SnapshotStore, session: str, messages: list[dict[str, str]], n_tokens: int, fp: str = "fp") -> None:
    key = SessionKey("m", session, IdSource.HEADER)
    temp = store.temp_name(key, fp)
    (store.slot_dir / temp).write_bytes(os.urandom(100))
    store.commit(key, temp, fp, n_tokens, message_chain(messages))


def test_best_prefix_picks_the_longest_shared_prefix(store: SnapshotStore) -> None:
    _save(store, "short", [SYS, U1], 100)
    _save(store, "long", [SYS, U1, A1, U2], 400)
    match = store.best_prefix("m", "fp", message_chain([SYS, U1, A1, {"role": "user", "content": "new"}]))
    assert match is not None and match.snapshot.session_id == "long" and match.messages == 3
    assert 0 < match.est_tokens < 400


def test_best_prefix_respects_model_and_fingerprint(store: SnapshotStore) -> None:
    _save(store, "a", [SYS, U1], 100, fp="other")
    assert store.best_prefix("m", "fp", message_chain([SYS, U1])) is None
    assert store.best_prefix("other-model", "other", message_chain([SYS, U1])) is None
    assert store.best_prefix("m", "other", message_chain([SYS, U1])) is not None


def test_best_prefix_skips_and_quarantines_a_damaged_file(store: SnapshotStore) -> None:
    _save(store, "good", [SYS], 50)
    _save(store, "bad", [SYS, U1], 100)
    bad = store.get(SessionKey("m", "bad"))
    assert bad is not None
    (store.slot_dir / bad.filename).write_bytes(b"truncated")
    match = store.best_prefix("m", "fp", message_chain([SYS, U1, A1]))
    assert match is not None and match.snapshot.session_id == "good"
    assert store.get(SessionKey("m", "bad")) is None


def test_chain_rows_follow_their_snapshot(store: SnapshotStore) -> None:
    _save(store, "a", [SYS, U1], 100)
    _save(store, "a", [SYS, U1, A1], 150)  # replaces the first save
    match = store.best_prefix("m", "fp", message_chain([SYS, U1, A1]))
    assert match is not None and match.messages == 3
    store.delete(SessionKey("m", "a"))
    assert store.best_prefix("m", "fp", message_chain([SYS, U1, A1])) is None


# -- the lookup's cost at scale ------------------------------------------------------------------------------------


def _conversation(system: str, n: int, tag: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, *({"role": "user", "content": f"{tag}-{j}"} for j in range(n))]


def _vm_steps(store: SnapshotStore, chain: list[Link], min_messages: int = 1) -> tuple[PrefixMatch | None, int]:
    """The lookup's result and how many SQLite VM instructions it ran (in hundreds): a measure of the rows it read
    that does not depend on the machine's speed."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    store._db.set_progress_handler(count, 100)
    try:
        return store.best_prefix("m", "fp", chain, min_messages), steps
    finally:
        store._db.set_progress_handler(None, 100)


@pytest.fixture
def fast_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of commits in a unit test: their fsyncs are not what is tested here."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def _store_with(tmp_path: Path, name: str, others: int, shared_system: bool) -> SnapshotStore:
    store = SnapshotStore(tmp_path / name / "slots", tmp_path / name / "index.db")
    store._db.execute("PRAGMA synchronous=OFF")
    for i in range(others):
        system = SYS["content"] if shared_system else f"prompt {i % 4}"
        _save(store, f"other-{i}", _conversation(system, 9, f"o{i}"), 100)
    _save(store, "target", [SYS, U1, A1, U2], 100)
    return store


@pytest.mark.usefixtures("fast_commits")
def test_best_prefix_reads_the_request_digests_rows_not_every_snapshot(tmp_path: Path) -> None:
    # It used to join every snapshot of the model with its chain rows: about 190 ms a lookup at 10,000 snapshots.
    chain = message_chain([SYS, U1, A1, U2, {"role": "assistant", "content": "next"}])
    steps = []
    for others in (20, 400):
        store = _store_with(tmp_path, f"unrelated-{others}", others, shared_system=False)
        match, n = _vm_steps(store, chain)
        assert match is not None and match.snapshot.session_id == "target" and match.messages == 4
        steps.append(n)
        store.close()
    assert steps[1] <= 2 * steps[0] + 5, steps


@pytest.mark.usefixtures("fast_commits")
def test_best_prefix_skips_the_shared_system_prompt_when_asked(tmp_path: Path) -> None:
    # A new chat on a system prompt that 400 conversations share: below `min_messages` nothing is read at all.
    new_chat = message_chain([SYS, {"role": "user", "content": "a new chat"}])
    steps = []
    for others in (20, 400):
        store = _store_with(tmp_path, f"shared-{others}", others, shared_system=True)
        match, n = _vm_steps(store, new_chat, min_messages=2)
        assert match is None
        assert store.best_prefix("m", "fp", new_chat) is not None  # without the floor, the system message matches
        steps.append(n)
        store.close()
    assert steps[1] <= 2 * steps[0] + 5, steps


def test_best_prefix_min_messages(store: SnapshotStore) -> None:
    _save(store, "short", [SYS, U1], 100)
    chain = message_chain([SYS, U1, {"role": "assistant", "content": "other"}])
    match = store.best_prefix("m", "fp", chain, min_messages=2)
    assert match is not None and match.snapshot.session_id == "short" and match.messages == 2
    assert store.best_prefix("m", "fp", chain, min_messages=3) is None


def test_best_prefix_falls_back_to_a_shorter_prefix_past_damaged_candidates(store: SnapshotStore) -> None:
    _save(store, "good", [SYS, U1], 100)
    for i in range(9):  # more damaged candidates at the deepest position than one lookup returns
        _save(store, f"bad-{i}", [SYS, U1, A1], 150)
        bad = store.get(SessionKey("m", f"bad-{i}"))
        assert bad is not None
        (store.slot_dir / bad.filename).write_bytes(b"x")
    match = store.best_prefix("m", "fp", message_chain([SYS, U1, A1, U2]))
    assert match is not None and match.snapshot.session_id == "good" and match.messages == 2
