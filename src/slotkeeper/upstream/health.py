"""Whether the backend is up: the one answer the watch (probes), the supervisor (a crash, a restart) and the service
(requests wait for it) share.

What counts as down: a refused connection, an error answer to /health (503 while a model loads), a crash the
supervisor saw, or `FAILURES_TO_DOWN` probes in a row that time out or break. One slow probe is not an outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from enum import Enum

from slotkeeper.errors import UpstreamUnavailable

log = logging.getLogger("slotkeeper.watch")

# Probes in a row that time out (or break) before a backend that does answer connections is taken for down.
FAILURES_TO_DOWN = 3
# How often a waiting request checks whether its client hung up.
HANGUP_POLL_SECONDS = 0.25


class Probe(Enum):
    """One /health probe: answered 200; refused (nothing listens); answered an error status (not ready: a fresh
    process loading its model); or timed out / broke (a slow server, or a dying one)."""

    OK = "ok"
    REFUSED = "refused"
    NOT_READY = "not ready"
    NO_ANSWER = "no answer"


class BackendHealth:
    """Up or down, and why. `lost` says that during this outage the backend's slot contents are known to be gone
    (the supervisor saw the process exit, or nothing was listening); a backend that was only slow keeps them."""

    def __init__(self, url: str, failures_to_down: int = FAILURES_TO_DOWN) -> None:
        self.url = url
        self.up = True
        self.outages = 0
        self.reason: str | None = None
        self.lost = False
        self.refused = False
        # Bumped on every change: a probe that took an await decides nothing if the state changed meanwhile.
        self.changes = 0
        # Bumped each time it comes back: what was read of the backend before then may be of another process.
        self.recoveries = 0
        self._failures_to_down = failures_to_down
        self._failures = 0
        self._back = asyncio.Event()
        self._back.set()

    def probed(self, probe: Probe) -> None:
        """Take one probe's result: down at once on a refusal or an error answer, after a few in a row that get no
        answer. An OK probe ends a run of failures but does not bring a down backend up (see mark_up)."""
        if probe is Probe.OK:
            self._failures = 0
            return
        self._failures += 1
        self.refused = self.refused or probe is Probe.REFUSED
        if probe is Probe.NO_ANSWER and self._failures < self._failures_to_down:
            if self.up:
                log.info("the backend at %s did not answer /health in time (%d of %d before it counts as down)",
                         self.url, self._failures, self._failures_to_down)
            return
        if self.up:
            how = {Probe.REFUSED: "refuses connections", Probe.NOT_READY: "answers /health with an error",
                   Probe.NO_ANSWER: f"did not answer /health {self._failures} times in a row"}[probe]
            log.warning("the backend at %s %s: it counts as down; requests wait up to the backend wait for it",
                        self.url, how)
        self.mark_down(probe.value)

    def mark_down(self, reason: str, *, lost: bool = False) -> None:
        """The backend is gone (`lost`: and what its slots held with it, as when its process exited)."""
        self.lost = self.lost or lost
        if not self.up:
            return
        self.up = False
        self.reason = reason
        self.outages += 1
        self.changes += 1
        self._back.clear()

    def mark_up(self) -> None:
        """The backend serves again: waiting requests go on."""
        if self.up:
            return
        self.up = True
        self.reason = None
        self.lost = self.refused = False
        self._failures = 0
        self.changes += 1
        self.recoveries += 1
        self._back.set()

    async def wait_up(self, timeout: float | None = None,
                      hung_up: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Return once the backend is up; raise UpstreamUnavailable after `timeout` seconds (None: no bound, for
        background work) or as soon as `hung_up` says the client went away."""
        if self.up:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.up:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise UpstreamUnavailable(f"the backend at {self.url} is not answering and did not come back within "
                                          f"{timeout:g} s; try again shortly")
            step = left if hung_up is None else min(HANGUP_POLL_SECONDS, left or HANGUP_POLL_SECONDS)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._back.wait(), step)
            if not self.up and hung_up is not None and await hung_up():
                raise UpstreamUnavailable(f"the backend at {self.url} is not answering (the client hung up while "
                                          "waiting for it)")
