"""The shared tier: snapshots in an S3-compatible object store that every host's slotkeeper reads, behind the local
slot dir (the hot tier: llama-server restores only from a local file).

Layout under the store's prefix:
- `blobs/<xxh3-128>`: a snapshot file kept whole, named by its checksum. Written once; a system snapshot shared by
  many sessions, or a session saved unchanged, is stored once.
- With the block store (`--block-tokens`, blockstore.py): `kv/<digest>`, a KV block exactly as the slot dir keeps
  it, named by the digest of its bytes, and `tails/<xxh3-128>`, a state's tail (named by its whole file's checksum).
  Two hosts whose saves of one prefix differ by float noise put two blocks; neither names the other's. An upload
  puts only the blocks the store lacks; a download fetches only those this host lacks, and checks each against its
  name: a block that does not match its name is damaged (twice in a row: it is removed), never another host's copy.
- `manifests/<fingerprint>/<kind>/<model>/<session>.json`: the newest version of one snapshot (the bundle's
  `snapshot.json` plus `version`, `saved_at`, `origin`, and the objects it names). Replaced only by a conditional
  write on the ETag read, so two hosts that save one session at once cannot tear it: the loser reads again and
  writes only if it is newer.
- `gc/<object key>`: a mark on an object that no manifest named when a sweep looked (sweep.py).

Objects are removed in two phases (sweep.py), so that a host that reuses a stored object never has it deleted under
a manifest it is writing. This side of it: an upload, right before its manifest write, looks once more at every
object it did not put itself, and one that is gone or marked is put again under a fresh name (`<name>.<8 hex>`),
which no mark covers. Replacing a manifest deletes nothing: what it named goes through the sweep. Manifests and
object names are manifest.py's.

Uploads run in the background after the local commit, the newest per snapshot (a save queued behind an upload in
flight replaces any older one queued). A download is checked (fingerprint, size, checksum) before it is imported
into the local index; a damaged one is refused and fetched once more. Every failure here is logged and costs a
prefill, never a request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import os
import secrets
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slotkeeper.cache.blockstore import DamagedState
from slotkeeper.cache.bundle import meta_of
from slotkeeper.cache.chain import common_messages
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.transfers import Upload
from slotkeeper.errors import OlderVersion, SlotkeeperError
from slotkeeper.files import file_checksum, unlink_quietly
from slotkeeper.fleet.manifest import Manifest, blob_key, kv_key, tail_key
from slotkeeper.fleet.objectstore import ObjectStore
from slotkeeper.fleet.sweep import marks, sweep
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.version import Version, newer

log = logging.getLogger("slotkeeper.shared")

# Attempts at a conditional manifest write that another host's write got ahead of.
MANIFEST_ATTEMPTS = 4
# A turn waits this long for a manifest look-up; after one fails, look-ups pause for the second figure (turns then
# start from what this host has without waiting for a store that is down), or until a probe beside the turns, one
# read at a time with PROBE_SECONDS between them, gets an answer within the first figure.
LOOKUP_TIMEOUT_SECONDS = 3.0
UNREACHABLE_PAUSE_SECONDS = 30.0
PROBE_SECONDS = 1.0
# The store is swept after an upload at most this often.
SWEEP_SECONDS = 300.0


class SharedTier:
    """One backend's view of the shared tier: uploads its commits, brings in what it lacks."""

    def __init__(self, store: ObjectStore, snapshots: Snapshots, fingerprint: str, origin: str,
                 import_snapshot: Callable[..., Any], budget: int = 0) -> None:
        self._store = store
        self._snapshots = snapshots
        self.fingerprint = fingerprint
        self._origin = origin
        self._import = import_snapshot  # cache/operations.py import_snapshot, on this backend's pool
        # What is waiting for its upload (the newest committed version of each, when it runs).
        self._queued: dict[tuple[SessionKey, SnapshotKind], None] = {}
        self._running: tuple[SessionKey, SnapshotKind] | None = None  # the upload in flight
        self._uploaded = asyncio.Condition()  # told after each upload, done or failed
        self.refused_older = 0  # uploads refused: the store's manifest holds a newer version (version.py)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.uploads = 0
        self.failed_uploads = 0
        self.downloads = 0
        self.refused_downloads = 0
        self._unreachable_until = 0.0
        self._probe: asyncio.Task[None] | None = None  # reads the store while look-ups pause, to end the pause
        self.budget = budget  # bytes of snapshot files the store may hold (0: no limit)
        self.uploaded_bytes = 0  # bytes of files, tails and blocks put into the store
        self.downloaded_bytes = 0  # bytes of blocks fetched (files and tails are counted by their snapshots)
        self._swept = 0.0

    # -- keys -------------------------------------------------------------------------------------------------

    def manifest_key(self, key: SessionKey, kind: SnapshotKind) -> str:
        model = urllib.parse.quote(key.model, safe="")
        session = urllib.parse.quote(key.session_id, safe="")
        return f"manifests/{self.fingerprint}/{kind}/{model}/{session}.json"

    blob_key = staticmethod(blob_key)
    tail_key = staticmethod(tail_key)
    kv_key = staticmethod(kv_key)

    # -- uploads ----------------------------------------------------------------------------------------------

    def committed(self, key: SessionKey, kind: SnapshotKind) -> None:
        """A save of `key` was committed locally: upload it (later, in the background)."""
        self._queued.pop((key, kind), None)  # the newest goes last in the queue
        self._queued[(key, kind)] = None
        self._idle.clear()
        self._wake.set()

    async def run(self) -> None:
        """The uploader: one upload at a time, oldest queued first. Cancelling it stops a probe of the store too."""
        try:
            await self._uploads()
        finally:
            if self._probe is not None:
                self._probe.cancel()

    async def _uploads(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queued:
                item = next(iter(self._queued))
                del self._queued[item]
                self._running = item
                try:
                    await self._upload(*item)
                except Exception as exc:  # an upload must never end the uploader
                    self.failed_uploads += 1
                    log.warning("uploading the snapshot of %s to the shared store failed (%s); it stays local and "
                                "is uploaded with its next save", item[0], _message(exc))
                finally:
                    self._running = None
                    async with self._uploaded:
                        self._uploaded.notify_all()
            if time.monotonic() - self._swept > SWEEP_SECONDS:
                self._swept = time.monotonic()
                try:
                    await asyncio.to_thread(self.collect_garbage)
                except Exception as exc:
                    log.warning("sweeping the shared store failed (%s); it is tried again after the next upload",
                                _message(exc))
            self._idle.set()

    def collect_garbage(self, now: float | None = None) -> int:
        """Blocking: one sweep of the store (sweep.py), within this tier's budget; how many objects went."""
        return sweep(self._store, self.budget, now)

    async def drain(self, timeout: float) -> bool:
        """Wait (bounded) until every queued upload is done; True when none is left."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def uploaded(self, key: SessionKey, kind: SnapshotKind = SnapshotKind.SESSION) -> None:
        """Wait until no upload of `key` is queued or running: its newest commit so far is in the store, or its
        upload failed (and was logged). Callers bound the wait."""
        item = (key, kind)
        async with self._uploaded:
            await self._uploaded.wait_for(lambda: item not in self._queued and self._running != item)

    async def _upload(self, key: SessionKey, kind: SnapshotKind) -> None:
        upload = await self._snapshots.transfers.open_for_upload(key, kind)
        if upload is None:
            return  # evicted or replaced meanwhile: a newer save is queued, or there is nothing to upload
        snapshot, chain = upload.snapshot, upload.chain
        try:
            digests = () if upload.blocks is None else upload.blocks.digests
            names = {d: d for d in digests}  # each block's object name
            fresh: set[str] = set()  # the objects this upload put itself
            for digest in names:
                if not await asyncio.to_thread(self._store.exists, self.kv_key(digest)):
                    await self._put_block(digest, digest)
                    fresh.add(self.kv_key(digest))
            whole = snapshot.checksum
            object_key = self.tail_key(whole) if digests else self.blob_key(whole)
            if not await asyncio.to_thread(self._store.exists, object_key):
                await self._put_whole(upload, object_key)
                fresh.add(object_key)
            # The last look before the manifest names them: an object this upload did not put that is gone, or
            # marked for removal, is put again under a fresh name (the sweep's two phases, above).
            marked = await asyncio.to_thread(marks, self._store)
            for digest in names:
                if not await self._still_there(self.kv_key(digest), fresh, marked):
                    names[digest] = f"{digest}.{secrets.token_hex(4)}"
                    await self._put_block(digest, names[digest])
            object_name = ""
            if not await self._still_there(object_key, fresh, marked):
                object_name = f"{whole}.{secrets.token_hex(4)}"
                object_key = self.tail_key(object_name) if digests else self.blob_key(object_name)
                await self._put_whole(upload, object_key)
        finally:
            await asyncio.to_thread(self._snapshots.transfers.finish_upload, upload)
        kv = tuple(names[d] for d in digests)
        meta = meta_of(snapshot, chain)
        for _ in range(MANIFEST_ATTEMPTS):
            current = await asyncio.to_thread(self._store.get_json, self.manifest_key(key, kind))
            etag = None
            if current is not None:
                existing, etag = current
                try:
                    older: Manifest | None = Manifest.from_json(existing)
                except SlotkeeperError:
                    older = None  # a manifest we cannot read is replaced
                if older is not None:
                    if older.meta.checksum == meta.checksum and older.digests == tuple(digests) and \
                            not older.withdrawn:
                        break  # already there (under whichever names: a named object is never marked)
                    if not older.replaced_by(meta.version):
                        self._refuse_older(key, kind, meta.version, older)
                        return
            manifest = Manifest(meta, time.time(), self._origin, kv=kv, object=object_name)
            if await asyncio.to_thread(self._store.put_json, self.manifest_key(key, kind), manifest.to_json(), etag):
                break
        else:
            raise SlotkeeperError(f"the manifest of {key} kept changing under {MANIFEST_ATTEMPTS} conditional writes")
        # The objects of the version it replaced stay until a sweep finds no manifest naming them: another session's
        # manifest may name them too.
        self.uploads += 1
        log.info("uploaded the %s snapshot of %s to the shared store: %d tokens, %d bytes, version %s", kind, key,
                 snapshot.n_tokens, snapshot.n_bytes, meta.version)

    async def _still_there(self, key: str, fresh: set[str], marks: set[str]) -> bool:
        """Whether an object an upload names may be named: this upload put it, or it is there and not marked."""
        if key in fresh:
            return True
        return key not in marks and await asyncio.to_thread(self._store.exists, key)

    async def _put_block(self, digest: str, name: str) -> None:
        """Put a block, read and checked against its name first: a block damaged on this host's disk is never put."""
        data = await asyncio.to_thread(self._snapshots.blocks.checked_file, digest)
        await asyncio.to_thread(self._store.put_file, self.kv_key(name), io.BytesIO(data), len(data))
        self.uploaded_bytes += len(data)

    async def _put_whole(self, upload: Upload, object_key: str) -> None:
        """Put the upload's file (kept whole) or tail under `object_key`."""
        size = upload.snapshot.n_bytes if upload.blocks is None else os.fstat(upload.handle.fileno()).st_size
        upload.handle.seek(0)
        await asyncio.to_thread(self._store.put_file, object_key, upload.handle, size)
        self.uploaded_bytes += size

    def _refuse_older(self, key: SessionKey, kind: SnapshotKind, version: Version, newer_one: Manifest) -> None:
        """A save older than the store's manifest: the manifest stays; what was put for it goes with the sweep."""
        self.refused_older += 1
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
            why = f"no answer in {LOOKUP_TIMEOUT_SECONDS:g} s" if isinstance(exc, TimeoutError) else _message(exc)
            log.warning("the shared store cannot be read (%s): %s starts from what this host has, and look-ups pause "
                        "for %.0f s or until the store answers again", why, key, UNREACHABLE_PAUSE_SECONDS)
            if self._probe is None or self._probe.done():
                self._probe = asyncio.create_task(self._probe_until_back(name))
            return None
        if current is None:
            return None
        try:
            manifest = Manifest.from_json(current[0])
        except SlotkeeperError as exc:
            log.warning("the shared manifest of %s is unreadable (%s): it is ignored", key, exc.message)
            return None
        meta = manifest.meta
        if meta.fingerprint != self.fingerprint or manifest.withdrawn:
            return None
        # What the snapshots are asked, in one go: a name for the download should one be needed (a name only:
        # nothing is written under it until then), and this host's own version, once its commits still running are
        # done.
        staged = await self._snapshots.transfers.stage_upload(key, kind)
        local = await self._snapshots.checked(key, kind)
        if local is not None and (local.checksum == meta.checksum or not newer(meta.version, local.version)):
            return None  # this host's is the store's, or newer than it
        if local is not None and await self._extends(key, local, manifest):
            return None
        return await self._download(key, kind, manifest, (name, current[1]), staged)

    async def _probe_until_back(self, name: str) -> None:
        """While look-ups pause, read the manifest `name` again and again, one read at a time (a read the store holds
        leaves no second thread behind it), and end the pause at the first answer within LOOKUP_TIMEOUT_SECONDS: a
        store back after a few seconds is not skipped for the rest of the pause, when sessions moving between hosts
        need it (a session that changes hosts then would start without its newest state)."""
        while time.monotonic() < self._unreachable_until:
            await asyncio.sleep(PROBE_SECONDS)
            started = time.monotonic()
            try:
                await asyncio.to_thread(self._store.get_json, name)
            except Exception:
                continue
            if time.monotonic() - started <= LOOKUP_TIMEOUT_SECONDS and time.monotonic() < self._unreachable_until:
                self._unreachable_until = 0.0
                log.info("the shared store answers again: look-ups resume")
                return

    async def _extends(self, key: SessionKey, local: Snapshot, manifest: Manifest) -> bool:
        """Whether this host's snapshot already holds every message and token of the store's newer version: its
        messages begin with all of the other's, and it has at least as many tokens. The version says who wrote last
        (a lease holder's save outranks one made while the directory was away); the tokens say what a restore can
        use, and a prefix of what this host has adds nothing, so bringing it would only lose turns."""
        meta = manifest.meta
        if local.n_tokens < meta.n_tokens or not meta.chain:
            return False
        chain = await self._snapshots.chain(local)
        if common_messages(meta.chain, chain) < len(meta.chain):
            return False
        log.info("kept this host's %s snapshot of %s (%d tokens, version %s): it extends the shared store's newer "
                 "version %s from %s (%d tokens)", local.kind, key, local.n_tokens, local.version,
                 manifest.version, manifest.origin or "another host", meta.n_tokens)
        return True

    def _fetch_blocks(self, manifest: Manifest, path: Path, held: list[str], attempt: int) -> tuple[int, str | None]:
        """Blocking: bring a state stored as blocks into the whole file `path`: its tail, and the blocks this host
        lacks (each checked against its name, then adopted into the local block store, and held, with the digests
        put in `held`, until the caller's commit names them); returns (bytes, checksum) of the file, the checksum
        None when a piece in the store is damaged. A block damaged on the second attempt in a row is removed from
        the store (its bytes do not match its name: no host's copy), so that its owner's next upload puts it again."""
        blocks = self._snapshots.blocks
        temps: list[Path] = []
        try:
            tail = blocks.temp_path("tail")
            temps.append(tail)
            self._store.get_file(manifest.object_key, tail)
            try:
                parts = blocks.manifest_at(tail)
                blocks.read_tail_at(parts, tail)
            except DamagedState:
                if attempt > 1:  # its bytes do not match its own checksums: damaged, not another host's
                    self._store.delete(manifest.object_key)
                raise
            if parts.digests != manifest.digests or parts.checksum != manifest.meta.checksum:
                return 0, None
            blocks.hold(parts.digests)
            held.extend(parts.digests)
            for name, digest in zip(manifest.kv, manifest.digests, strict=True):
                if blocks.has_block(digest):
                    continue
                source = blocks.temp_path("block")
                temps.append(source)
                self._store.get_file(self.kv_key(name), source)
                self.downloaded_bytes += source.stat().st_size
                try:
                    blocks.adopt_block(digest, source)
                except DamagedState:
                    if attempt > 1:
                        self._store.delete(self.kv_key(name))
                    raise
            return blocks.assemble_from(tail, path)
        except DamagedState as exc:
            log.warning("a piece of the shared store's snapshot of %s/%s is damaged: %s", manifest.meta.model,
                        manifest.meta.session_id, exc)
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
        # written since stands). The damaged object itself went when it failed its check twice.
        withdrawn = dataclasses.replace(manifest, withdrawn=True)
        if await asyncio.to_thread(self._store.put_json, name, withdrawn.to_json(), etag):
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
                n_bytes, checksum = await asyncio.to_thread(self._fetch_blocks, manifest, path, held, attempt)
            else:
                n_bytes = await asyncio.to_thread(self._store.get_file, manifest.object_key, path)
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
        if attempt > 1 and not manifest.kv:  # a file whose bytes do not match its checksum twice: damaged at rest
            await asyncio.to_thread(self._store.delete, manifest.object_key)
        log.warning("the shared store's snapshot of %s is damaged (%d bytes, expected %d; checksum %s): refused%s",
                    key, n_bytes, meta.n_bytes, "mismatch" if n_bytes == meta.n_bytes else "not taken",
                    ", fetching it once more" if attempt == 1 else "")
        return False


def _message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, SlotkeeperError) else f"{type(exc).__name__}: {exc}"
