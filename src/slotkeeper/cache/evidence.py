"""Learning from saved files whether the backend's llama.cpp build keeps context checkpoints in slot files (the
build number says nothing for builds from source), and handing what is learned to the restore policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path

from slotkeeper.cache.capability import has_checkpoint_appendix
from slotkeeper.cache.proof import RestorePolicy
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind

# Saved files scanned for checkpoints (0.4 ms per MB when there are none) that could not settle the question.
_INSPECTIONS = 16


class CheckpointEvidence:
    """A file with the checkpoint appendix says the build keeps them. A file without one says it does not only when
    the slot surely had checkpoints when it was saved: its prompt-end step had just rolled back to one."""

    def __init__(self, policy: RestorePolicy, where: Callable[[Snapshot], tuple[Path, int | None]]) -> None:
        self._policy = policy
        self._where = where  # the file holding a state's appendix, and where its slot file's bytes end in it
        self._rolled_back: set[SessionKey] = set()
        self._inspections_left = _INSPECTIONS
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def wanted(self) -> bool:
        capability = self._policy.capability
        return capability.needs_checkpoints and capability.checkpoints_in_file is None

    def rolled_back(self, key: SessionKey) -> None:
        """On the event loop, before `key`'s save: its slot was just rolled back to a checkpoint."""
        self._loop = asyncio.get_running_loop()
        if self.wanted:
            self._rolled_back.add(key)

    def saving(self) -> None:
        """On the event loop, as a save starts: where to hand what its commit's thread learns."""
        self._loop = asyncio.get_running_loop()

    def inspect(self, snapshot: Snapshot) -> None:
        """In the commit's worker thread, with the snapshot just committed."""
        if not self.wanted:
            return
        key = snapshot.key
        had_checkpoints = key in self._rolled_back and snapshot.kind is SnapshotKind.SESSION
        self._rolled_back.discard(key)
        if not had_checkpoints:
            if self._inspections_left <= 0:
                return  # a file without them proves nothing: scanning big files for nothing is not worth it
            self._inspections_left -= 1
        try:
            seen = has_checkpoint_appendix(*self._where(snapshot))
        except OSError:
            return
        loop = self._loop
        if loop is not None and (seen or had_checkpoints):
            loop.call_soon_threadsafe(self._policy.learned, self._policy.capability.with_checkpoints(seen))

    def from_files(self, snapshots: Iterable[Snapshot], limit: int = 3) -> None:
        """In a worker thread at start: look for checkpoints in the newest snapshots of this backend, so a restart
        need not wait for a new save to know the build keeps them."""
        if not self.wanted:
            return
        for n, snapshot in enumerate(snapshots):
            if n >= limit:
                return
            try:
                if has_checkpoint_appendix(*self._where(snapshot)):
                    self._policy.learned(self._policy.capability.with_checkpoints(True))
                    return
            except OSError:
                continue
