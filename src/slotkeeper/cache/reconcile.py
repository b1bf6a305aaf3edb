"""The start-of-day clean-up of the slot dir and the RAM dir: what a crash left behind goes, and our names that say
what is a leftover.

A file is listed in the index only once it was completely written, fsynced and renamed (store.py); anything else of
our naming in the directory is a leftover: a temporary being written, a file whose row never landed or was dropped, a
whole file assembled for a restore that never finished, blocks no state names. Only names of our own shape are
touched: the directory may be shared with other tools.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slotkeeper.cache.blockstore import TAIL_SUFFIX, BlockStore
from slotkeeper.cache.index import SnapshotIndex
from slotkeeper.cache.ramdir import RamDir
from slotkeeper.files import unlink_quietly

log = logging.getLogger("slotkeeper.store")

# Our own names: 40 hex digits, a dash and a nonce; temporaries carry `.tmp-<nonce>` before `.bin`.
_FINAL_NAME = re.compile(r"^[0-9a-f]{40}-[0-9a-f]{8}\.bin$")
_TEMP_NAME = re.compile(r"^[0-9a-f]{40}\.tmp-[0-9a-f]{8}\.bin$")
# The block store's temporaries in the slot dir: a tail being written, a file being assembled, an export's copy.
_BLOCK_TEMP_NAME = re.compile(r"^\.((tmp|assembling)-[0-9a-f]{8}-[0-9a-f]{40}-[0-9a-f]{8}\.bin(\.tail)?"
                              r"|export-[0-9a-f]{8}\.bin)$")
# A sidecar a patched llama-server may write next to a slot file (context checkpoints): it lives and dies with it.
SIDECAR_SUFFIXES = (".ckpt",)


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    temporaries_removed: int
    orphans_removed: int
    rows_dropped: int


def reconcile(slot_dir: Path, index: SnapshotIndex, ram: RamDir | None,
              trim_ram: Callable[[], int]) -> ReconcileReport:
    """At start: remove our leftover temporaries and unindexed files, and rows whose file is gone.

    Only names of our own shape are touched: the directory may be shared with other tools.
    """
    indexed = index.filenames()
    temps = orphans = 0
    tails = {name for name in indexed if (slot_dir / (name + TAIL_SUFFIX)).is_file()}
    for entry in os.scandir(slot_dir):
        if _TEMP_NAME.match(entry.name) or _BLOCK_TEMP_NAME.match(entry.name):
            unlink_quietly(Path(entry.path))
            temps += 1
        elif entry.name in tails and entry.is_file(follow_symlinks=False):
            unlink_quietly(Path(entry.path))  # a whole file assembled for a restore that never finished
        elif _unindexed_own_file(entry.name, indexed):
            unlink_quietly(Path(entry.path))
            orphans += 1
    if ram is not None:
        orphans += _reconcile_ram(ram, indexed)
    index.drop_orphan_chains()
    dropped = 0
    for name in indexed:
        if name not in tails and not (slot_dir / name).is_file():
            index.drop(name)
            dropped += 1
    trim_ram()
    report = ReconcileReport(temps, orphans, dropped)
    if temps or orphans or dropped:
        log.info(
            "slot dir reconciled: %d temporaries and %d unindexed files removed, %d rows without a file dropped",
            temps, orphans, dropped,
        )
    return report


def _reconcile_ram(ram: RamDir, indexed: set[str]) -> int:
    """At start, in the RAM dir: remove temporaries, half-made links, and names no snapshot has (copies
    of indexed snapshots stay: they are checked against their checksum before a restore uses them)."""
    removed = 0
    for entry in os.scandir(ram.path):
        name = entry.name
        if _TEMP_NAME.match(name) or _BLOCK_TEMP_NAME.match(name) or name.startswith(".link-") or (
                is_final_name(name) and name not in indexed):
            ram.remove(name)
            removed += 1
    return removed


def sweep_blocks(index: SnapshotIndex, blocks: BlockStore) -> int:
    """At start, in a worker thread: remove blocks no state names (a save that crashed before its commit, a
    removal that crashed before its blocks went) and block temporaries; returns how many blocks went."""
    blocks.sweep_temporaries()
    orphans = index.orphan_refs()
    stored = blocks.stored_digests()
    unnamed = (stored - index.all_referenced()) | set(orphans)
    return blocks.collect(unnamed, index.referenced)


def is_final_name(name: str) -> bool:
    """A snapshot file of our naming (not a temporary, a sidecar or a tail)."""
    return bool(_FINAL_NAME.match(name))


def _unindexed_own_file(name: str, indexed: set[str]) -> bool:
    """A snapshot file of our naming, or its sidecar, that no index row names."""
    base = name
    for suffix in (*SIDECAR_SUFFIXES, TAIL_SUFFIX):
        base = base.removesuffix(suffix)
    return bool(_FINAL_NAME.match(base)) and base not in indexed
