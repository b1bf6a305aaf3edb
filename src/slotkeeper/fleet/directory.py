"""The session directory that several slotkeeper replicas share, in Redis or Valkey: which backend owns each session,
which replica holds its lease, and how many active sessions each backend has.

Each replica runs beside its own llama-servers (it needs their slot files) and announces them in a heartbeat. Any
replica takes any request: the directory says where the request's session runs, and a replica that is not the one
forwards it there (web/replicas.py). The replica a session runs on holds its lease: a key with a time to live and a
fencing token from a counter that only grows. A lease is taken only where none is held (one Lua script: check, count,
set), so no two replicas ever hold one session's lease at once; its holder refreshes it while the session is active
and gives it up after. Saves uploaded to the shared tier carry the token, and the store's manifest is never replaced
by a save made under an older one (fleet/shared.py): a holder that lost its lease (it stalled, or could not reach
Redis) cannot overwrite its successor's state. The tokens outlive a Redis restart only with persistence (AOF).

When Redis does not answer, the replica says so once and places sessions among its own backends, as without a
directory; its heartbeat tries again every HEARTBEAT_SECONDS, and the directory is used again once it answers.

The keys, what each holds, and the reading of what Redis returns: directorydata.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from slotkeeper.fleet.directorydata import (
    _PREFIX,
    _REFRESH,
    _RELEASE,
    _TAKE,
    _owner,
    _quote,
    _Seen,
    _text,
    _without_password,
    backend_of,
    member,
    parse_holder,
)
from slotkeeper.fleet.placement import ACTIVE_SECONDS, FORGET_SECONDS, Choice, Placement
from slotkeeper.urls import is_base_url

try:
    from redis.exceptions import ConnectionError as LostConnection
except ImportError:  # without the optional extra there is no directory, and nothing raises this
    LostConnection = OSError  # type: ignore[misc,assignment]

log = logging.getLogger("slotkeeper.directory")
T = TypeVar("T")

HEARTBEAT_SECONDS = 2.0
REPLICA_TTL_MS = 6000  # three heartbeats missed: the replica and its backends count as gone
LEASE_MS = 15000
OP_SECONDS = 0.5  # one Redis command waits this long for its answer
# A directory call (a request's route, a heartbeat) takes at most this long in all: its commands, the placement lock
# (waited for at most LOCK_WAIT_SECONDS, then placed without it) and one retry on new connections. Past it the
# request goes on without the directory.
CALL_SECONDS = 1.0
LOCK_WAIT_SECONDS = 0.25
FENCE_SECONDS = 7 * 86400


@dataclass(frozen=True)
class BackendView:
    """One backend as its replica announces it."""

    url: str
    up: bool
    draining: bool = False


# The backends of this replica per model, as they are now (given by the web layer).
LocalView = Callable[[], Mapping[str, Sequence[BackendView]]]


@dataclass(frozen=True)
class Route:
    """Where a turn runs: here (`local`, on `backend`, under the lease of `token`: None when this replica runs it
    without the lease) or on another replica, which chooses its own backend. `hand_over`: the token of the lease
    this replica still holds on a session that moves to another replica; the caller gives it up (`give_up`) once
    the session's latest turn is where the other replica will look for it."""

    local: bool
    replica: str
    backend: str | None
    token: int | None
    why: str
    hand_over: int | None = None


@dataclass
class _Held:
    token: int
    used: float


class Directory:
    """This replica's client of the session directory (one per slotkeeper, over all its models)."""

    def __init__(self, url: str, replica: str, local: LocalView, load_factor: float, redis: Any = None,
                 allows: Callable[[str], bool] = is_base_url,
                 running: Callable[[str, str], bool] = lambda model, session: False) -> None:
        if redis is None:
            import redis.asyncio as aioredis  # the optional extra slotkeeper[directory]

            redis = aioredis.Redis.from_url(url, socket_timeout=OP_SECONDS, socket_connect_timeout=OP_SECONDS)
        self._redis = redis
        self.url = _without_password(url)  # as logged and shown
        self.replica = replica
        # Which replica URLs read from Redis may be used (peers.py): others are left out, as if not announced.
        self._allows = allows
        self._refused: set[str] = set()  # replicas left out, each logged once
        # Whether a turn of (model, session) runs on this replica now: its lease is kept for as long as it runs.
        self._running = running
        self._local = local
        self.load_factor = load_factor
        self._take = redis.register_script(_TAKE)
        self._refresh = redis.register_script(_REFRESH)
        self._release_script = redis.register_script(_RELEASE)
        # The other replicas' announcements: replica -> model -> backends.
        self._others: dict[str, dict[str, list[BackendView]]] = {}
        self._held: dict[tuple[str, str], _Held] = {}
        self._placements: dict[tuple[str, ...], Placement] = {}
        self._shunned: dict[str, float] = {}  # replica -> monotonic time until which no request is forwarded to it
        self.down = False
        self.forwarded = 0  # requests sent to another replica
        self.leases_taken = 0
        self.leases_lost = 0

    # -- keys -------------------------------------------------------------------------------------------------

    @staticmethod
    def _key(kind: str, *parts: str) -> str:
        return _PREFIX + ":".join((kind, *(_quote(p) for p in parts)))

    # -- membership and heartbeat -----------------------------------------------------------------------------

    async def run(self) -> None:
        """The heartbeat: announce this replica, read the others, keep the leases of active sessions."""
        while True:
            await self.beat()
            await asyncio.sleep(HEARTBEAT_SECONDS)

    async def beat(self) -> bool:
        """One heartbeat; False when Redis did not answer (then this replica places sessions by itself)."""
        try:
            await self._call(self._beat)
        except Exception as exc:  # Redis down, slow, restarting: never the end of the heartbeat
            await self._failed(exc)
            return False
        self._answered()
        return True

    async def _call(self, run: Callable[[], Awaitable[T]]) -> T:
        """`run` within CALL_SECONDS in all; once more on new connections when a pooled one was closed under it (a
        Redis restart closes them all, and each fails at its next use)."""
        async with asyncio.timeout(CALL_SECONDS):
            try:
                return await run()
            except LostConnection:
                await self._redis.connection_pool.disconnect()
                return await run()

    async def _beat(self) -> None:
        models = {m: [{"url": b.url, "up": b.up, "draining": b.draining} for b in bs]
                  for m, bs in self._local().items()}
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._key("replica", self.replica), json.dumps({"models": models, "at": time.time()}),
                     px=REPLICA_TTL_MS)
            pipe.sadd(_PREFIX + "replicas", self.replica)
            pipe.smembers(_PREFIX + "replicas")
            _, _, members = await pipe.execute()
        others = sorted(r for r in (_text(m) for m in members) if r is not None and r != self.replica
                        and self._allowed(r))
        announced = await self._redis.mget([self._key("replica", r) for r in others]) if others else []
        seen: dict[str, dict[str, list[BackendView]]] = {}
        for replica, raw in zip(others, announced, strict=True):
            if raw is None:
                await self._redis.srem(_PREFIX + "replicas", replica)
                continue
            try:
                data = json.loads(raw)
                seen[replica] = {str(m): [BackendView(str(b["url"]), bool(b["up"]), bool(b.get("draining")))
                                          for b in bs] for m, bs in data["models"].items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("replica %s announces something unreadable; it is left out", replica)
        for replica in set(self._others) - set(seen):
            log.info("replica %s is gone (no heartbeat for %.0f s): its backends take no sessions", replica,
                     REPLICA_TTL_MS / 1000)
        for replica in set(seen) - set(self._others):
            log.info("replica %s joined with %s", replica,
                     "; ".join(f"{m}: {len(bs)} backend(s)" for m, bs in seen[replica].items()))
        self._others = seen
        await self._keep_leases()

    def _allowed(self, replica: str) -> bool:
        if self._allows(replica):
            return True
        if replica not in self._refused and len(self._refused) < 1024:
            self._refused.add(replica)
            log.warning("the directory names replica %r, which is not on the allow-list (--replica) or not an "
                        "http(s) base URL: it is left out, and nothing is forwarded to it", replica[:200])
        return False

    async def _keep_leases(self) -> None:
        """Refresh the leases of sessions active here (a turn ran within ACTIVE_SECONDS, or one runs now, however
        long), and give the others up. A lease given up is dropped from `_held` whatever happened meanwhile: a
        route that used it while the release ran leaves its turn without a lease (its save keeps the version it
        had, version.py), and the session's next route takes one anew."""
        now = time.time()
        items = []
        for (model, session), held in list(self._held.items()):
            if self._running(model, session):
                held.used = now  # a long turn counts as active until it ends
            items.append(((model, session), held, now - held.used < ACTIVE_SECONDS))
        if not items:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for (model, session), held, keep in items:
                holder = f"{self.replica}|{held.token}"
                if keep:
                    await self._refresh(keys=[self._key("lease", model, session)], args=[holder, LEASE_MS],
                                        client=pipe)  # queued: the pipeline runs them in one round trip
                else:
                    await self._release_script(keys=[self._key("lease", model, session)], args=[holder], client=pipe)
            results = await pipe.execute()
        for ((model, session), held, keep), kept in zip(items, results, strict=True):
            if self._held.get((model, session)) is not held:
                continue  # replaced meanwhile
            if not keep:
                del self._held[(model, session)]
                log.info("lease given up: session %s/%s, fencing token %d, replica %s (idle for %.0f s)", model,
                         session, held.token, self.replica, now - held.used)
            elif not kept:
                del self._held[(model, session)]
                self.leases_lost += 1
                log.warning("lease lost: session %s/%s, fencing token %d, replica %s: it expired before it could "
                            "be refreshed; a save under a newer lease elsewhere now wins over this replica's",
                            model, session, held.token, self.replica)

    async def _failed(self, exc: BaseException) -> None:
        # Pooled connections may be broken (a Redis restart closed them): the next call opens new ones.
        with contextlib.suppress(Exception):
            await self._redis.connection_pool.disconnect()
        if not self.down:
            self.down = True
            log.warning("the session directory %s does not answer (%s): this replica places sessions among its own "
                        "backends until it does; no request waits for it", self.url,
                        str(exc) or type(exc).__name__)

    def _answered(self) -> None:
        if self.down:
            self.down = False
            log.info("the session directory %s answers again: sessions are placed over every replica's backends",
                     self.url)

    def _cluster(self, model: str) -> dict[str, tuple[str, BackendView]]:
        """Every backend of `model` that a live replica announces, by its name in the directory (see `member`) ->
        (its replica, how it is)."""
        found: dict[str, tuple[str, BackendView]] = {}
        for replica, models in self._others.items():
            for backend in models.get(model, ()):
                found[member(replica, backend.url)] = (replica, backend)
        for backend in self._local().get(model, ()):
            found[member(self.replica, backend.url)] = (self.replica, backend)
        return found

    def _placement(self, members: Sequence[str]) -> Placement:
        key = tuple(members)
        placement = self._placements.get(key)
        if placement is None:
            if len(self._placements) > 64:
                self._placements.clear()
            placement = self._placements[key] = Placement(members, self.load_factor)
        return placement

    def shun(self, replica: str) -> None:
        """A forward to `replica` was refused: send it nothing until its heartbeat could have said otherwise."""
        self._shunned[replica] = time.monotonic() + REPLICA_TTL_MS / 1000

    def _reachable(self, replica: str) -> bool:
        return replica == self.replica or (replica in self._others
                                           and self._shunned.get(replica, 0.0) <= time.monotonic())

    # -- routing ----------------------------------------------------------------------------------------------

    def fence(self, model: str, session: str) -> int | None:
        """The fencing token of this replica's lease on the session, if it holds one."""
        held = self._held.get((model, session))
        return None if held is None else held.token

    async def route(self, model: str, session: str, ring_key: str, side: bool = False, local_only: bool = False,
                    exclude: Collection[str] = ()) -> Route | None:
        """Where a request of `session` runs now. `local_only`: on this replica's backends (a request another
        replica forwarded here, or one whose owner's replica refused it). None when the directory does not answer:
        the request is placed as without one."""
        if self.down:
            return None
        try:
            return await self._call(lambda: self._route(model, session, ring_key, side, local_only, exclude))
        except Exception as exc:
            await self._failed(exc)
            return None

    async def _route(self, model: str, session: str, ring_key: str, side: bool, local_only: bool,
                     exclude: Collection[str]) -> Route:
        now = time.time()
        cluster = self._cluster(model)
        members = sorted(cluster)
        seen = await self._read(model, session, members, now)
        elsewhere = self._holder_elsewhere(seen.holder, local_only)
        if elsewhere is not None:
            return Route(False, elsewhere, None, None, "its lease is held there")
        mine = [b for b in members if cluster[b][0] == self.replica]
        if side:  # a title or tags request: where its conversation is, owning nothing
            at = seen.owner if seen.owner in cluster and cluster[seen.owner][1].up else None
            if at is not None and cluster[at][0] != self.replica and not local_only and self._reachable(
                    cluster[at][0]):
                return Route(False, cluster[at][0], backend_of(at), None, "side task of a session there")
            return Route(True, self.replica, backend_of(at) if at in mine else None, None, "side task")
        pool = mine if local_only else [b for b in members if self._reachable(cluster[b][0])]
        exclude = {member(self.replica, url) for url in exclude}  # this replica's backends, by their URLs
        choice = self._choose(cluster, pool or mine, ring_key, seen, now, exclude)
        recorded = choice.member != seen.owner
        if recorded:
            # A new owner: chosen again and recorded under the model's placement lock, so that replicas placing
            # sessions at once each count the others' choices (and no backend goes past the bound).
            locked = await self._lock(model)
            try:
                seen = await self._read(model, session, members, now)
                elsewhere = self._holder_elsewhere(seen.holder, local_only)
                if elsewhere is not None:
                    return Route(False, elsewhere, None, None, "its lease is held there")
                choice = self._choose(cluster, pool or mine, ring_key, seen, now, exclude)
                await self._record(model, session, choice, now)
            finally:
                await self._unlock(model, locked)
        holder = seen.holder
        replica = cluster[choice.member][0]
        if replica != self.replica:
            mine_still = holder[1] if holder is not None and holder[0] == self.replica else None
            return Route(False, replica, backend_of(choice.member), None, str(choice.why), hand_over=mine_still)
        token = await self._lease(model, session, holder, now)
        if isinstance(token, str):  # another replica took it just now
            if not local_only and self._reachable(token):
                return Route(False, token, None, None, "its lease was taken there")
            token = None
        if token is None:
            log.warning("session %s/%s runs on %s without its lease (held by another replica): its saves are not "
                        "uploaded over the lease holder's", model, session, backend_of(choice.member))
        if not recorded:  # a new owner was recorded under the lock; an owner kept: its last turn's time now
            await self._record(model, session, choice, now)
        return Route(True, self.replica, backend_of(choice.member), token, str(choice.why))

    async def _read(self, model: str, session: str, members: Sequence[str], now: float) -> _Seen:
        """The session's lease and owner and each backend's active sessions: one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.get(self._key("lease", model, session))
            pipe.get(self._key("owner", model, session))
            for backend in members:
                pipe.zcount(self._key("active", model, backend), now - ACTIVE_SECONDS, "+inf")
            lease, owned, *counts = await pipe.execute()
        owner, used = _owner(owned)
        return _Seen(parse_holder(lease), owner, used, dict(zip(members, (int(c) for c in counts), strict=True)))

    def _holder_elsewhere(self, holder: tuple[str, int] | None, local_only: bool) -> str | None:
        """The other live replica holding the lease, when the request should go there."""
        if holder is not None and holder[0] != self.replica and not local_only and self._reachable(holder[0]):
            return holder[0]
        return None

    def _choose(self, cluster: Mapping[str, tuple[str, BackendView]], pool: Sequence[str], ring_key: str,
                seen: _Seen, now: float, exclude: Collection[str]) -> Choice:
        placement = self._placement(pool)
        placement.draining = {b for b in pool if cluster[b][1].draining}
        previous = seen.owner if seen.owner in placement.members else None
        active = previous is not None and now - seen.used < ACTIVE_SECONDS
        up = [b for b in pool if cluster[b][1].up]
        # An owner that serves keeps its session: the bound applies to new and moving sessions only. The replicas see
        # each other's backends a heartbeat late, so a bound they computed apart could move a session to and fro.
        return placement.choose(ring_key, previous, active, seen.loads, up, exclude, sticky=True)

    async def _lock(self, model: str) -> str | None:
        """The model's placement lock (held 1 s at most); None when it could not be had within LOCK_WAIT_SECONDS (the
        placement then goes on without it)."""
        token = f"{self.replica}|{secrets.token_hex(8)}"
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while time.monotonic() < deadline:
            if await self._redis.set(self._key("placing", model), token, nx=True, px=1000):
                return token
            await asyncio.sleep(0.005)
        return None

    async def _unlock(self, model: str, token: str | None) -> None:
        if token is not None:
            await self._release_script(keys=[self._key("placing", model)], args=[token])

    async def _lease(self, model: str, session: str, holder: tuple[str, int] | None, now: float) -> int | str | None:
        """This replica's token for the session's lease, taken when no one holds it; the holder's name when another
        replica took it; None when another holds it (a forwarded request, or its holder cannot be reached)."""
        held = self._held.get((model, session))
        if holder is not None and holder[0] == self.replica:
            if held is not None and held.token == holder[1]:
                held.used = now
                return held.token
            # Ours in Redis but not in memory (a restart of this replica within the lease): give it up, take anew.
            await self._release_script(keys=[self._key("lease", model, session)],
                                       args=[f"{self.replica}|{holder[1]}"])
        elif holder is not None:
            return None
        if held is not None:  # ours in memory, gone in Redis: it expired
            del self._held[(model, session)]
            self.leases_lost += 1
            log.warning("lease lost: session %s/%s, fencing token %d, replica %s: it expired before it could be "
                        "refreshed", model, session, held.token, self.replica)
        taken = parse_holder(await self._take(
            keys=[self._key("lease", model, session), self._key("fence", model, session)],
            args=[self.replica, LEASE_MS, FENCE_SECONDS]))
        if taken is None:
            return None
        if taken[0] != self.replica:
            return taken[0]
        self._held[(model, session)] = _Held(taken[1], now)
        self.leases_taken += 1
        log.info("lease taken: session %s/%s, fencing token %d, replica %s", model, session, taken[1], self.replica)
        return taken[1]

    async def give_up(self, model: str, session: str, token: int, why: str) -> None:
        """Give up this replica's lease of `token` on the session (a route's `hand_over`). When the directory does
        not answer, the lease expires in LEASE_MS and the other replica forwards here until then."""
        if self.down:
            return
        try:
            await self._call(lambda: self._give_up(model, session, token, why))
        except Exception as exc:
            await self._failed(exc)

    async def _give_up(self, model: str, session: str, token: int, why: str) -> None:
        await self._release_script(keys=[self._key("lease", model, session)], args=[f"{self.replica}|{token}"])
        self._held.pop((model, session), None)
        log.info("lease given up: session %s/%s, fencing token %d, replica %s (%s)", model, session, token,
                 self.replica, why)

    async def _record(self, model: str, session: str, choice: Choice, now: float) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._key("owner", model, session), json.dumps({"backend": choice.member, "used": now}),
                     ex=int(FORGET_SECONDS))
            active = self._key("active", model, choice.member)
            pipe.zadd(active, {session: now})
            if choice.previous is not None and choice.previous != choice.member:
                pipe.zrem(self._key("active", model, choice.previous), session)
            if int(now) % 64 == 0:  # now and then: sessions idle for a day leave the set
                pipe.zremrangebyscore(active, "-inf", now - FORGET_SECONDS)
            await pipe.execute()

    async def close(self) -> None:
        """Give every lease up and leave (the other replicas stop forwarding here at once)."""
        try:
            async with asyncio.timeout(OP_SECONDS * 4):
                for (model, session), held in list(self._held.items()):
                    await self._give_up(model, session, held.token, "slotkeeper stops")
                await self._redis.delete(self._key("replica", self.replica))
                await self._redis.srem(_PREFIX + "replicas", self.replica)
        except Exception as exc:
            log.warning("leaving the session directory failed (%s); this replica's leases expire in %.0f s",
                        str(exc) or type(exc).__name__, LEASE_MS / 1000)
        await self._redis.aclose()

    @property
    def replica_count(self) -> int:
        return len(self._others) + 1

    @property
    def leases_held(self) -> int:
        return len(self._held)

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "replica": self.replica, "up": not self.down, "replicas": sorted(self._others),
                "leases_held": len(self._held), "forwarded": self.forwarded}
