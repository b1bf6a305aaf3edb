"""Several slotkeeper replicas behind one address: a turn runs where the session directory says (directory.py), and
a replica that is not that one forwards the request there unchanged and streams the answer back.

A forwarded request carries `X-Slotkeeper-Forwarded` (the sender) and `X-Slotkeeper-Hops` (how many times it was
forwarded). It may be forwarded once more (the replica it reached holds the session's lease and moves the session
to another replica's backend, or another replica took the lease meanwhile), never a third time: a request that has
made MAX_HOPS runs on the backends of the replica it reached. A forward that cannot connect (the replica died
before its heartbeat expired) runs here instead, so no request fails because a replica went away between two
heartbeats."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from slotkeeper.config import Settings
from slotkeeper.directory import BackendView, Directory
from slotkeeper.errors import SlotkeeperError
from slotkeeper.group import ring_key
from slotkeeper.types import SessionKey
from slotkeeper.web.state import AppState, Backends, Turns

log = logging.getLogger("slotkeeper.replicas")

FORWARDED = "x-slotkeeper-forwarded"
HOPS = "x-slotkeeper-hops"
MAX_HOPS = 2
# Headers that belong to one connection, never forwarded either way.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length", FORWARDED, HOPS})


class Replicas:
    """This replica's part in a set of replicas: the directory and a client to forward requests with."""

    def __init__(self, directory: Directory, read_timeout: float) -> None:
        self.directory = directory
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout, connect=2.0), trust_env=False)

    async def aclose(self) -> None:
        await self.http.aclose()


def join_replicas(settings: Settings, found: Backends) -> Replicas:
    """This replica's client of the session directory, its backends announced, its saves versioned under its
    leases."""
    assert settings.directory is not None
    try:
        directory = Directory(settings.directory, settings.effective_replica_url(), lambda: local_view(found),
                              settings.load_factor)
    except ImportError:
        raise SlotkeeperError("the session directory needs the redis package: pip install 'slotkeeper[directory]'"
                              ) from None
    for state in found.all:  # a conversation's save is versioned under the lease it was made under (version.py)
        state.service.pool.snapshots.fence = lambda key: directory.fence(key.model, key.session_id)
    log.info("session directory %s: this replica is %s; each session runs on the replica holding its lease, and "
             "requests that reach another replica are forwarded there", directory.url, directory.replica)
    return Replicas(directory, settings.upstream_read_timeout)


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
    route = await directory.route(key.model, key.session_id, ring_key(key), side=side,
                                  local_only=hops_of(request) >= MAX_HOPS)
    if route is not None and not route.local:
        answer = await _forward(request, replicas, route.replica)
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


def hops_of(request: Request) -> int:
    """How many times the request was forwarded before it reached this replica (a forwarded request without the
    count, from another version: once)."""
    value = request.headers.get(HOPS)
    if value is not None and value.isdigit():
        return int(value)
    return 1 if FORWARDED in request.headers else 0


async def _forward(request: Request, replicas: Replicas, replica: str) -> Response | None:
    """The request sent to `replica` as it came, its answer streamed back; None when the replica refuses it."""
    headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _HOP]
    headers += [(FORWARDED.encode(), replicas.directory.replica.encode()),
                (HOPS.encode(), str(hops_of(request) + 1).encode())]
    url = replica + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    sent = replicas.http.build_request(request.method, url, headers=headers, content=await request.body())
    try:
        answer = await replicas.http.send(sent, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        replicas.directory.shun(replica)
        log.warning("replica %s refused a forwarded request (%s): it runs here, and nothing is forwarded there "
                    "until its heartbeat says it is back", replica, str(exc) or type(exc).__name__)
        return None
    replicas.directory.forwarded += 1
    back = [(k, v) for k, v in answer.headers.raw if k.decode("latin-1").lower() not in _HOP - {"content-length"}]

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:  # the connection to the client is broken off too: the answer is not whole
            log.warning("replica %s broke off a forwarded answer (%s)", replica, str(exc) or type(exc).__name__)
            raise
        finally:
            await answer.aclose()

    response = StreamingResponse(body(), status_code=answer.status_code)
    response.raw_headers = [*back, (b"x-slotkeeper-replica", replica.encode())]
    return response
