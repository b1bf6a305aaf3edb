"""The quarantine: snapshot files that failed a check, moved aside into the slot dir's `quarantine/` for a person to
look at, never handed to the backend again, and aged out (they count in the disk budget meanwhile).

Which files go there, and their index rows, are the store's (store.py); this module keeps the directory.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from slotkeeper.cache.budget import DiskBudget
from slotkeeper.files import make_private_dir, unlink_quietly

log = logging.getLogger("slotkeeper.store")

QUARANTINE_DIR = "quarantine"
# How long a quarantined file is kept for a person to look at when the budget sets no max age.
QUARANTINE_KEEP_SECONDS = 7 * 86400


def move_aside(slot_dir: Path, source: Path, filename: str) -> None:
    """Move `source` (the file or the tail of the snapshot `filename`), if it is there, into the quarantine, named
    "<filename>.<unix time it was moved aside>"."""
    if source.exists() or source.is_symlink():
        target_dir = slot_dir / QUARANTINE_DIR
        make_private_dir(target_dir)
        try:
            os.replace(source, target_dir / f"{filename}.{int(time.time())}")
        except OSError as exc:
            log.error("could not move %s aside: %s", source, exc)


def trim(slot_dir: Path, budget: DiskBudget, stored_bytes: Callable[[], int], now: float | None = None) -> int:
    """Remove quarantined files older than the budget's max age (a week without one), then, oldest first, as many
    as it takes for the snapshots (`stored_bytes`) and the quarantine together to fit the budget's total. Returns how
    many."""
    now = time.time() if now is None else now
    found = []
    try:
        with os.scandir(slot_dir / QUARANTINE_DIR) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                moved = entry.name.rsplit(".", 1)[-1]  # "<file>.<unix time it was moved aside>"
                found.append((int(moved) if moved.isdigit() else st.st_mtime, st.st_size, Path(entry.path)))
    except FileNotFoundError:
        return 0
    keep_for = budget.max_age_seconds if budget.max_age_seconds > 0 else QUARANTINE_KEEP_SECONDS
    found.sort()
    removed = [f for f in found if now - f[0] > keep_for]
    if budget.max_bytes > 0:
        rest = [f for f in found if f not in removed]
        total = stored_bytes() + sum(f[1] for f in rest)
        for f in rest:
            if total <= budget.max_bytes:
                break
            removed.append(f)
            total -= f[1]
    for _, _, path in removed:
        unlink_quietly(path)
    if removed:
        log.info("removed %d quarantined file(s) (older than %.0f s, or over the disk budget)", len(removed),
                 keep_for)
    return len(removed)


def count(slot_dir: Path) -> int:
    """Files in the quarantine directory."""
    try:
        with os.scandir(slot_dir / QUARANTINE_DIR) as entries:
            return sum(1 for entry in entries if entry.is_file())
    except OSError:
        return 0
