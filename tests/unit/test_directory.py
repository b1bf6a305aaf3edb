"""The session directory's rules against a real redis-server on loopback (Debian's, persisting with AOF): where a
session runs among several replicas' backends, its lease and fencing token, a holder that stops, a lease lost while
Redis was away, and a Redis that is down or restarted. The replicas are Directory objects with made-up backends;
tests/integration/test_replicas.py runs whole slotkeeper replicas over real llama.cpp servers."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from typing import Any

import pytest

from slotkeeper.fleet import directory as directory_module
from slotkeeper.fleet.directory import BackendView, Directory, Route
from tests.support import RedisServer

MODEL = "m"
R1, R2 = "http://replica-1:11434", "http://replica-2:11434"
B1, B2, B3 = "http://gpu-1:8080", "http://gpu-2:8080", "http://gpu-3:8080"


class Replica:
    """A Directory with backends of its own whose health a test sets."""

    def __init__(self, url: str, redis_url: str, backends: list[str], **options: Any) -> None:
        self.backends = {b: True for b in backends}
        self.directory = Directory(redis_url, url, lambda: {MODEL: [BackendView(b, up) for b, up in
                                                                  self.backends.items()]}, 1.25, **options)

    async def run(self, session: str, ring_key: str | None = None, local_only: bool = False) -> Route | None:
        return await self.directory.route(MODEL, session, ring_key or session, local_only=local_only)


async def serve(replicas: tuple[Replica, ...], entry: Replica, session: str) -> tuple[Replica, Route]:
    """Send a turn of `session` to `entry`, then, as web/replicas.py does, to the replica it names."""
    route = await entry.run(session)
    assert route is not None
    if route.local:
        return entry, route
    target = next(r for r in replicas if r.directory.replica == route.replica)
    forwarded = await target.run(session, local_only=True)
    assert forwarded is not None and forwarded.local
    return target, forwarded


async def test_a_session_runs_where_its_lease_is_and_sessions_spread_within_the_bound(
        replicas: tuple[Replica, Replica]) -> None:
    one, two = replicas
    placed: dict[str, str] = {}
    for i in range(12):
        runner, route = await serve(replicas, (one, two)[i % 2], f"s{i}")
        assert route.token == 1  # each session's first lease
        assert route.backend in runner.backends
        placed[f"s{i}"] = str(route.backend)
    loads = Counter(placed.values())
    assert set(loads) == {B1, B2, B3} and max(loads.values()) <= math.ceil(1.25 * 12 / 3), loads
    # Later turns: the replica without the lease forwards to the holder, who keeps the backend and the token.
    for i in range(12):
        for entry in (one, two):
            runner, route = await serve(replicas, entry, f"s{i}")
            assert route.backend == placed[f"s{i}"] and route.token == 1
            assert runner.directory.fence(MODEL, f"s{i}") == 1
    assert one.directory.leases_taken + two.directory.leases_taken == 12


async def test_a_replica_that_stops_gives_its_leases_up_and_the_next_holder_gets_a_newer_token(
        replicas: tuple[Replica, Replica], redis_server: RedisServer) -> None:
    one, two = replicas
    sessions = [f"s{i}" for i in range(9)]
    held_by_two = []
    for session in sessions:
        runner, _ = await serve(replicas, one, session)
        if runner is two:
            held_by_two.append(session)
    assert held_by_two
    await two.directory.close()  # gives its leases up and leaves
    assert await one.directory.beat()
    for session in held_by_two:
        route = await one.run(session)
        assert route is not None and route.local and route.backend in (B1, B2)
        assert route.token == 2
    # A new replica-2 (restarted) takes sessions again, each new lease with the next token.
    again = Replica(R2, redis_server.url, [B3])
    assert await again.directory.beat() and await one.directory.beat()
    try:
        runner, route = await serve((one, again), again, "fresh")
        assert route.token == 1
    finally:
        await again.directory.close()


async def test_a_lease_that_expired_is_lost_by_its_holder_and_taken_by_another_with_a_newer_token(
        replicas: tuple[Replica, Replica], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Replica 2 stalls (no heartbeat): its lease runs out, replica 1 takes the session under token 2, and replica
    2, when it wakes up, learns it lost the lease (its uploads are then refused by the store's fencing)."""
    one, two = replicas
    monkeypatch.setattr(directory_module, "LEASE_MS", 300)
    monkeypatch.setattr(directory_module, "REPLICA_TTL_MS", 300)
    session = next(s for s in (f"t{i}" for i in range(40)) if _lands_on(s, B3))
    runner, route = await serve(replicas, one, session)
    assert runner is two and route.token == 1
    assert await two.directory.beat()  # its heartbeat and lease now expire in 0.3 s
    await asyncio.sleep(0.5)
    assert await one.directory.beat()  # replica 2 is gone from its view
    taken = await one.run(session)
    assert taken is not None and taken.local and taken.token == 2 and taken.backend in (B1, B2)
    caplog.set_level(logging.INFO, "slotkeeper.directory")
    assert await two.directory.beat()
    assert two.directory.fence(MODEL, session) is None and two.directory.leases_lost == 1
    assert any("lease lost" in r.message and "fencing token 1" in r.message for r in caplog.records)
    # Back in the view, replica 2 forwards the session to its holder.
    assert await one.directory.beat()
    back = await two.run(session)
    assert back is not None and not back.local and back.replica == R1


def _lands_on(session: str, backend: str) -> bool:
    from slotkeeper.fleet.placement import Placement

    return Placement(sorted([B1, B2, B3])).walk(session)[0] == backend


async def test_an_idle_sessions_lease_is_given_up_and_its_owner_kept(
        replicas: tuple[Replica, Replica], monkeypatch: pytest.MonkeyPatch) -> None:
    one, two = replicas
    runner, route = await serve(replicas, one, "idle")
    monkeypatch.setattr(directory_module, "ACTIVE_SECONDS", 0.0)
    assert await runner.directory.beat()
    assert runner.directory.fence(MODEL, "idle") is None
    monkeypatch.setattr(directory_module, "ACTIVE_SECONDS", 600.0)
    again, later = await serve(replicas, one if runner is two else two, "idle")
    assert again is runner and later.backend == route.backend and later.token == 2


async def test_redis_down_degrades_to_local_placement_and_a_restart_keeps_the_fencing_counters(
        replicas: tuple[Replica, Replica], redis_server: RedisServer) -> None:
    one, two = replicas
    _, first = await serve(replicas, one, "kept")
    redis_server.stop()
    started = time.monotonic()
    assert await one.run("kept") is None  # not an error: the caller places the session by itself
    assert await one.run("other") is None
    assert time.monotonic() - started < 2 * 4 * directory_module.OP_SECONDS
    assert not await one.directory.beat() and one.directory.down
    redis_server.start()  # same port and data dir: the append-only file brings every key back
    assert await one.directory.beat() and await two.directory.beat() and not one.directory.down
    runner, route = await serve(replicas, one, "kept")
    assert route.token == first.token  # its lease survived the restart
    await runner.directory._give_up(MODEL, "kept", int(route.token or 0), "test")
    _, after = await serve(replicas, one, "kept")
    assert after.token == (first.token or 0) + 1  # the counter too: never a token handed out twice


def test_a_password_in_the_directory_url_is_never_shown() -> None:
    from slotkeeper.fleet.directory import _without_password

    assert _without_password("redis://:s3cret@10.0.0.5:6379/0") == "redis://***@10.0.0.5:6379/0"
    assert _without_password("rediss://user:pw@r.lan/1") == "rediss://***@r.lan/1"
    assert _without_password("redis://10.0.0.5:6379/0") == "redis://10.0.0.5:6379/0"


async def test_two_hosts_backends_at_the_same_loopback_url_are_two_backends(redis_server: RedisServer) -> None:
    """Each host's slotkeeper reaches its own llama-server at http://127.0.0.1:8080: the directory tells them apart
    by their replica."""
    local = "http://127.0.0.1:8080"
    one, two = Replica(R1, redis_server.url, [local]), Replica(R2, redis_server.url, [local])
    try:
        assert await one.directory.beat() and await two.directory.beat() and await one.directory.beat()
        runners = Counter()
        for i in range(8):
            runner, route = await serve((one, two), (one, two)[i % 2], f"c{i}")
            assert route.backend == local and route.token == 1
            runners[runner.directory.replica] += 1
        assert set(runners) == {R1, R2} and max(runners.values()) <= math.ceil(1.25 * 8 / 2), runners
    finally:
        await one.directory.close()
        await two.directory.close()
