"""Snapshots: what the rest of slotkeeper may know and do about a backend's saved states (listing, reading, pinning,
deleting, exporting, staging an import). Every method waits for the pending writes of what it touches by itself, so
no caller has to remember to; the web layer reaches index rows and files only through here."""

from __future__ import annotations

import asyncio
import builtins
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO

from slotkeeper.cache.chain import Link
from slotkeeper.cache.persister import Persister, snapshot_id
from slotkeeper.cache.store import QUARANTINE_DIR, SnapshotStore, file_checksum
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind

# How long an operator's view (listings, counters, /metrics) waits for saves still being committed in the background
# so that it shows them; past this it shows what is indexed so far.
VIEW_WAIT_SECONDS = 5.0


class Snapshots:
    """One backend's snapshots, over its store and the persister that writes them (owned by the slot pool)."""

    def __init__(self, store: SnapshotStore, persister: Persister, fingerprint: str) -> None:
        self._store = store
        self._persist = persister
        self._fingerprint = fingerprint

    @property
    def slot_dir(self) -> Path:
        return self._store.slot_dir

    async def caught_up(self, timeout: float = VIEW_WAIT_SECONDS) -> bool:
        """Wait (bounded) for every write started so far, so that what is read next (counters included) shows them;
        True when none is left running."""
        return await self._persist.settle(None, timeout)

    async def list(self, model: str | None = None, kind: SnapshotKind | None = SnapshotKind.SESSION
                   ) -> list[Snapshot]:
        await self.caught_up()
        return await asyncio.to_thread(self._store.list, model, kind)

    async def get(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        await self._persist.settle([snapshot_id(key, kind)])
        return await asyncio.to_thread(self._store.get, key, kind)

    async def set_pinned(self, key: SessionKey, pinned: bool,
                         kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        await self._persist.settle([snapshot_id(key, kind)])
        return await asyncio.to_thread(self._store.set_pinned, key, pinned, kind)

    async def delete(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
        """Remove the snapshot's row and files, after a save of it still being committed (which would bring it
        back). The caller stops the slots saving the session first (SlotPool.forget)."""
        await self._persist.settle([snapshot_id(key, kind)])
        return await asyncio.to_thread(self._store.delete, key, kind)

    async def usage(self) -> dict[str, dict[str, int]]:
        await self.caught_up()
        return await asyncio.to_thread(self._store.usage)

    def usage_now(self) -> dict[str, dict[str, int]]:
        """`usage` without waiting, for the metrics collector's thread (the scrape waits with `caught_up` first)."""
        return self._store.usage()

    async def disk(self) -> dict[str, Any]:
        """The slot dir, its free bytes, and the RAM dir's copies (None without a RAM dir)."""
        free = await asyncio.to_thread(shutil.disk_usage, self._store.slot_dir)
        return {"slot_dir": str(self._store.slot_dir), "free_bytes": free.free, "ram": await self.ram()}

    async def ram(self) -> dict[str, Any] | None:
        ram = self._store.ram
        if ram is None:
            return None
        copies, copy_bytes = await asyncio.to_thread(self._store.ram_usage)
        return {"dir": str(ram.path), "copies": copies, "bytes": copy_bytes, "budget_bytes": ram.budget}

    def ram_bytes_now(self) -> int:
        """Bytes of the RAM dir's copies (0 without one), for the metrics collector's thread."""
        return self._store.ram_usage()[1]

    @property
    def ram_budget(self) -> int:
        """The RAM dir's budget for copies (0 without a RAM dir)."""
        return 0 if self._store.ram is None else self._store.ram.budget

    def quarantined_now(self) -> int:
        """Files in the quarantine directory, for the metrics collector's thread."""
        try:
            with os.scandir(self._store.slot_dir / QUARANTINE_DIR) as entries:
                return sum(1 for entry in entries if entry.is_file())
        except OSError:
            return 0

    async def open_for_export(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION
                              ) -> tuple[Snapshot, builtins.list[Link], BinaryIO] | None:
        """`key`'s checked snapshot, its message chain and its file opened for reading, once the snapshot's pending
        writes are done; None when there is none. A commit or an eviction that removes the file between the look-up
        and the open is met by waiting and looking it up once more."""
        for _ in range(2):
            await self._persist.settle([snapshot_id(key, kind)])
            snapshot = await asyncio.to_thread(self._store.checked_snapshot, key, self._fingerprint, kind)
            if snapshot is None:
                return None
            try:
                handle = await asyncio.to_thread(open, self._store.slot_dir / snapshot.filename, "rb")
            except FileNotFoundError:
                continue
            chain = await asyncio.to_thread(self._store.chain_of, snapshot)
            return snapshot, chain, handle
        return None

    async def stage_upload(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> tuple[str, Path]:
        """A temporary name (and its path) in the slot dir for an uploaded snapshot file of `key`."""
        temp = self._store.temp_name(key, self._fingerprint, kind)
        return temp, self._store.slot_dir / temp

    async def checksum(self, path: Path) -> str:
        return await asyncio.to_thread(file_checksum, path)

    async def discard_upload(self, temp: str) -> None:
        await asyncio.to_thread(self._store.discard_temp, temp)

