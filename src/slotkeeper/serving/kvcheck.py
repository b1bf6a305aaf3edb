"""The backend's KV setting checked again after it restarts: a server started again with another K/V type, rope
base or adapter must not be handed a state saved under the old one.

When the watch decides the backend is another process (watch.py), every lookup and save moves at once, before any
await, to a fingerprint no state has: nothing saved before is restored meanwhile. Then the probe (backend.py) runs
in slot 0, taken through the pool's queue as an operator's work is, and the fingerprint becomes the probed one: the
same as before when the settings are the same (states saved before are restored again), another one when they
changed. A turn saved in between is saved under the placeholder and never restored: it costs its next turn a prefill.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from slotkeeper.cache.pool import SlotPool, empty_slot
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.serving.backend import kv_fingerprint, kv_setting
from slotkeeper.upstream.client import UpstreamClient

log = logging.getLogger("slotkeeper.backend")


class KvCheck:
    def __init__(self, client: UpstreamClient, pool: SlotPool, snapshots: Snapshots, base: str,
                 meta: Mapping[str, Any], fingerprint: str, apply: Callable[[str], None]) -> None:
        self._client, self._pool, self._snapshots = client, pool, snapshots
        self._base, self._meta = base, meta
        self.fingerprint = fingerprint  # the last one probed
        self._apply = apply  # makes a fingerprint the backend's everywhere (snapshots, shared tier, views)
        self._task: asyncio.Task[None] | None = None

    def restarted(self) -> None:
        """The backend is another process: nothing saved is restored until its KV setting is probed again."""
        if self._task is not None:
            self._task.cancel()
        self._apply(f"unverified-{secrets.token_hex(4)}")
        self._task = asyncio.create_task(self._probe_again())

    async def probe_now(self) -> None:
        """The backend was started again on purpose and nothing runs on it yet: probe its KV setting before a turn
        does (its slots were already forgotten), and use the fingerprint it shows."""
        if self._task is not None:
            self._task.cancel()
        await self._probe_again()

    async def _probe_again(self) -> None:
        slot = self._pool.slots[0]
        await self._pool.take(slot)
        try:
            setting = await kv_setting(self._client, self._snapshots, self._base, self._meta)
            empty_slot(slot)  # the probe's tokens were erased: whatever the slot held is gone
        finally:
            self._pool.give_back(slot)
        fingerprint = kv_fingerprint(self._base, setting)
        if fingerprint != self.fingerprint:
            log.warning("the backend restarted with other KV settings (fingerprint %s, was %s): states saved before "
                        "are not restored under them", fingerprint, self.fingerprint)
        else:
            log.info("the backend restarted with the same KV settings: states saved before are restored again")
        self.fingerprint = fingerprint
        self._apply(fingerprint)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
