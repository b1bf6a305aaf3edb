"""The shared tier's manifests and object names (shared.py says what lies where in the store).

A manifest is the store's newest version of one saved state: its bundle's metadata, when and by whom it was written,
and the objects that hold its bytes. Objects are named by what they hold: `blobs/<checksum>` (a file kept whole),
`tails/<checksum of the whole file>` and `kv/<digest>` (a block); an object put again under a fresh name (sweep.py)
has `.<8 hex>` after that.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from slotkeeper.cache.bundle import BundleMeta
from slotkeeper.errors import BadRequest
from slotkeeper.version import UNVERSIONED, Version, newer

_OBJECT_NAME = re.compile(r"[0-9a-f]{32}(\.[0-9a-f]{8})?")


def blob_key(name: str) -> str:
    return f"blobs/{name}"


def tail_key(name: str) -> str:
    return f"tails/{name}"


def kv_key(name: str) -> str:
    return f"kv/{name}"


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
    # The names of its KV blocks' objects under `kv/` when it is stored as blocks and a tail (`tails/`); empty: one
    # whole file. A name is the block's digest, with `.<8 hex>` after it when it was put again under a fresh name.
    kv: tuple[str, ...] = ()
    # The name of its file's or tail's object when it was put again under a fresh name ("": the checksum's).
    object: str = ""

    @property
    def version(self) -> Version:
        return self.meta.version

    def to_json(self) -> dict[str, Any]:
        return {**self.meta.to_json(), "saved_at": self.saved_at, "origin": self.origin, "withdrawn": self.withdrawn,
                "kv": list(self.kv), "object": self.object}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        meta = BundleMeta.from_json(data)
        fence = data.get("fence")  # a manifest from before versions named its lease's token only
        if meta.version == UNVERSIONED and isinstance(fence, int) and not isinstance(fence, bool) and fence > 0:
            meta = dataclasses.replace(meta, version=Version(fence, 0))
        saved_at = data.get("saved_at")
        kv = data.get("kv") or []
        if not isinstance(kv, list) or not all(isinstance(k, str) and _OBJECT_NAME.fullmatch(k) for k in kv):
            raise BadRequest("the manifest's block names are not digests (32 hex digits, and .<8 hex> at most)")
        named = data.get("object") or ""
        if not isinstance(named, str) or (named and not _OBJECT_NAME.fullmatch(named)):
            raise BadRequest("the manifest's object name is not a checksum")
        return cls(meta, float(saved_at) if isinstance(saved_at, (int, float)) else 0.0, str(data.get("origin") or ""),
                   data.get("withdrawn") is True, tuple(kv), named)

    @property
    def object_key(self) -> str:
        """The object holding the state's file (kept whole) or its tail (kept as blocks)."""
        name = self.object or self.meta.checksum
        return tail_key(name) if self.kv else blob_key(name)

    @property
    def digests(self) -> tuple[str, ...]:
        """Its blocks' digests (each object's name without a fresh name's suffix)."""
        return tuple(name[:32] for name in self.kv)

    def objects(self) -> list[str]:
        """Every object it names."""
        return [self.object_key, *(kv_key(name) for name in self.kv)]

    def replaced_by(self, version: Version) -> bool:
        """Whether a save at `version` may replace this manifest: it is newer, or it is this very version uploaded
        again after the store's copy was withdrawn."""
        return newer(version, self.version) or (self.withdrawn and version == self.version)
