"""Background commits against a real llama-server: the pool and store run in this process (so a commit can be held
or made to fail on purpose), the backend writes and restores real slot files.

Checked: a session that comes back while its save is still being committed waits and gets the new state; a commit
that fails (disk full) keeps the previous snapshot, which the backend then restores; shutdown's flush waits for the
commits still running. And through slotkeeper itself: a file changed in place after it was hashed is refused.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.cache import store as store_mod
from slotkeeper.cache.blockstore import TAIL_SUFFIX, BlockStore
from slotkeeper.cache.operations import flush
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import SnapshotStore, file_checksum
from slotkeeper.serving.backend import discover
from slotkeeper.serving.service import TurnRecord, TurnService
from slotkeeper.types import CacheOutcome, IdSource, SessionKey
from slotkeeper.upstream.client import UpstreamClient
from tests.conftest import Stack
from tests.support import ANSWER_SLACK, Backend, Conversation, timings, words

pytestmark = pytest.mark.backend

A = SessionKey("tiny", "a", IdSource.HEADER)
B = SessionKey("tiny", "b", IdSource.HEADER)


@dataclass
class Rig:
    backend: Backend
    store: SnapshotStore
    pool: SlotPool
    service: TurnService
    history: dict[SessionKey, list[dict[str, str]]]

    async def turn(self, key: SessionKey) -> TurnRecord:
        """One more turn of `key`'s conversation: its history plus a new user message."""
        messages = self.history.get(key)
        if messages is None:
            messages = self.history[key] = [{"role": "system", "content": f"Conversation {key.session_id}."},
                                            {"role": "user", "content": words(500, len(self.history))}]
        else:
            messages.append({"role": "user", "content": words(30, len(messages))})
        body = {"messages": list(messages), "max_tokens": 2, "temperature": 0}
        data, record = await self.service.unary("openai", key, "/v1/chat/completions",
                                                lambda slot: {**body, "id_slot": slot, "cache_prompt": True})
        messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
        return record


@pytest.fixture
async def rig(tmp_path: Path, tiny_model: Path) -> AsyncIterator[Rig]:
    backend = Backend("binary", tiny_model, tmp_path / "slots", tmp_path / "backend.log", cache_ram=0).start()
    store = SnapshotStore(backend.slot_dir, tmp_path / "cache" / "index.sqlite3")
    client = UpstreamClient(backend.url)
    try:
        info = await discover(client, Snapshots(store), "tiny")
        # No system snapshots: every commit here is a session's.
        pool = SlotPool(info.n_slots, client, Snapshots(store), info.fingerprint, info.n_ctx_slot, save_idle_seconds=-1,
                        system_snapshots=False)
        yield Rig(backend, store, pool, TurnService(client, pool), {})
        await pool.aclose()
    finally:
        await client.aclose()
        store.close()
        backend.stop()


class Gate:
    """Holds SnapshotStore.commit in its worker thread until opened."""

    def __init__(self, store: SnapshotStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.started = 0
        real = store.commit

        def held(*args: Any, **kwargs: Any) -> Any:
            self.started += 1
            assert self.opened.wait(30), "the test never opened the gate"
            return real(*args, **kwargs)

        monkeypatch.setattr(store, "commit", held)


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_a_session_back_before_its_commit_is_done_waits_and_gets_the_new_state(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(rig.store, monkeypatch)
    await rig.turn(A)
    await rig.turn(B)  # saves A's first state
    await rig.turn(A)  # restores it; A's conversation grows
    await rig.pool.snapshots.settle()
    old = rig.store.get(A)
    assert old is not None
    gate.opened.clear()
    b_turn = await asyncio.wait_for(rig.turn(B), 60)  # saves A's newer state: held, and B's turn runs anyway
    assert b_turn.lease.cache.outcome is CacheOutcome.RESTORED
    await _until(lambda: gate.started == 3)  # A, B, then this save of A
    held = rig.store.get(A)
    assert held is not None and held.filename == old.filename  # the new state is not indexed yet
    back = asyncio.create_task(rig.turn(A))
    await asyncio.sleep(0.3)
    assert not back.done()  # waiting for the commit, not restoring the old file
    gate.opened.set()
    record = await asyncio.wait_for(back, 60)
    new = rig.store.get(A)
    assert new is not None and new.filename != old.filename and new.n_tokens > old.n_tokens
    assert record.lease.cache.outcome is CacheOutcome.RESTORED
    assert record.lease.cache.restored_tokens == new.n_tokens
    assert (record.timings or {})["cache_n"] >= new.n_tokens - ANSWER_SLACK
    assert not (rig.backend.slot_dir / old.filename).exists()


async def test_a_commit_that_fails_keeps_the_previous_snapshot_and_the_turn_succeeds(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    await rig.turn(A)
    await rig.turn(B)
    await rig.turn(A)  # restores A's first state; A grows
    await rig.pool.snapshots.settle()
    good = rig.store.get(A)
    assert good is not None

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod.os, "fsync", disk_full)  # the commit's first step fails
    b_turn = await rig.turn(B)  # the switch saves A's newer state: the backend writes it, the commit fails
    assert b_turn.lease.cache.outcome is CacheOutcome.RESTORED
    await rig.pool.snapshots.settle()
    monkeypatch.undo()
    assert rig.pool.snapshots.failed_saves == 1
    kept = rig.store.get(A)
    assert kept is not None and (kept.filename, kept.checksum) == (good.filename, good.checksum)
    assert file_checksum(rig.backend.slot_dir / good.filename) == good.checksum
    assert not [p for p in rig.backend.slot_dir.iterdir() if ".tmp-" in p.name]
    record = await rig.turn(A)  # the previous state is restored into the real backend
    assert record.lease.cache.outcome is CacheOutcome.RESTORED
    assert record.lease.cache.restored_tokens == good.n_tokens
    assert (record.timings or {})["cache_n"] >= good.n_tokens - ANSWER_SLACK


async def test_shutdown_flush_waits_for_the_commits_still_running(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(rig.store, monkeypatch)
    await rig.turn(A)
    gate.opened.clear()
    await rig.turn(B)  # A's commit is held
    flushing = asyncio.create_task(flush(rig.pool))  # saves B, then waits for every commit
    await _until(lambda: gate.started == 2)
    await asyncio.sleep(0.2)
    assert not flushing.done()
    assert rig.store.get(A) is None and rig.store.get(B) is None
    gate.opened.set()
    assert await asyncio.wait_for(flushing, 30) == (1, 0)
    for key in (A, B):
        snap = rig.store.get(key)
        assert snap is not None and file_checksum(rig.backend.slot_dir / snap.filename) == snap.checksum
    assert rig.pool.snapshots.saves == 2 and rig.pool.snapshots.failed_saves == 0


@pytest.mark.parametrize("stored_as", ["file", "blocks"])
def test_a_file_changed_in_place_after_it_was_hashed_is_refused(stack: Stack, client_for, stored_as: str) -> None:
    """The slotkeeper process hashed the file when it committed it and again when it checked it for a restore;
    a byte changed in place afterwards (same size, same inode) still gets it refused. Kept as blocks: a byte changed
    in one of its blocks (every block is checked each time a file is assembled from it)."""
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend, "--block-tokens", "0" if stored_as == "file" else "64")
    client = client_for(keeper)
    victim = Conversation(client, "victim", size=500)
    other = Conversation(client, "other", size=500, seed=7)
    victim.turn()
    other.turn()  # saves the victim
    assert victim.turn().headers["x-slotkeeper-cache"] == "restored"  # checked (and hashed) before the restore
    other.turn()  # saves the victim's newer state
    row = keeper.row("victim")
    assert row is not None
    path = stack.slot_dir / row["filename"]
    blocks_damaged: list[str] = []
    if stored_as == "blocks":
        assert row["tail_bytes"] > 0 and not path.exists()
        last = BlockStore(stack.slot_dir, 64).manifest(row["filename"]).digests[-1]  # the victim's own
        blocks_damaged.append(last)
        changed = BlockStore(stack.slot_dir, 64).block_path(last)
        path = stack.slot_dir / (row["filename"] + TAIL_SUFFIX)  # what goes to quarantine
    else:
        changed = path
    size = changed.stat().st_size
    fd = os.open(changed, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, size // 2)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), size // 2)
    finally:
        os.close(fd)
    response = victim.turn()
    # Never the victim's own state: cold, or another conversation's restored for the system text it shares (when
    # that restore costs less than its prefill, measured: cache/costs.py).
    assert response.headers["x-slotkeeper-cache"] in ("cold", "prefix")
    assert timings(response)["cache_n"] < row["n_tokens"] // 2  # at most the system text another state shares
    assert backend.alive()
    assert keeper.row("victim") is None
    assert not path.exists()
    # The state's file (or tail) goes into the quarantine; kept as blocks, the damaged block too.
    quarantined = sorted(p.name.split(".")[0] for p in (stack.slot_dir / "quarantine").iterdir())
    assert quarantined == sorted([path.name.split(".")[0], *blocks_damaged])
    assert ("checksum mismatch" if stored_as == "file" else "does not match its name") in keeper.log_text()
