"""Several slotkeeper replicas behind one address: a turn runs where the session directory says (directory.py), and
a replica that is not that one forwards the request there unchanged and streams the answer back.

A forwarded request is signed by its sender (peers.py): its hop count counts only when the signature checks, so a
client cannot pass its request off as forwarded. It may be forwarded once more (the replica it reached holds the
session's lease and moves the session to another replica's backend, or another replica took the lease meanwhile),
never a third time: a request that has made MAX_HOPS runs on the backends of the replica it reached. A forward that
cannot connect, or whose connection closes before any answer (the replica died before its heartbeat expired, or
with the request), runs here instead, so no request fails because a replica went away between two heartbeats.
Requests are forwarded only to replicas on the allow-list."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from slotkeeper.cache.operations import save_session
from slotkeeper.config import Settings
from slotkeeper.errors import SlotkeeperError
from slotkeeper.fleet.directory import BackendView, Directory
from slotkeeper.fleet.group import MOVE_SAVE_SECONDS, Member, ring_key
from slotkeeper.fleet.peers import HEADERS, Peers
from slotkeeper.fleet.shared import SharedTier
from slotkeeper.types import SessionKey, SnapshotKind
from slotkeeper.web.state import AppState, Backends, Turns

log = logging.getLogger("slotkeeper.replicas")

MAX_HOPS = 2
# How long a session that moves to another replica waits for its latest turn to be saved and uploaded.
HAND_OVER_SECONDS = MOVE_SAVE_SECONDS
# Headers that belong to one connection, never forwarded either way; and the forwarding headers, which only this
# replica's signature may set.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"}) | HEADERS


class Replicas:
    """This replica's part in a set of replicas: the directory and a client to forward requests with."""

    def __init__(self, directory: Directory, read_timeout: float, peers: Peers) -> None:
        self.directory = directory
        self.peers = peers
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout, connect=2.0), trust_env=False)

    async def aclose(self) -> None:
        await self.http.aclose()


def join_replicas(settings: Settings, found: Backends) -> Replicas:
    """This replica's client of the session directory, its backends announced, its saves versioned under its
    leases."""
    assert settings.directory is not None
    assert settings.replica_secret is not None, "Settings.validate requires it with a directory"
    peers = Peers(settings.replica_secret, settings.effective_replica_url(), settings.replicas)
    try:
        directory = Directory(settings.directory, settings.effective_replica_url(), lambda: local_view(found),
                              settings.load_factor, allows=peers.allows,
                              running=lambda model, session: any(state.service.pool.running(model, session)
                                                                 for state in found.all))
    except ImportError:
        raise SlotkeeperError("the session directory needs the redis package: pip install 'slotkeeper[directory]'"
                              ) from None
    for state in found.all:  # a conversation's save is versioned under the lease it was made under (version.py)
        state.service.pool.snapshots.fence = lambda key: directory.fence(key.model, key.session_id)
    log.info("session directory %s: this replica is %s; each session runs on the replica holding its lease, and "
             "requests that reach another replica are forwarded there", directory.url, directory.replica)
    if not settings.replicas:
        log.warning("--directory without --replica: no other replica is on the allow-list, so no request is "
                    "forwarded; every replica serves what reaches it")
    return Replicas(directory, settings.upstream_read_timeout, peers)


def local_view(found: Backends) -> dict[str, list[BackendView]]:
    """This replica's backends per model, as the heartbeat announces them."""
    models: dict[str, list[BackendView]] = {}
    for state in found.all:
        draining = state.group is not None and state.backend.url in state.group.placement.draining
        models.setdefault(state.backend.model_id, []).append(
            BackendView(state.backend.url, state.service.health.up, draining))
    return models


async def turns_for(request: Request, state: AppState, key: SessionKey, side: bool = False) -> Turns | Response:
    """What runs this turn of `state`'s model: this replica's turns (on the backend the directory chose), or the
    answer of the replica the request was forwarded to."""
    replicas: Replicas | None = getattr(request.app.state, "replicas", None)
    if replicas is None:
        return state.turns
    directory = replicas.directory
    hops = hops_of(request, replicas.peers, await request.body())
    route = await directory.route(key.model, key.session_id, ring_key(key), side=side, local_only=hops >= MAX_HOPS)
    if route is not None and route.hand_over is not None:
        await hand_over(state, key, route.replica)
        await directory.give_up(key.model, key.session_id, route.hand_over,
                                f"it moves to {route.backend} on {route.replica}")
    if route is not None and not route.local:
        answer = await _forward(request, replicas, route.replica, hops)
        if answer is not None:
            log.info("session %s: forwarded to replica %s (%s)", key.session_id, route.replica, route.why)
            return answer
        route = await directory.route(key.model, key.session_id, ring_key(key), side=side, local_only=True)
    if route is None or route.backend is None or state.group is None:
        return state.turns

    async def reroute(refused: str) -> str | None:
        again = await directory.route(key.model, key.session_id, ring_key(key), side=side, local_only=True,
                                      exclude={refused})
        return None if again is None else again.backend

    return state.group.pinned(route.backend, reroute)


async def hand_over(state: AppState, key: SessionKey, replica: str) -> None:
    """Before a session whose lease this replica holds moves to `replica`: its latest turn saved on the backend that
    ran it and uploaded to the shared store, where the other replica brings it from. Bounded by HAND_OVER_SECONDS;
    a failure is logged, and the session moves with what the store holds."""
    members: Sequence[Member] = state.group.members if state.group is not None else [state]
    try:
        async with asyncio.timeout(HAND_OVER_SECONDS):
            for member in members:
                await save_session(member.pool, key)
                if isinstance(member.service.shared, SharedTier):
                    await member.service.shared.uploaded(key, SnapshotKind.SESSION)
    except (TimeoutError, SlotkeeperError) as exc:
        log.warning("session %s: handing its latest turn over to replica %s did not finish (%s); it moves with what "
                    "the shared store holds", key.session_id, replica,
                    exc.message if isinstance(exc, SlotkeeperError) else f"over {HAND_OVER_SECONDS:g} s")


def hops_of(request: Request, peers: Peers, body: bytes = b"") -> int:
    """How many times the request was forwarded before it reached this replica: the signed count of a request
    another replica of the set forwarded (its `body` among what is signed), else 0 (a client's request, whatever
    headers it sent)."""
    forwarding = peers.forwarding(request.method, _target(request), request.headers, body=body)
    return 0 if forwarding is None else forwarding.hops


def _target(request: Request) -> str:
    return request.url.path + (f"?{request.url.query}" if request.url.query else "")


class _Relayed(StreamingResponse):
    """Another replica's streamed answer, relayed: its connection is closed however the relay ends, also when the
    client left before the first byte (then the body is never iterated)."""

    def __init__(self, answer: httpx.Response, replica: str) -> None:
        super().__init__(self._body(answer, replica), status_code=answer.status_code)
        self._answer = answer

    @staticmethod
    async def _body(answer: httpx.Response, replica: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:  # the connection to the client is broken off too: the answer is not whole
            log.warning("replica %s broke off a forwarded answer (%s)", replica, str(exc) or type(exc).__name__)
            raise

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._answer.aclose()


async def _forward(request: Request, replicas: Replicas, replica: str, hops: int) -> Response | None:
    """The request sent to `replica` as it came (signed as forwarded by this one), its answer streamed back; None
    when the replica is not on the allow-list or refuses it."""
    if not replicas.peers.allows(replica):
        log.warning("the directory names replica %s, which is not on this replica's allow-list (--replica): the "
                    "request runs here, and nothing is sent there", replica[:200])
        return None
    target = _target(request)
    headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _HOP]
    body = await request.body()
    headers += replicas.peers.signed(request.method, target, hops + 1, body=body)
    sent = replicas.http.build_request(request.method, replica + target, headers=headers, content=body)
    try:
        answer = await replicas.http.send(sent, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
        # Refused, or the connection closed before any answer (the replica died with the request): nothing of it
        # reached the client, so it runs here.
        replicas.directory.shun(replica)
        log.warning("replica %s refused a forwarded request (%s): it runs here, and nothing is forwarded there "
                    "until its heartbeat says it is back", replica, str(exc) or type(exc).__name__)
        return None
    replicas.directory.forwarded += 1
    back = [(k, v) for k, v in answer.headers.raw if k.decode("latin-1").lower() not in _HOP - {"content-length"}]
    response = _Relayed(answer, replica)
    response.raw_headers = [*back, (b"x-slotkeeper-replica", replica.encode())]
    return response
