"""Snapshot bundles: one snapshot as a tar stream (`snapshot.json` with its index row and message chain, then
`snapshot.bin`, the slot file), to move a session between machines that run the same model and build.

Writing streams the slot file in chunks; reading parses the tar incrementally from any async byte source, so
neither side holds a multi-gigabyte file in memory or copies it twice.
"""

from __future__ import annotations

import json
import tarfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from slotkeeper.cache.chain import Link
from slotkeeper.errors import BadRequest
from slotkeeper.types import Snapshot, SnapshotKind
from slotkeeper.version import UNVERSIONED, Version

FORMAT = "slotkeeper-snapshot"
VERSION = 1
_BLOCK = 512
_CHUNK = 1024 * 1024
_MAX_META = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class BundleMeta:
    """What a bundle says about its snapshot."""

    model: str
    session_id: str
    kind: SnapshotKind
    fingerprint: str
    n_tokens: int
    n_bytes: int
    checksum: str
    chain: tuple[Link, ...]
    n_prompt: int = 0  # the prompt tokens of the turn saved (0: not known; bundles from before it lack it)
    version: Version = UNVERSIONED  # the saved state's version (version.py; bundles from before it lack it)
    domain: str = ""  # the cache domain it was saved in (types.SessionKey; bundles from before it lack it)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "session": self.session_id,
                "kind": str(self.kind), "fingerprint": self.fingerprint, "tokens": self.n_tokens,
                "bytes": self.n_bytes, "checksum": self.checksum,
                "chain": [[link.digest, link.chars] for link in self.chain], "prompt_tokens": self.n_prompt,
                "state_version": self.version.to_json(), "domain": self.domain}

    @classmethod
    def from_json(cls, data: object) -> BundleMeta:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BadRequest(f"not a slotkeeper snapshot bundle (snapshot.json lacks the format mark {FORMAT!r})")
        if data.get("version") != VERSION:
            raise BadRequest(f"snapshot bundle version {data.get('version')!r} is not supported (this slotkeeper "
                             f"reads version {VERSION})")
        try:
            chain = tuple(Link(str(d), int(c)) for d, c in data.get("chain") or [])
            return cls(str(data["model"]), str(data["session"]), SnapshotKind(data["kind"]),
                       str(data["fingerprint"]), int(data["tokens"]), int(data["bytes"]), str(data["checksum"]),
                       chain, int(data.get("prompt_tokens") or 0), Version.from_json(data.get("state_version")),
                       str(data.get("domain") or ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"snapshot.json of the bundle is incomplete or malformed: {exc}") from None


def meta_of(snapshot: Snapshot, chain: list[Link]) -> BundleMeta:
    return BundleMeta(snapshot.model, snapshot.session_id, snapshot.kind, snapshot.fingerprint, snapshot.n_tokens,
                      snapshot.n_bytes, snapshot.checksum, tuple(chain), snapshot.n_prompt, snapshot.version,
                      snapshot.domain)


def write_bundle(meta: BundleMeta, slot_file: BinaryIO) -> Iterator[bytes]:
    """The bundle as tar chunks: header, snapshot.json, header, the slot file in 1 MiB chunks, end of archive.

    `slot_file` is opened by the caller before it answers (so a save replacing the file meanwhile cannot take it
    away), and closed here.
    """
    with slot_file:
        body = json.dumps(meta.to_json(), indent=1).encode()
        yield _header("snapshot.json", len(body))
        yield body + _padding(len(body))
        yield _header("snapshot.bin", meta.n_bytes)
        sent = 0
        while chunk := slot_file.read(min(_CHUNK, meta.n_bytes - sent)):
            sent += len(chunk)
            yield chunk
        if sent != meta.n_bytes:
            raise OSError(f"the slot file ended after {sent} of {meta.n_bytes} bytes while it was exported")
        yield _padding(sent) + b"\0" * (2 * _BLOCK)


class BundleReader:
    """Reads a bundle from an async byte stream: `meta()` first, then `copy_file_to(path)`."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._buffer = b""

    async def meta(self) -> BundleMeta:
        size = await self._member("snapshot.json", _MAX_META)
        raw = await self._read(size)
        await self._read(len(_padding(size)))
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise BadRequest(f"snapshot.json of the bundle is not JSON: {exc}") from None
        return BundleMeta.from_json(data)

    async def copy_file_to(self, path: Path, expected: int) -> None:
        """Write snapshot.bin to `path` (which the caller removes on failure)."""
        size = await self._member("snapshot.bin", None)
        if size != expected:
            raise BadRequest(f"the bundle's snapshot.bin has {size} bytes but snapshot.json says {expected}")
        left = size
        with path.open("wb") as out:
            while left:
                if not self._buffer:
                    self._buffer = await self._next()
                piece, self._buffer = self._buffer[:left], self._buffer[left:]
                out.write(piece)
                left -= len(piece)

    async def _member(self, name: str, limit: int | None) -> int:
        header = await self._read(_BLOCK)
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.TarError:
            raise BadRequest(f"not a snapshot bundle: expected a tar archive starting with {name}") from None
        if info.name != name or not info.isfile():
            raise BadRequest(f"not a snapshot bundle: expected {name}, found {info.name!r}")
        if limit is not None and info.size > limit:
            raise BadRequest(f"{name} of the bundle is too large ({info.size} bytes)")
        return info.size

    async def _read(self, n: int) -> bytes:
        while len(self._buffer) < n:
            self._buffer += await self._next()
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    async def _next(self) -> bytes:
        while True:
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                raise BadRequest("the snapshot bundle ends early (truncated upload?)") from None
            if chunk:
                return chunk


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o600
    info.mtime = int(time.time())
    return info.tobuf(tarfile.USTAR_FORMAT)


def _padding(size: int) -> bytes:
    return b"\0" * (-size % _BLOCK)
