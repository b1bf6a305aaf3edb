"""The supervisor's rules with a stand-in process: backoff growth and reset, the backend's health marked down (slots
lost) at a crash and up once restarted, counting, failed restarts retried, and cancellation (a stop on purpose is
never taken for a crash)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from slotkeeper.upstream.health import BackendHealth
from slotkeeper.upstream.process import ServerStartError
from slotkeeper.upstream.supervisor import Backoff, Supervisor


@pytest.mark.parametrize(
    ("failures", "delay"),
    [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (4, 16.0), (5, 30.0), (6, 30.0), (100, 30.0), (10_000, 30.0)],
)
def test_backoff_doubles_up_to_the_cap(failures: int, delay: float) -> None:
    assert Backoff().delay(failures) == delay


class FakeServer:
    """Exits when told to; each spawn may be made to fail."""

    name = "fake-server"
    log_path = Path("/nonexistent/fake.log")

    def __init__(self, fail_starts: int = 0, ran_for: float = 0.0) -> None:
        self.pid = 100
        self.started_at = time.monotonic() - ran_for
        self.spawns = 0
        self.stops = 0
        self._fail_starts = fail_starts
        self._exited: asyncio.Event = asyncio.Event()
        self.spawn_times: list[float] = []

    def crash(self) -> None:
        self._exited.set()

    async def wait_exit(self) -> int:
        await self._exited.wait()
        return -9

    def spawn(self) -> None:
        self.spawns += 1
        self.spawn_times.append(time.monotonic())
        self.pid += 1
        self.started_at = time.monotonic()
        self._exited = asyncio.Event()

    async def wait_ready(self, timeout: float) -> None:
        if self._fail_starts:
            self._fail_starts -= 1
            self._exited.set()
            raise ServerStartError("fake-server exited with code 1 before it was ready")

    async def stop(self, timeout: float) -> None:
        self.stops += 1


class RecordingHealth(BackendHealth):
    """Notes every change of the backend's health in `events`."""

    def __init__(self, events: list[str]) -> None:
        super().__init__("http://fake")
        self.events = events

    def mark_down(self, reason: str, *, lost: bool = False) -> None:
        if self.up:
            self.events.append(f"down: {reason}" + (" (lost)" if lost else ""))
        super().mark_down(reason, lost=lost)

    def mark_up(self) -> None:
        if not self.up:
            self.events.append("up")
        super().mark_up()


def supervise(server: FakeServer, events: list[str], backoff: Backoff) -> Supervisor:
    fake: Any = server
    return Supervisor(fake, ready_timeout=5, health=RecordingHealth(events),
                      on_lost=lambda reason: events.append("slots lost"), backoff=backoff)


async def until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_crash_is_reported_restarted_and_counted() -> None:
    server, events = FakeServer(), []
    supervisor = supervise(server, events, Backoff(first=0.01))
    task = asyncio.create_task(supervisor.run())
    server.crash()
    await until(lambda: supervisor.restarts == 1)
    assert events == ["down: fake-server exited with signal SIGKILL (lost)", "slots lost", "up"]
    assert (server.spawns, supervisor.last_exit) == (1, "signal SIGKILL")
    server.crash()
    await until(lambda: supervisor.restarts == 2)
    assert events[3:] == ["down: fake-server exited with signal SIGKILL (lost)", "slots lost", "up"]
    task.cancel()


async def test_failed_restarts_are_retried_with_growing_delays() -> None:
    server, events = FakeServer(fail_starts=2), []
    supervisor = supervise(server, events, Backoff(first=0.05, cap=1.0))
    task = asyncio.create_task(supervisor.run())
    crashed = time.monotonic()
    server.crash()
    await until(lambda: supervisor.restarts == 1)
    task.cancel()
    # one outage, however many attempts
    assert events == ["down: fake-server exited with signal SIGKILL (lost)", "slots lost", "up"]
    assert (server.spawns, server.stops) == (3, 2)  # two failed starts stopped, the third came up
    first, second, third = (t - crashed for t in server.spawn_times)
    assert first >= 0.05 and second - first >= 0.1 and third - second >= 0.2


class RecordingBackoff(Backoff):
    """Remembers the failure count of each delay it was asked for."""

    asked: ClassVar[list[int]] = []

    def delay(self, failures: int) -> float:
        self.asked.append(failures)
        return super().delay(failures)


async def test_a_server_that_ran_long_enough_restarts_after_the_first_delay_again() -> None:
    server, events = FakeServer(), []
    backoff = RecordingBackoff(first=0.02, cap=10.0, stable_after=0.3)
    RecordingBackoff.asked.clear()
    supervisor = supervise(server, events, backoff)
    task = asyncio.create_task(supervisor.run())
    for expected in (1, 2, 3):  # quick crashes: a growing delay
        server.crash()
        await until(lambda expected=expected: supervisor.restarts == expected)
    await asyncio.sleep(0.35)  # now it runs stably
    server.crash()
    await until(lambda: supervisor.restarts == 4)
    task.cancel()
    assert backoff.asked == [0, 1, 2, 0]


async def test_cancelling_the_supervisor_is_not_a_crash() -> None:
    server, events = FakeServer(), []
    supervisor = supervise(server, events, Backoff(first=0.01))
    task = asyncio.create_task(supervisor.run())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    server.crash()
    await asyncio.sleep(0.05)
    assert (events, server.spawns, supervisor.restarts) == ([], 0, 0)
