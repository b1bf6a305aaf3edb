"""A state kept as blocks, by its tail (blockstore.py): the tail checked before the state may be restored, the tail
and its manifest handed out for an upload, and where the slot file it holds ends.

The tail starts as the state's whole file did, and its manifest names the blocks and the whole file's checksum; so
these need the block store and the state's index row only, never the index itself.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import BinaryIO

from slotkeeper.cache.blockstore import TAIL_SUFFIX, BlockStore, DamagedState
from slotkeeper.cache.blockstore import Manifest as BlockManifest
from slotkeeper.cache.hashmemo import HashMemo, read_identity
from slotkeeper.types import Snapshot


def tail_problem(blocks: BlockStore, hashes: HashMemo, snapshot: Snapshot) -> str | None:
    """Why a state kept as blocks cannot be assembled, as far as its tail tells (its blocks are checked as they
    are read); None when it can. The tail is read again only when its stat identity moved (`hashes`: the store's
    memo of what this process hashed)."""
    name = snapshot.filename + TAIL_SUFFIX
    path = blocks.slot_dir / name
    try:
        st, identity = read_identity(path)
    except FileNotFoundError:
        return "its tail is missing"
    if not stat.S_ISREG(st.st_mode):
        return "its tail is not a regular file"
    if hashes.checksum(name, identity) == snapshot.checksum:
        return None
    try:
        manifest = blocks.manifest(snapshot.filename)
        blocks.read_tail(manifest, snapshot.filename)
    except (DamagedState, OSError) as exc:
        return str(exc)
    if manifest.checksum != snapshot.checksum or manifest.cut.layout.file_size != snapshot.n_bytes:
        return "its tail belongs to another save"
    hashes.remember(name, identity, snapshot.checksum)
    return None


def open_parts(blocks: BlockStore, snapshot: Snapshot) -> tuple[BinaryIO, BlockManifest]:
    """A state kept as blocks, for an upload: its tail open for reading and its checked manifest; its blocks are
    held (never collected) until `release_parts`. DamagedState when its tail is not intact."""
    manifest = blocks.manifest(snapshot.filename)
    if manifest.checksum != snapshot.checksum:
        raise DamagedState("its tail belongs to another save")
    blocks.hold(manifest.digests)
    try:
        return blocks.tail_path(snapshot.filename).open("rb"), manifest
    except BaseException:
        blocks.release(manifest.digests)
        raise


def release_parts(blocks: BlockStore, manifest: BlockManifest) -> None:
    blocks.release(manifest.digests)


def appendix_extent(blocks: BlockStore, snapshot: Snapshot) -> tuple[Path, int | None]:
    """Where the state's slot file ends with its checkpoint appendix, if any: the file and its end (a tail's
    bytes end where the original file ended; its manifest follows)."""
    if not snapshot.tail_bytes:
        return blocks.slot_dir / snapshot.filename, None
    return blocks.tail_path(snapshot.filename), snapshot.tail_bytes
