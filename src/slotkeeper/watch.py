"""Watches the backend for lost slot states: /health going away and coming back, or slots that show no task.

llama-server restarted underneath us holds nothing, so nothing it held may be trusted as "hot" any more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from slotkeeper.cache.pool import SlotPool
from slotkeeper.errors import SlotkeeperError
from slotkeeper.upstream.client import UpstreamClient

log = logging.getLogger("slotkeeper.watch")


class BackendWatch:
    def __init__(self, client: UpstreamClient, pool: SlotPool, on_change: Callable[[bool], None] | None = None,
                 interval: float = 1.0) -> None:
        self._client = client
        self._pool = pool
        self._on_change = on_change
        self._interval = interval
        self.up = True
        self.outages = 0
        self._changes = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.check()

    async def check(self) -> None:
        observed = self._pool.generations()  # taken before any await: a reset applies only to slots unchanged since
        changes = self._changes  # and a health reading decides nothing if the state changed while it was taken
        healthy = await self._client.healthy()
        if changes != self._changes:
            return
        if not healthy:
            if self.up:
                log.warning("the backend at %s is not answering /health", self._client.base_url)
                self.mark_down()
            return
        if not self.up:
            log.warning("the backend is back; it may have restarted, so no slot state it held is trusted")
            self.mark_up(observed, "the backend was unreachable")
            return
        try:
            slots = await self._client.get_json("/slots", timeout=2.0)
        except SlotkeeperError:
            return
        # A slot that never ran a task since the server started shows no id_task: the server restarted.
        fresh = {int(s["id"]) for s in slots if isinstance(s, dict) and "id_task" not in s}
        if fresh:
            self._pool.reset_slots({i: g for i, g in observed.items() if i in fresh}, "the backend restarted")

    def mark_down(self) -> None:
        """The backend is gone (seen here, or told by the supervisor of a server we started): requests fail fast."""
        if self.up:
            self.up = False
            self.outages += 1
            self._changes += 1
            if self._on_change is not None:
                self._on_change(False)

    def mark_up(self, observed: dict[int, int], reason: str) -> None:
        """The backend answers again: forget what the slots unused since `observed` held, and serve again."""
        if not self.up:
            self.up = True
            self._changes += 1
            if self._on_change is not None:
                self._on_change(True)
            self._pool.reset_slots(observed, reason)
