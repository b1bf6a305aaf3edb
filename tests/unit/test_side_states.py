"""Side tasks keep their states for the next ones that start the same way: saved states of the side kind, found like
every other state by the tokens they share with a request (cache/sidestates.py, the pool, the planner). Against the
fake backend client of test_pool, which writes slot files with the tokens the test says the slot holds, and a real
SnapshotStore."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from slotkeeper.cache.budget import DiskBudget
from slotkeeper.cache.capability import ArchKind, Capability
from slotkeeper.cache.chain import message_chain
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.sidestates import KEPT, is_side_key, side_key
from slotkeeper.cache.slots import TurnEnd
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.cache.tokens import as_tokens
from slotkeeper.types import CacheOutcome, IdSource, SessionKey, SnapshotKind
from tests.unit.test_pool import FP, FakeClient

CHAT = SessionKey("m", "chat", IdSource.HEADER)
TEMPLATE = list(range(1000, 1040))  # the tasks' template: 40 tokens
HISTORY = [2000 + i % 97 for i in range(600)]  # the chat's history a follow-up task quotes


@pytest.fixture
def client(slot_dir: Path) -> FakeClient:
    return FakeClient(slot_dir)


def pool(client: FakeClient, store: SnapshotStore, kind: str = "dense", budget: DiskBudget | None = None) -> SlotPool:
    return SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1,  # type: ignore[arg-type]
                    capability=Capability("x", ArchKind(kind), None), budget=budget)


async def side_task(p: SlotPool, client: FakeClient, tokens: list[int], text: str = "task"):
    """A side task of one user message whose prompt is `tokens`; afterwards the backend's slot holds them."""
    # About four characters a token, as a real task's text has.
    chain = message_chain([{"role": "user", "content": f"{text} {len(tokens)} {tokens[-1]} " + "abcd" * len(tokens)}])

    async def exact():
        return as_tokens(tokens)

    lease = await p.acquire(CHAT, chain, side=True, tokens=exact)
    client.slot_tokens[lease.slot_id] = tokens
    lease.release(TurnEnd.COMPLETED, len(tokens) + 5, n_prompt=len(tokens))
    return lease


async def chat_turn(p: SlotPool, client: FakeClient, n: int = 10) -> None:
    lease = await p.acquire(CHAT)  # takes the slot: the task's state is saved first, like a conversation's
    client.slot_tokens[lease.slot_id] = list(range(5, 5 + n))
    lease.release(TurnEnd.COMPLETED, n, n_prompt=n)


async def test_a_follow_up_task_starts_from_the_last_ones_state(client: FakeClient, store: SnapshotStore) -> None:
    p = pool(client, store)
    first = await side_task(p, client, TEMPLATE + HISTORY)
    assert first.cache.outcome is CacheOutcome.COLD
    held = p.slots[0].occupant
    assert held is not None and is_side_key(held.session_id) and p.slots[0].kind is SnapshotKind.SIDE
    assert p.slots[0].dirty
    await chat_turn(p, client)
    await p.snapshots.settle()
    saved = store.get(held, SnapshotKind.SIDE)
    assert saved is not None and saved.n_tokens == len(TEMPLATE + HISTORY)
    # The next follow-up quotes the same history and more: it starts from the first one's state, found by tokens.
    second = await side_task(p, client, TEMPLATE + HISTORY + [7, 8, 9] * 20, "next")
    assert second.cache.outcome is CacheOutcome.PREFIX and second.cache.restored_from == held.session_id
    assert f"sharing {len(TEMPLATE + HISTORY)} tokens" in second.cache.detail
    # Nothing alike but the template (40 tokens, under a block): nothing restored.
    await chat_turn(p, client)
    restores = len(client.actions("restore"))
    third = await side_task(p, client, TEMPLATE + [9000 + i for i in range(300)], "title")
    assert third.cache.outcome is CacheOutcome.COLD and len(client.actions("restore")) == restores


async def test_short_tasks_and_other_architectures_keep_nothing(client: FakeClient, store: SnapshotStore) -> None:
    p = pool(client, store)
    await side_task(p, client, TEMPLATE[:30])
    assert p.slots[0].occupant is None and not p.slots[0].dirty
    for kind in ("recurrent", "swa"):
        q = pool(client, store, kind)
        await side_task(q, client, TEMPLATE + HISTORY)
        assert q.slots[0].occupant is None, kind  # such a state cannot be cut back to what the next task shares


async def test_side_states_past_the_last_few_are_evicted(client: FakeClient, store: SnapshotStore) -> None:
    p = pool(client, store, budget=DiskBudget(max_side_states=KEPT))
    for i in range(KEPT + 2):
        await side_task(p, client, [i, *HISTORY], f"task {i}")
        await chat_turn(p, client)
    await p.snapshots.settle()
    kept = store.list(kind=SnapshotKind.SIDE)
    assert len(kept) == KEPT and all(is_side_key(s.session_id) for s in kept)


async def test_side_states_are_found_after_a_restart(client: FakeClient, store: SnapshotStore) -> None:
    first = pool(client, store)
    await side_task(first, client, TEMPLATE + HISTORY)
    await chat_turn(first, client)
    await first.snapshots.settle()
    # The next run knows them from the index alone (nothing else is kept).
    again = pool(client, store)
    follow_up = await side_task(again, client, TEMPLATE + HISTORY + [1, 2, 3] * 30, "next")
    assert follow_up.cache.outcome is CacheOutcome.PREFIX
    assert follow_up.cache.restored_from is not None and is_side_key(follow_up.cache.restored_from)


def test_side_rows_of_an_earlier_version_become_the_side_kind(tmp_path: Path, slot_dir: Path) -> None:
    index = tmp_path / "old" / "index.db"
    first = SnapshotStore(slot_dir, index)
    first.close()
    with sqlite3.connect(index) as db:  # what an earlier version wrote: a conversation's row under a side id
        db.execute("INSERT INTO snapshots (model, session_id, kind, filename, fingerprint, n_tokens, n_bytes,"
                   " checksum, created, last_used) VALUES ('m', '~side-0123456789abcdef', 'session', 'x.bin', 'f',"
                   " 10, 10, 'c', 0, 0)")
    again = SnapshotStore(slot_dir, index)
    try:
        assert [s.kind for s in again.list(kind=None)] == [SnapshotKind.SIDE]
    finally:
        again.close()


def test_side_keys_are_ours() -> None:
    chain = message_chain([{"role": "user", "content": "### Task: a title"}])
    owner = SessionKey("m", "chat", IdSource.HEADER)
    key = side_key(owner, chain)
    assert is_side_key(key.session_id) and key == side_key(owner, chain)
    assert not is_side_key("side-chat") and not is_side_key("chat")
    # A side state is of its task's cache domain: the same task of another user names another state.
    theirs = side_key(SessionKey("m", "chat", IdSource.HEADER, "bob"), chain)
    assert theirs.session_id == key.session_id and theirs != key and theirs.domain == "bob"
