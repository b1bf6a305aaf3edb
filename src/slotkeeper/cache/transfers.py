"""Snapshots going in and out of a backend (import, export, the shared tier's uploads and downloads): an uploaded
file staged in the slot dir, checked, and committed as one of the snapshot's writes; a state opened for an export
(its whole file) or for an upload (a state kept as blocks as its tail and manifest, its blocks held meanwhile).

One of the snapshots' parts (snapshots.py): every method waits for the pending writes of the snapshot it touches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from slotkeeper.cache.blockstore import DamagedState
from slotkeeper.cache.blockstore import Manifest as BlockManifest
from slotkeeper.cache.chain import Link
from slotkeeper.cache.pending import PendingWrites, snapshot_id
from slotkeeper.cache.store import SnapshotStore, file_checksum
from slotkeeper.cache.tails import open_parts, release_parts
from slotkeeper.errors import OlderVersion
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.version import Version

log = logging.getLogger("slotkeeper.pool")


class Transfers:
    """One backend's snapshots brought in and handed out; the backend's fingerprint and the look at each file
    brought in (the pool learns from saved files) come with `attach`."""

    def __init__(self, store: SnapshotStore, writes: PendingWrites) -> None:
        self._store = store
        self._writes = writes
        self._fingerprint = ""
        self._inspect: Callable[[Snapshot], None] | None = None
        self.refused_older = 0  # copies brought in that were not newer than the state here: refused

    def attach(self, fingerprint: str, inspect: Callable[[Snapshot], None] | None) -> None:
        self._fingerprint, self._inspect = fingerprint, inspect

    # -- importing ----------------------------------------------------------------------------------------------

    async def stage_upload(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> tuple[str, Path]:
        """A temporary name (and its path) in the slot dir for an uploaded snapshot file of `key`."""
        temp = self._store.temp_name(key, self._fingerprint, kind)
        return temp, self._store.slot_dir / temp

    async def checksum(self, path: Path) -> str:
        return await asyncio.to_thread(file_checksum, path)

    async def discard_upload(self, temp: str) -> None:
        await asyncio.to_thread(self._store.discard_temp, temp)

    async def commit_import(self, key: SessionKey, temp: str, n_tokens: int, chain: Sequence[Link], n_bytes: int,
                            kind: SnapshotKind, n_prompt: int, version: Version | None) -> Snapshot:
        """Make an uploaded file (`temp`, checked) `key`'s snapshot, as one of the snapshot's writes: after the saves
        of it started before (none of them lands over it), before any started later. Raises what the commit raises
        (the temp file is then discarded); OlderVersion (counted) when the copy at `version` is not newer than the
        state here (None: a new version, as a save made here gets). The commit goes on if the caller stops waiting
        for it. `operations.import_snapshot` has the pool let go of the session in its slots first."""
        committed: asyncio.Future[Snapshot] = asyncio.get_running_loop().create_future()

        async def write() -> bool:
            try:
                snapshot = await asyncio.to_thread(self._store.commit, key, temp, self._fingerprint, n_tokens, chain,
                                                   n_bytes, kind, n_prompt, version)
            except Exception as exc:
                if isinstance(exc, OlderVersion):
                    self.refused_older += 1
                await asyncio.to_thread(self._store.discard_temp, temp)
                committed.set_exception(exc)
                return False
            except BaseException:
                committed.cancel()  # the write was cancelled: its caller must not wait forever
                raise
            if self._inspect is not None:  # an imported file tells about its build as a saved one does
                try:
                    await asyncio.to_thread(self._inspect, snapshot)
                except Exception as exc:
                    log.warning("inspecting the saved file of %s failed: %s", key, exc)
            committed.set_result(snapshot)
            return True

        self._writes.start(snapshot_id(key, kind), write, chain)
        return await asyncio.shield(committed)

    # -- exporting and uploading --------------------------------------------------------------------------------

    async def open_for_export(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION
                              ) -> tuple[Snapshot, list[Link], BinaryIO] | None:
        """`key`'s checked snapshot, its message chain and its file opened for reading, once the snapshot's pending
        writes are done; None when there is none. A commit or an eviction that removes the file between the look-up
        and the open is met by waiting and looking it up once more."""
        for _ in range(2):
            await self._writes.wait([snapshot_id(key, kind)])
            snapshot = await asyncio.to_thread(self._store.checked_snapshot, key, self._fingerprint, kind)
            if snapshot is None:
                return None
            try:
                handle = await asyncio.to_thread(self._store.open_whole, snapshot)
            except FileNotFoundError:
                continue
            except DamagedState as exc:
                await asyncio.to_thread(self._store.quarantine, snapshot, f"it cannot be assembled: {exc}")
                return None
            chain = await asyncio.to_thread(self._store.chain_of, snapshot)
            return snapshot, chain, handle
        return None

    async def open_for_upload(self, key: SessionKey, kind: SnapshotKind) -> Upload | None:
        """`open_for_export` for the shared tier: a state kept as blocks comes as its tail (open) and manifest, its
        blocks held until `finish_upload`; a state kept whole as its file."""
        await self._writes.wait([snapshot_id(key, kind)])
        snapshot = await asyncio.to_thread(self._store.checked_snapshot, key, self._fingerprint, kind)
        if snapshot is not None and snapshot.tail_bytes:
            try:
                handle, manifest = await asyncio.to_thread(open_parts, self._store.blocks, snapshot)
            except (DamagedState, FileNotFoundError):
                return None  # replaced or evicted meanwhile: a newer save is queued, or there is nothing to upload
            chain = await asyncio.to_thread(self._store.chain_of, snapshot)
            return Upload(snapshot, chain, handle, manifest)
        found = await self.open_for_export(key, kind)
        return None if found is None else Upload(*found, None)

    def finish_upload(self, upload: Upload) -> None:
        upload.handle.close()
        if upload.blocks is not None:
            release_parts(self._store.blocks, upload.blocks)


@dataclasses.dataclass(frozen=True)
class Upload:
    """A saved state opened for an upload: its file, or its tail with its blocks' manifest (`blocks`)."""

    snapshot: Snapshot
    chain: list[Link]
    handle: BinaryIO
    blocks: BlockManifest | None
