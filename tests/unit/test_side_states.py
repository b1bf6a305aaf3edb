"""Side tasks keep their states for the next ones that start the same way (cache/sidestates.py, the pool's use of
it): against the fake backend client of test_pool and a real SnapshotStore."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from slotkeeper.cache.capability import ArchKind, Capability
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.sidestates import KEPT, SideStates, is_side_key
from slotkeeper.cache.slots import TurnEnd
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.types import CacheOutcome, IdSource, SessionKey
from tests.unit.test_pool import FP, FakeClient

CHAT = SessionKey("m", "chat", IdSource.HEADER)
TEMPLATE = "### Task:\nSuggest 3-5 relevant follow-up questions.\n### Chat History:\n<chat_history>\n"
HISTORY = "USER: " + "alpha bravo " * 100 + "\nASSISTANT: " + "delta echo " * 40


def test_the_state_sharing_the_longest_beginning_wins() -> None:
    states = SideStates()
    short, _ = states.keep("m", TEMPLATE + "USER: other chat", 100)
    long, _ = states.keep("m", TEMPLATE + HISTORY, 1000)
    match = states.best("m", TEMPLATE + HISTORY + "\nUSER: and then?")
    assert match is not None and match.key == long and match.tokens == 1000
    other = states.best("m", TEMPLATE + "USER: other chat, later")
    assert other is not None and other.key == short
    assert states.best("other-model", TEMPLATE + HISTORY) is None
    assert states.best("m", "nothing alike") is None
    assert is_side_key(long.session_id) and not is_side_key("side-chat") and not is_side_key("chat")


def test_only_the_last_few_are_kept() -> None:
    states = SideStates()
    keys = [states.keep("m", f"task {i} " + HISTORY, 500)[0] for i in range(KEPT)]
    states.used(keys[0])  # used again: the oldest is now the second one
    _, dropped = states.keep("m", "one more " + HISTORY, 500)
    assert dropped == [keys[1]]


@pytest.fixture
def client(slot_dir: Path) -> FakeClient:
    return FakeClient(slot_dir)


def pool(client: FakeClient, store: SnapshotStore, kind: str = "dense") -> SlotPool:
    return SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1,  # type: ignore[arg-type]
                    capability=Capability("x", ArchKind(kind), None))


async def side_task(p: SlotPool, text: str, n_prompt: int = 600):
    lease = await p.acquire(CHAT, side=True, side_text=text)
    lease.release(TurnEnd.COMPLETED, n_prompt + 5, n_prompt=n_prompt)
    return lease


async def test_a_follow_up_task_starts_from_the_last_ones_state(client: FakeClient, store: SnapshotStore) -> None:
    p = pool(client, store)
    first = await side_task(p, TEMPLATE + HISTORY)
    assert first.cache.outcome is CacheOutcome.COLD
    held = p.slots[0].occupant
    assert held is not None and is_side_key(held.session_id) and p.slots[0].dirty
    # The chat's turn takes the slot: the task's state is saved first, like a session's.
    chat = await p.acquire(CHAT)
    assert [c[2] for c in client.actions("save")][-1] is not None
    chat.release(TurnEnd.COMPLETED, 900, n_prompt=890)
    # The next follow-up quotes the same history and more: it starts from the first one's state.
    second = await side_task(p, TEMPLATE + HISTORY + "\nUSER: and then?")
    assert second.cache.outcome is CacheOutcome.PREFIX and second.cache.restored_from == held.session_id
    assert "earlier side task" in second.cache.detail
    # Nothing alike: nothing restored.
    restores = len(client.actions("restore"))
    await p.acquire(CHAT)  # the chat again (restored), released at once
    p.slots[0].busy = False
    third = await side_task(p, "### Task:\nGenerate a title.\n" + "zulu " * 200)
    assert third.cache.outcome is CacheOutcome.COLD and len(client.actions("restore")) == restores + 1


async def test_short_tasks_and_other_architectures_keep_nothing(client: FakeClient, store: SnapshotStore) -> None:
    p = pool(client, store)
    await side_task(p, "### Task:\nA tag.", n_prompt=40)
    assert p.slots[0].occupant is None and not p.slots[0].dirty
    for kind in ("recurrent", "swa"):
        q = pool(client, store, kind)
        await side_task(q, TEMPLATE + HISTORY)
        assert q.slots[0].occupant is None, kind  # such a state cannot be cut back to what the next task shares


async def test_side_states_past_the_last_few_are_deleted(client: FakeClient, store: SnapshotStore) -> None:
    p = SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1)  # type: ignore[arg-type]
    for i in range(KEPT + 2):
        await side_task(p, f"### Task {i}:\n" + HISTORY)
        other = await p.acquire(CHAT)  # saves the task's state
        other.release(TurnEnd.COMPLETED, 10, n_prompt=10)
    await p.settle()
    await asyncio.sleep(0.05)  # the deletions run in the background
    await p.settle()
    kept = [s for s in store.list() if is_side_key(s.session_id)]
    assert len(kept) == KEPT
    # A restart without the side states file (an older run's, or a lost one): they are of no use, and go.
    assert await pool(client, store).load_side_states() == 0
    await asyncio.sleep(0.05)
    assert [s for s in store.list() if is_side_key(s.session_id)] == []


async def _fill(p: SlotPool, n: int) -> None:
    for i in range(n):
        await side_task(p, f"### Task {i}:\n" + HISTORY)
        other = await p.acquire(CHAT)  # saves the task's state
        other.release(TurnEnd.COMPLETED, 10, n_prompt=10)
    await p.settle()


def persisted(client: FakeClient, store: SnapshotStore, path: Path) -> SlotPool:
    return SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1,  # type: ignore[arg-type]
                    capability=Capability("x", ArchKind.DENSE, None), side_states=SideStates(path=path))


async def test_side_states_come_back_after_a_restart(client: FakeClient, store: SnapshotStore,
                                                     tmp_path: Path) -> None:
    path = tmp_path / "side-states.json"
    first = persisted(client, store, path)
    await _fill(first, 2)
    assert len(json.loads(path.read_text())["states"]) == 2
    # The next run: both are back, and a follow-up of the first task starts from its state.
    again = persisted(client, store, path)
    assert await again.load_side_states() == 2
    follow_up = await side_task(again, "### Task 0:\n" + HISTORY + "\nUSER: and then?")
    assert follow_up.cache.outcome is CacheOutcome.PREFIX
    assert follow_up.cache.restored_from is not None and is_side_key(follow_up.cache.restored_from)


async def test_a_listed_state_without_its_snapshot_is_forgotten_and_an_unlisted_one_deleted(
        client: FakeClient, store: SnapshotStore, tmp_path: Path) -> None:
    path = tmp_path / "side-states.json"
    first = persisted(client, store, path)
    await _fill(first, 2)
    listed = json.loads(path.read_text())["states"]
    gone = SessionKey("m", listed[0]["session_id"])
    store.delete(gone)  # its snapshot went (the budget, an operator)
    # A side snapshot the file does not list (the file was written before it, then the process was killed).
    path.write_text(json.dumps({"format": 1, "states": listed[:1]}))
    again = persisted(client, store, path)
    assert await again.load_side_states() == 0
    await asyncio.sleep(0.05)
    await again.settle()
    assert [s for s in store.list() if is_side_key(s.session_id)] == []
    assert json.loads(path.read_text())["states"] == []


@pytest.mark.parametrize("damage", [b"{not json", b'{"format": 99, "states": []}', b"\xff\xfe",
                                    b'{"format": 1, "states": [{"model": "m"}]}'])
async def test_a_damaged_side_states_file_starts_without_them(client: FakeClient, store: SnapshotStore,
                                                            tmp_path: Path, damage: bytes) -> None:
    path = tmp_path / "side-states.json"
    await _fill(persisted(client, store, path), 1)
    path.write_bytes(damage)
    again = persisted(client, store, path)
    assert await again.load_side_states() == 0  # no failure: the states are deleted as stale
    await asyncio.sleep(0.05)
    assert [s for s in store.list() if is_side_key(s.session_id)] == []


async def test_an_entry_whose_key_does_not_match_its_text_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "side-states.json"
    states = SideStates(path=path)
    key, _ = states.keep("m", TEMPLATE + HISTORY, 900)
    raw = json.loads(path.read_text())
    raw["states"][0]["text"] = TEMPLATE + "something else"
    path.write_text(json.dumps(raw))
    assert SideStates(path=path).load() == set()
    assert SideStates(path=path.with_name("missing.json")).load() == set()
    path.write_text(json.dumps({"format": 1, "states": [{"model": "m", "session_id": key.session_id,
                                                          "text": TEMPLATE + HISTORY, "n_tokens": 900}]}))
    assert SideStates(path=path).load() == {key}


async def test_a_side_states_file_that_cannot_be_written_costs_nothing_else(tmp_path: Path) -> None:
    blocked = tmp_path / "dir-in-the-way"
    blocked.mkdir()
    states = SideStates(path=blocked)  # a directory where the file should go: os.replace fails
    states.keep("m", TEMPLATE + HISTORY, 900)
    assert states.best("m", TEMPLATE + HISTORY) is not None and blocked.is_dir()
