"""Keeps a server process that slotkeeper started running: when it exits on its own (a crash, an OOM kill, a kill -9),
the BackendHealth is marked down (requests wait for it) and what the slots held is forgotten; the process is started
again with a growing delay until /health answers, and the health is marked up.

Stopping on purpose is not a crash: cancel the supervisor's task first, then stop the process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from slotkeeper.upstream.health import BackendHealth
from slotkeeper.upstream.process import ServerProcess, ServerStartError, describe_exit

log = logging.getLogger("slotkeeper.supervisor")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before restart n (0-based) of a run of failures: first, 2 x first, 4 x first ... at most `cap`. A server
    that ran `stable_after` seconds before it exited starts a new run at `first`."""

    first: float = 1.0
    cap: float = 30.0
    stable_after: float = 60.0

    def delay(self, failures: int) -> float:
        return float(min(self.cap, self.first * 2 ** min(failures, 32)))


class Supervisor:
    """Watches one ServerProcess; `restarts` counts the restarts that came up healthy."""

    def __init__(self, server: ServerProcess, *, ready_timeout: float, health: BackendHealth,
                 on_lost: Callable[[str], None], backoff: Backoff | None = None) -> None:
        """`on_lost(reason)` is called when the process exited: what its slots held is gone with it."""
        self.server = server
        self._ready_timeout = ready_timeout
        self._health = health
        self._on_lost = on_lost
        self._backoff = backoff or Backoff()
        self._failures = 0
        self.restarts = 0
        self.last_exit: str | None = None

    async def run(self) -> None:
        while True:
            code = await self.server.wait_exit()
            ran = time.monotonic() - self.server.started_at
            if ran >= self._backoff.stable_after:
                self._failures = 0
            self.last_exit = describe_exit(code)
            log.error("%s (pid %s) exited with %s after %.0f s; slotkeeper restarts it (its output is in %s)",
                      self.server.name, self.server.pid, self.last_exit, ran, self.server.log_path)
            reason = f"{self.server.name} exited with {self.last_exit}"
            self._health.mark_down(reason, lost=True)
            self._on_lost(reason)
            await self._restart()

    async def _restart(self) -> None:
        """Start the server again, with backoff, until it answers /health."""
        while True:
            delay = self._backoff.delay(self._failures)
            self._failures += 1
            await asyncio.sleep(delay)
            try:
                self.server.spawn()
                await self.server.wait_ready(self._ready_timeout)
            except ServerStartError as exc:
                log.error("restarting %s failed (trying again in %.0f s): %s", self.server.name,
                          self._backoff.delay(self._failures), exc)
                await self.server.stop(5.0)
                continue
            self.restarts += 1
            log.warning("%s is back (pid %s) after %d restart(s); the slots' old contents are gone, sessions restore "
                        "from disk", self.server.name, self.server.pid, self.restarts)
            self._health.mark_up()  # unless the watch saw it first
            return
