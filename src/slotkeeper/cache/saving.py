"""Getting a slot's state to disk: the backend writes the slot's file, and the snapshots commit it (snapshots.py).

On backends whose slot files keep no checkpoints (recurrent and hybrid models there), the slot is first brought back
to its last prompt's end, so that the snapshot holds exactly that prompt and a later request can continue from it.
Which slot to save, and when, is the pool's decision; this module only does it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from slotkeeper.cache.evidence import CheckpointEvidence
from slotkeeper.cache.promptend import Replay, replay_body
from slotkeeper.cache.proof import RestorePolicy
from slotkeeper.cache.slots import Held, SlotState
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.errors import SlotkeeperError
from slotkeeper.types import SessionKey, SnapshotKind
from slotkeeper.upstream.client import UpstreamClient

log = logging.getLogger("slotkeeper.pool")


class Saver:
    def __init__(self, client: UpstreamClient, snapshots: Snapshots, evidence: CheckpointEvidence,
                 policy: RestorePolicy, slots: Sequence[SlotState]) -> None:
        self._client = client
        self._snapshots = snapshots
        self._evidence = evidence
        self._policy = policy
        self._slots = slots
        # Prompt-end steps made before saves, and the tokens they processed (what that strategy costs).
        self.prompt_end_steps = 0
        self.prompt_end_tokens = 0
        self.prompt_end_ms = 0.0

    async def save(self, slot_id: int, key: SessionKey, held: Held, kind: SnapshotKind | None = None, *,
                   wait: bool = True) -> float:
        """Save the slot's state (`held`: what it holds) as `key`'s snapshot, waiting for its commit or not (see
        snapshots.py); returns the milliseconds waited (0 when it failed: logged, and it costs only the snapshot's
        freshness)."""
        started = time.perf_counter()
        commit = await self.start(slot_id, key, held, kind)
        if commit is None or (wait and not await asyncio.shield(commit)):
            return 0.0
        return (time.perf_counter() - started) * 1000

    async def start(self, slot_id: int, key: SessionKey, held: Held,
                    kind: SnapshotKind | None = None) -> asyncio.Task[bool] | None:
        """`save` until the backend wrote the slot's state (as a state of `kind`, by default what the slot holds);
        returns the commit going on in the background (its result: whether the save succeeded), or None when the
        backend's write failed."""
        kind = held.kind if kind is None else kind
        self._evidence.saving()
        n_prompt = held.n_prompt
        if self._steps_back(held, kind):
            assert held.replay is not None
            n_prompt = await self._to_prompt_end(slot_id, key, held.replay) or n_prompt
        return await self._snapshots.start_save(slot_id, key, held.chain, kind, n_prompt=n_prompt)

    def begin(self, slot_id: int, key: SessionKey, held: Held) -> asyncio.Task[float] | None:
        """`save(wait=False)` for a caller with other work to do while the backend writes (a turn's look-ups): the
        save is a pending write once this returns, so a look-up made meanwhile that could find the snapshot waits
        for it. Returns a task whose result is `save`'s; None when the slot must first be brought back to its
        prompt's end (a step that changes what the slot holds: then `save` alone)."""
        if self._steps_back(held, held.kind):
            return None
        started = time.perf_counter()
        self._evidence.saving()
        written, _ = self._snapshots.begin_save(slot_id, key, held.chain, held.kind, n_prompt=held.n_prompt)

        async def waited() -> float:
            return (time.perf_counter() - started) * 1000 if await asyncio.shield(written) else 0.0

        return asyncio.ensure_future(waited())

    def _steps_back(self, held: Held, kind: SnapshotKind) -> bool:
        """Whether a save of what the slot holds first brings the slot back to its last prompt's end."""
        return (kind is SnapshotKind.SESSION and self._policy.prompt_end_saves and not held.at_prompt_end
                and held.replay is not None)

    def expected_seconds(self, n_tokens: int) -> float | None:
        """How long the backend's write of a slot of `n_tokens` is expected to take (at the last save's rate), or
        None before the first save."""
        rate = self._snapshots.write_seconds_per_token
        return None if rate is None else rate * n_tokens

    async def _to_prompt_end(self, slot_id: int, key: SessionKey, replay: Replay) -> int:
        """Send the slot's last request again without generating: the backend rolls the slot back to its checkpoint
        just before the prompt's end and evaluates the last few tokens, so the slot holds exactly that prompt.
        Returns the prompt's tokens, or 0 when it failed (the state is saved as it is)."""
        path, body = replay
        started = time.perf_counter()
        try:
            data = await self._client.post_json(path, replay_body(path, body, slot_id))
        except SlotkeeperError as exc:
            log.warning("bringing slot %d (%s) back to its prompt's end failed: %s; saving it as it is", slot_id, key,
                        exc.message)
            return 0
        timings = data.get("timings") if isinstance(data, dict) else None
        if not isinstance(timings, dict):
            return 0
        processed = int(timings.get("prompt_n") or 0)
        if int(timings.get("cache_n") or 0) > 0:
            self._evidence.rolled_back(key)
        self.prompt_end_steps += 1
        self.prompt_end_tokens += processed
        self.prompt_end_ms += (time.perf_counter() - started) * 1000
        slot = self._slots[slot_id]
        slot.at_prompt_end = True
        n_prompt = int(timings.get("cache_n") or 0) + processed
        slot.n_tokens = slot.n_prompt = n_prompt
        log.debug("slot %d (%s) brought back to its prompt's end: %d tokens, %d processed", slot_id, key, n_prompt,
                  processed)
        return n_prompt
