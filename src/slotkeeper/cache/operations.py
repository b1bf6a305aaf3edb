"""What is done to a backend's slots outside the turns: an operator's clear, the saves at shutdown and before a
session moves to another backend, and a snapshot brought in from elsewhere (an import, a move, the shared store).

Each takes its slot through the pool's queue, as a turn does (`SlotPool.take`): it waits for a running turn, and a
request that queued before it goes first. Nothing here keeps state of its own: the slots are the pool's, the
snapshots the snapshots' (snapshots.py), so these are functions of the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NamedTuple

from slotkeeper.cache.chain import Link
from slotkeeper.cache.pool import SlotPool, empty_slot
from slotkeeper.cache.slots import Held
from slotkeeper.errors import NotFound, SaveFailed
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.version import Version


class Flushed(NamedTuple):
    """What a flush did: the changed slots it saved, and those whose save failed (logged as each one failed)."""

    saved: int
    failed: int


async def flush(pool: SlotPool) -> Flushed:
    """Save every changed slot (waiting for running turns), and wait until every save started so far is committed;
    returns how many of those slots were saved, and how many failed. Used at shutdown."""
    commits: list[asyncio.Task[bool]] = []
    failed = 0
    for slot in pool.slots:
        await pool.take(slot)
        try:
            if slot.occupant is not None:
                await pool.snapshots.settle(slot.occupant, slot.kind)  # an idle save's commit: failed, it is made again
            if slot.dirty and slot.occupant is not None:
                slot.dirty = False
                # Not waited for here: the next slot's save overlaps this one's commit.
                commit = await pool.saver.start(slot.slot_id, slot.occupant, Held.of(slot))
                if commit is None:
                    failed += 1
                else:
                    commits.append(commit)
        finally:
            pool.give_back(slot)
    await pool.snapshots.settle()
    saved = sum(1 for c in commits if c.done() and not c.cancelled() and c.exception() is None and c.result())
    return Flushed(saved, failed + len(commits) - saved)


async def save_session(pool: SlotPool, key: SessionKey) -> bool:
    """Save `key`'s state if a slot holds it changed (waiting for its running turn), and wait for the commit: before
    the session moves to another backend of its model. True when its newest state is on disk."""
    slot = next((s for s in pool.slots if s.occupant == key), None)
    if slot is None:
        return await pool.snapshots.settle(key)
    await pool.take(slot)
    try:
        if not (slot.dirty and slot.occupant == key):
            return await pool.snapshots.settle(key)
        slot.dirty = False
        commit = await pool.saver.start(slot.slot_id, key, Held.of(slot))
    finally:
        pool.give_back(slot)
    return commit is not None and await asyncio.shield(commit)


async def clear(pool: SlotPool) -> list[int]:
    """Save changed slots, then erase every slot, one after the other; returns the slot ids erased. A slot whose save
    fails is left as it is, the others are erased, and then SaveFailed says which."""
    erased, kept = [], []
    for slot in pool.slots:
        try:
            await clear_slot(pool, slot.slot_id)
        except SaveFailed:
            kept.append(slot.slot_id)
            continue
        erased.append(slot.slot_id)
    if kept:
        raise SaveFailed(f"slot(s) {_ids(kept)} were not erased: saving their changed state failed (see the log); "
                         f"erased: {_ids(erased) or 'none'}")
    return erased


async def clear_slot(pool: SlotPool, slot_id: int) -> SessionKey | None:
    """Wait for the slot to be free, save its occupant if changed, then erase it; no other slot is touched. Returns
    the session the slot held (None when it held none). When the save fails, the slot is not erased (it keeps its
    unsaved state) and SaveFailed is raised."""
    if not 0 <= slot_id < len(pool.slots):
        raise NotFound(f"no slot {slot_id}: the backend has {len(pool.slots)} slot(s), numbered from 0")
    slot = pool.slots[slot_id]
    await pool.take(slot)
    try:
        held = slot.occupant  # read after taking the slot: nothing else can change it now
        if held is not None:
            # An idle save that gave the slot back before its commit: wait for the commit (done when it answers,
            # commit included), and see whether it failed, which leaves the slot changed again (idlesaves.py).
            await pool.snapshots.settle(held, slot.kind)
        # An operator's action: done when it answers, commit included. 0 ms waited: the save failed.
        if slot.dirty and held is not None and not await pool.saver.save(slot.slot_id, held, Held.of(slot)):
            raise SaveFailed(f"saving slot {slot_id} ({held}) failed, so it was not erased: it keeps its "
                             "unsaved state (see the log for why)")
        await pool.client.slot_action(slot.slot_id, "erase")
        empty_slot(slot)
    finally:
        pool.free(slot)  # erased (it attributes nobody), or kept as it was, as SaveFailed says
    return held


async def import_snapshot(pool: SlotPool, key: SessionKey, temp: str, n_tokens: int, chain: Sequence[Link],
                          n_bytes: int, kind: SnapshotKind = SnapshotKind.SESSION, n_prompt: int = 0,
                          version: Version | None = None) -> Snapshot:
    """Make an uploaded file (`temp`, checked) `key`'s snapshot: a copy at `version` (refused with OlderVersion unless
    newer than the state here), or with None a new version, as a save made here. The slots stop attributing the
    session first, so that no older state of it in a slot is saved over the import, and the commit lands after the
    saves of it already started (snapshots.py)."""
    if kind is SnapshotKind.SESSION:
        pool.forget(key)
    pool.evidence.saving()  # the imported file is inspected as a saved one is: it may tell about the build
    return await pool.snapshots.transfers.commit_import(key, temp, n_tokens, chain, n_bytes, kind, n_prompt, version)


def _ids(slot_ids: Sequence[int]) -> str:
    return ", ".join(str(i) for i in slot_ids)
