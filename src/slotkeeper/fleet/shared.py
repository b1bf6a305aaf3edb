"""The shared tier: snapshots in an S3-compatible object store that every host's slotkeeper reads, behind the local
slot dir (the hot tier: llama-server restores only from a local file).

Layout under the store's prefix:
- `blobs/<xxh3-128>`: a snapshot file kept whole, named by the checksum slotkeeper already takes. Written once; a
  system snapshot shared by many sessions, or a session saved unchanged, is stored once. A session's new version
  removes the file of the version it replaced, so the store holds one file per session.
- With the block store (`--block-tokens`, blockstore.py): `kv/<key>`, a KV block exactly as the slot dir keeps it
  (named by the chained hash of its tokens and the fingerprint, so every host's save of one prefix names the same
  object), and `tails/<xxh3-128>`, a state's tail. An upload puts only the blocks the store lacks; a download
  fetches only those this host lacks. A block goes when no manifest names it (the budget's sweep).
- `manifests/<fingerprint>/<kind>/<model>/<session>.json`: the newest version of one snapshot (the bundle's
  `snapshot.json` plus `version`, `saved_at`, `origin`). Replaced only by a conditional write on the ETag read, so
  two hosts that save one session at once cannot tear it: the loser reads again and writes only if it is newer.

Uploads run in the background after the local commit, the newest per snapshot (a save queued behind an upload in
flight replaces any older one queued). A download is checked (fingerprint, size, checksum) before it is imported
into the local index; a damaged one is refused and fetched once more, and an object damaged in the store is
removed so that its owner's next save writes it again. Every failure here is logged and costs a prefill, never a
request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotkeeper.cache.blockstore import DamagedState
from slotkeeper.cache.bundle import BundleMeta, meta_of
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.errors import BadRequest, OlderVersion, SlotkeeperError
from slotkeeper.files import file_checksum, unlink_quietly
from slotkeeper.fleet.objectstore import ObjectStore
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.version import UNVERSIONED, Version, newer

log = logging.getLogger("slotkeeper.shared")

# Attempts at a conditional manifest write that another host's write got ahead of.
MANIFEST_ATTEMPTS = 4
# A turn waits this long for a manifest look-up; after one fails, look-ups pause for the second figure (turns then
# start from what this host has without waiting for a store that is down).
LOOKUP_TIMEOUT_SECONDS = 3.0
UNREACHABLE_PAUSE_SECONDS = 30.0
# With a budget, the store is swept after an upload at most this often.
SWEEP_SECONDS = 300.0
STRAY_SECONDS = 600.0
_BLOCK_KEY = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Manifest:
    """The store's newest version of one saved state: what its bundle says (its `version` among it), when and by
    whom it was written."""

    meta: BundleMeta
    saved_at: float
    origin: str
    # Its file was found damaged in the store and removed: nobody downloads it, and only a newer version or the same
    # one uploaded again (by the host that has it intact) replaces it. A withdrawal is a conditional write, like
    # any other, so that it never takes away a version written after the damaged one was read.
    withdrawn: bool = False
    # The keys of its KV blocks when it is stored as blocks and a tail (`kv/`, `tails/`); empty: one whole file.
    kv: tuple[str, ...] = ()

    @property
    def version(self) -> Version:
        return self.meta.version

    def to_json(self) -> dict[str, Any]:
        return {**self.meta.to_json(), "saved_at": self.saved_at, "origin": self.origin, "withdrawn": self.withdrawn,
                "kv": list(self.kv)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        meta = BundleMeta.from_json(data)
        fence = data.get("fence")  # a manifest from before versions named its lease's token only
        if meta.version == UNVERSIONED and isinstance(fence, int) and not isinstance(fence, bool) and fence > 0:
            meta = dataclasses.replace(meta, version=Version(fence, 0))
        saved_at = data.get("saved_at")
        kv = data.get("kv") or []
        if not isinstance(kv, list) or not all(isinstance(k, str) and _BLOCK_KEY.fullmatch(k) for k in kv):
            raise BadRequest("the manifest's block keys are not 32 hex digits each")
        return cls(meta, float(saved_at) if isinstance(saved_at, (int, float)) else 0.0, str(data.get("origin") or ""),
                   data.get("withdrawn") is True, tuple(kv))

    @property
    def object_key(self) -> str:
        """The object holding the state's file (kept whole) or its tail (kept as blocks)."""
        return SharedTier.tail_key(self.meta.checksum) if self.kv else SharedTier.blob_key(self.meta.checksum)

    def replaced_by(self, version: Version) -> bool:
        """Whether a save at `version` may replace this manifest: it is newer, or it is this very version uploaded
        again after the store's copy was withdrawn."""
        return newer(version, self.version) or (self.withdrawn and version == self.version)


class SharedTier:
    """One backend's view of the shared tier: uploads its commits, brings in what it lacks."""

    def __init__(self, store: ObjectStore, snapshots: Snapshots, fingerprint: str, origin: str,
                 import_snapshot: Callable[..., Any], budget: int = 0) -> None:
        self._store = store
        self._snapshots = snapshots
        self._fingerprint = fingerprint
        self._origin = origin
        self._import = import_snapshot  # cache/operations.py import_snapshot, on this backend's pool
        # What is waiting for its upload (the newest committed version of each, when it runs).
        self._queued: dict[tuple[SessionKey, SnapshotKind], None] = {}
        self.refused_older = 0  # uploads refused: the store's manifest holds a newer version (version.py)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.uploads = 0
        self.failed_uploads = 0
        self.downloads = 0
        self.refused_downloads = 0
        self._unreachable_until = 0.0
        self.budget = budget  # bytes of snapshot files the store may hold (0: no limit)
        self.uploaded_bytes = 0  # bytes of files, tails and blocks put into the store
        self.downloaded_bytes = 0  # bytes of blocks fetched (files and tails are counted by their snapshots)
        self._swept = 0.0

    # -- keys -------------------------------------------------------------------------------------------------

    def manifest_key(self, key: SessionKey, kind: SnapshotKind) -> str:
        model = urllib.parse.quote(key.model, safe="")
        session = urllib.parse.quote(key.session_id, safe="")
        return f"manifests/{self._fingerprint}/{kind}/{model}/{session}.json"

    @staticmethod
    def blob_key(checksum: str) -> str:
        return f"blobs/{checksum}"

    @staticmethod
    def tail_key(checksum: str) -> str:
        return f"tails/{checksum}"

    @staticmethod
    def kv_key(key: str) -> str:
        return f"kv/{key}"

    # -- uploads ----------------------------------------------------------------------------------------------

    def committed(self, key: SessionKey, kind: SnapshotKind) -> None:
        """A save of `key` was committed locally: upload it (later, in the background)."""
        self._queued.pop((key, kind), None)  # the newest goes last in the queue
        self._queued[(key, kind)] = None
        self._idle.clear()
        self._wake.set()

    async def run(self) -> None:
        """The uploader: one upload at a time, oldest queued first."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queued:
                item = next(iter(self._queued))
                del self._queued[item]
                try:
                    await self._upload(*item)
                except Exception as exc:  # an upload must never end the uploader
                    self.failed_uploads += 1
                    log.warning("uploading the snapshot of %s to the shared store failed (%s); it stays local and "
                                "is uploaded with its next save", item[0], _message(exc))
            if self.budget > 0 and time.monotonic() - self._swept > SWEEP_SECONDS:
                self._swept = time.monotonic()
                try:
                    await asyncio.to_thread(self.enforce_budget)
                except Exception as exc:
                    log.warning("keeping the shared store within its budget failed (%s); it is tried again after "
                                "the next upload", _message(exc))
            self._idle.set()

    def enforce_budget(self) -> int:
        """Blocking: remove the least recently written snapshots (their manifest, then their file or tail, and the
        blocks no other manifest names) until the objects in the store fit the budget; objects no manifest names
        any more (a host stopped between two writes, blocks of replaced versions) go first. Returns how many
        snapshots were removed. Every host may sweep: removing twice is harmless."""
        listed = [*self._store.listing("blobs/"), *self._store.listing("tails/"), *self._store.listing("kv/")]
        objects = {key: size for key, size, _ in listed}
        written = {key: when for key, _, when in listed}
        manifests = sorted(self._store.listing("manifests/"), key=lambda m: m[2])
        names: dict[str, list[str]] = {}  # manifest -> the objects it names
        for key, _, _ in manifests:
            found = self._store.get_json(key)
            if found is None:
                continue
            try:
                manifest = Manifest.from_json(found[0])
            except SlotkeeperError:
                continue
            names[key] = [manifest.object_key, *(self.kv_key(k) for k in manifest.kv)]
        refs: Counter[str] = Counter(o for named in names.values() for o in set(named))
        removed = 0
        # An object written in the last minutes may be another host's upload whose manifest is not written yet.
        now = time.time()
        for stray in [o for o in objects if not refs[o] and now - written[o] > STRAY_SECONDS]:
            self._store.delete(stray)
            del objects[stray]
        total = sum(objects.values())
        for key, _, _ in manifests:
            if total <= self.budget:
                break
            self._store.delete(key)
            for named in set(names.get(key, ())):
                refs[named] -= 1
                if refs[named] <= 0 and named in objects:
                    self._store.delete(named)
                    total -= objects.pop(named)
            removed += 1
        if removed:
            log.info("the shared store's budget (%d bytes) removed %d snapshot(s), the least recently saved",
                     self.budget, removed)
        return removed

    async def drain(self, timeout: float) -> bool:
        """Wait (bounded) until every queued upload is done; True when none is left."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def _upload(self, key: SessionKey, kind: SnapshotKind) -> None:
        upload = await self._snapshots.transfers.open_for_upload(key, kind)
        if upload is None:
            return  # evicted or replaced meanwhile: a newer save is queued, or there is nothing to upload
        snapshot, chain = upload.snapshot, upload.chain
        try:
            kv: tuple[str, ...] = ()
            if upload.blocks is not None:
                kv = upload.blocks.keys
                await self._put_blocks(kv)
            blob = self.tail_key(snapshot.checksum) if kv else self.blob_key(snapshot.checksum)
            put = not await asyncio.to_thread(self._store.exists, blob)
            if put:
                size = snapshot.n_bytes if not kv else os.fstat(upload.handle.fileno()).st_size
                await asyncio.to_thread(self._store.put_file, blob, upload.handle, size)
                self.uploaded_bytes += size
        finally:
            await asyncio.to_thread(self._snapshots.transfers.finish_upload, upload)
        meta = meta_of(snapshot, chain)
        replaced: str | None = None  # the object of the version this upload replaced
        for _ in range(MANIFEST_ATTEMPTS):
            current = await asyncio.to_thread(self._store.get_json, self.manifest_key(key, kind))
            etag = None
            replaced = None
            if current is not None:
                existing, etag = current
                try:
                    older: Manifest | None = Manifest.from_json(existing)
                except SlotkeeperError:
                    older = None  # a manifest we cannot read is replaced
                if older is not None:
                    if older.meta.checksum == meta.checksum and older.kv == kv and not older.withdrawn:
                        break  # already there
                    if not older.replaced_by(meta.version):
                        await self._refuse_older(key, kind, meta.version, older, blob if put else None)
                        return
                    replaced = None if older.withdrawn else older.object_key
            manifest = Manifest(meta, time.time(), self._origin, kv=kv)
            if await asyncio.to_thread(self._store.put_json, self.manifest_key(key, kind), manifest.to_json(), etag):
                break
        else:
            raise SlotkeeperError(f"the manifest of {key} kept changing under {MANIFEST_ATTEMPTS} conditional writes")
        if replaced is not None and replaced != blob and kind is SnapshotKind.SESSION:
            # A session's file is its own (a system snapshot's may be shared): the older version it replaced goes (its
            # blocks, shared, go with the budget's sweep). A host downloading it this very moment gets none, and
            # prefills.
            await asyncio.to_thread(self._store.delete, replaced)
        self.uploads += 1
        log.info("uploaded the %s snapshot of %s to the shared store: %d tokens, %d bytes, version %s", kind, key,
                 snapshot.n_tokens, snapshot.n_bytes, meta.version)

    async def _refuse_older(self, key: SessionKey, kind: SnapshotKind, version: Version, newer_one: Manifest,
                            blob: str | None) -> None:
        """A save older than the store's manifest: the manifest stays, the file just put goes."""
        self.refused_older += 1
        if blob is not None and blob != newer_one.object_key:
            await asyncio.to_thread(self._store.delete, blob)
        log.warning("the %s snapshot of %s is not uploaded: its version %s is older than the shared store's %s "
                    "(from %s); the session went on elsewhere", kind, key, version, newer_one.version,
                    newer_one.origin or "another host")

    # -- downloads --------------------------------------------------------------------------------------------

    async def bring(self, key: SessionKey, kind: SnapshotKind) -> Snapshot | None:
        """Make the newest version of `key`'s snapshot local: from the store when its manifest's version is newer
        than this host's (after any commit of it still running here), or this host's is damaged (its check
        quarantines it) or missing. Returns the snapshot imported, or None when nothing was brought in."""
        if time.monotonic() < self._unreachable_until:
            return None
        name = self.manifest_key(key, kind)
        try:
            current = await asyncio.wait_for(asyncio.to_thread(self._store.get_json, name), LOOKUP_TIMEOUT_SECONDS)
        except Exception as exc:  # down, refusing, or slower than a turn should wait
            self._unreachable_until = time.monotonic() + UNREACHABLE_PAUSE_SECONDS
            log.warning("the shared store cannot be read (%s): %s starts from what this host has, and look-ups pause "
                        "for %.0f s", _message(exc) if not isinstance(exc, TimeoutError) else
                        f"no answer in {LOOKUP_TIMEOUT_SECONDS:g} s", key, UNREACHABLE_PAUSE_SECONDS)
            return None
        if current is None:
            return None
        try:
            manifest = Manifest.from_json(current[0])
        except SlotkeeperError as exc:
            log.warning("the shared manifest of %s is unreadable (%s): it is ignored", key, exc.message)
            return None
        meta = manifest.meta
        if meta.fingerprint != self._fingerprint or manifest.withdrawn:
            return None
        # What the snapshots are asked, in one go: a name for the download should one be needed (a name only:
        # nothing is written under it until then), and this host's own version, once its commits still running are
        # done.
        staged = await self._snapshots.transfers.stage_upload(key, kind)
        local = await self._snapshots.checked(key, kind)
        if local is not None and (local.checksum == meta.checksum or not newer(meta.version, local.version)):
            return None  # this host's is the store's, or newer than it
        return await self._download(key, kind, manifest, (name, current[1]), staged)

    async def _put_blocks(self, keys: tuple[str, ...]) -> None:
        """Upload the blocks the store lacks (each looked up: a block the store lost is put again)."""
        for block in dict.fromkeys(keys):
            if await asyncio.to_thread(self._store.exists, self.kv_key(block)):
                continue
            path = self._snapshots.block_file(block)
            with path.open("rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                await asyncio.to_thread(self._store.put_file, self.kv_key(block), fh, size)
            self.uploaded_bytes += size

    def _fetch_blocks(self, manifest: Manifest, path: Path, held: list[str]) -> tuple[int, str | None]:
        """Blocking: bring a state stored as blocks into the whole file `path`: its tail, and the blocks this host
        lacks (each checked, then adopted into the local block store, and held, with the keys put in `held`, until
        the caller's commit names them); returns (bytes, checksum) of the file, the checksum None when a piece in
        the store is damaged (a damaged block is removed from the store: its owner's next save puts it again)."""
        blocks = self._snapshots.blocks
        temps: list[Path] = []
        try:
            tail = blocks.temp_path("tail")
            temps.append(tail)
            self._store.get_file(manifest.object_key, tail)
            parts = blocks.manifest_at(tail)
            if parts.keys != manifest.kv or parts.checksum != manifest.meta.checksum:
                return 0, None
            blocks.hold(parts.keys)
            held.extend(parts.keys)
            other: dict[str, Path] = {}
            for block, digest in zip(parts.keys, parts.sums, strict=True):
                if block in other or blocks.has_block(block, digest):
                    continue
                source = blocks.temp_path("block")
                temps.append(source)
                self._store.get_file(self.kv_key(block), source)
                self.downloaded_bytes += source.stat().st_size
                if not blocks.adopt_block(block, digest, source):
                    other[block] = source  # this host holds that block with other float noise: read this one
            n_bytes, checksum = blocks.assemble_from(tail, path, other)
            return n_bytes, checksum
        except DamagedState as exc:
            log.warning("a piece of the shared store's snapshot of %s/%s is damaged: %s", manifest.meta.model,
                        manifest.meta.session_id, exc)
            if exc.block is not None:
                self._store.delete(self.kv_key(exc.block))
            return 0, None
        finally:
            for temp in temps:
                unlink_quietly(temp)

    async def _download(self, key: SessionKey, kind: SnapshotKind, manifest: Manifest, read: tuple[str, str],
                        staged: tuple[str, Path]) -> Snapshot | None:
        """Download the snapshot `manifest` describes into the staged file and import it, fetching it once more if
        what came was damaged. `read` is the manifest's object key and the ETag it was read at."""
        name, etag = read
        for attempt in (1, 2):
            held: list[str] = []  # blocks fetched for it: never collected before its commit names them
            try:
                found = await self._download_once(key, kind, manifest, held, attempt, staged)
            finally:
                await asyncio.to_thread(self._snapshots.blocks.release, held)
            if not isinstance(found, bool):
                return found
        # Damaged at rest: withdraw the manifest, only if it is still the one read (a conditional write: a version
        # written since stands), and remove the file, so that the next save of it (on any host) writes it again.
        withdrawn = dataclasses.replace(manifest, withdrawn=True)
        if await asyncio.to_thread(self._store.put_json, name, withdrawn.to_json(), etag):
            await asyncio.to_thread(self._store.delete, manifest.object_key)
            log.warning("withdrew the damaged snapshot of %s from the shared store: its next save uploads it again",
                        key)
        return None

    async def _download_once(self, key: SessionKey, kind: SnapshotKind, manifest: Manifest, held: list[str],
                             attempt: int, staged: tuple[str, Path]) -> Snapshot | bool | None:
        """One download into the staged file: the snapshot imported; None when it cannot be had now (the store
        failed, or a newer one was committed here); False when what came was damaged (the file is discarded, so a
        second attempt starts afresh under the same name)."""
        meta = manifest.meta
        temp, path = staged
        try:
            if manifest.kv:
                n_bytes, checksum = await asyncio.to_thread(self._fetch_blocks, manifest, path, held)
            else:
                n_bytes = await asyncio.to_thread(self._store.get_file, self.blob_key(meta.checksum), path)
                checksum = await asyncio.to_thread(file_checksum, path) if n_bytes == meta.n_bytes else None
        except Exception as exc:
            await self._snapshots.transfers.discard_upload(temp)
            log.warning("downloading the snapshot of %s from the shared store failed (%s): the turn prefills",
                        key, _message(exc))
            return None
        if checksum == meta.checksum and n_bytes == meta.n_bytes:
            try:
                snapshot: Snapshot = await self._import(key, temp, meta.n_tokens, list(meta.chain), meta.n_bytes,
                                                        kind, meta.n_prompt, meta.version)
            except OlderVersion:  # a newer one was committed here meanwhile: it stands
                return None
            except BaseException:
                await self._snapshots.transfers.discard_upload(temp)
                raise
            self.downloads += 1
            log.info("brought the %s snapshot of %s from the shared store (version %s, saved by %s): %d tokens",
                     kind, key, manifest.version, manifest.origin or "another host", meta.n_tokens)
            return snapshot
        await self._snapshots.transfers.discard_upload(temp)
        self.refused_downloads += 1
        log.warning("the shared store's snapshot of %s is damaged (%d bytes, expected %d; checksum %s): refused%s",
                    key, n_bytes, meta.n_bytes, "mismatch" if n_bytes == meta.n_bytes else "not taken",
                    ", fetching it once more" if attempt == 1 else "")
        return False


def _message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, SlotkeeperError) else f"{type(exc).__name__}: {exc}"
