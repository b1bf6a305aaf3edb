"""Reproductions of the confirmed defects of issue 28 (the scale-out layer), each with the project's own classes:
fake backends (tests/unit/test_pool.FakeClient), the in-memory object store (tests/unit/test_shared_tier.MemoryStore)
and, for the session directory, a real redis-server on loopback (tests/support.RedisServer). No llama-server runs.

Each test asserts what a correct system must do; each failed on f5dbaf1 (defect 5's was fixed with issue 27)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from slotkeeper.cache.operations import flush, import_snapshot
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.slots import TurnEnd
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.errors import BadRequest
from slotkeeper.fleet.directory import CALL_SECONDS
from slotkeeper.fleet.group import BackendGroup
from slotkeeper.fleet.peers import HOPS, Peers
from slotkeeper.fleet.placement import ACTIVE_SECONDS
from slotkeeper.fleet.shared import Manifest, SharedTier
from slotkeeper.serving.identity import checked_session_id, resolve_session
from slotkeeper.types import SESSION_BODY_FIELDS, BackendInfo, CacheOutcome, IdSource, SessionKey, SnapshotKind
from slotkeeper.web.replicas import Replicas, hops_of, turns_for
from tests.support import RedisServer
from tests.unit.test_directory import B1, B3, MODEL, R1, R2, Replica, serve
from tests.unit.test_pool import FP, FakeClient, chain_of, key, make_pool
from tests.unit.test_shared_tier import MemoryStore, upload_all

SECRET = "a-secret-the-replicas-share"
S = key("S")  # the conversation the defects lose
OTHER = key("other")  # an unrelated conversation that takes the slot
NEIGHBOUR = key("neighbour")  # a conversation on the same system prompt: it restores S's state as a prefix


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Callable[[str], SnapshotStore]]:
    """Opens a slot dir and index per backend (`name`), all closed at the end."""
    opened: list[SnapshotStore] = []

    def open_store(name: str) -> SnapshotStore:
        store = SnapshotStore(tmp_path / name / "slots", tmp_path / name / "index" / "index.db")
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        store.close()


def pool_on(store: SnapshotStore, n_tokens: int = 42) -> SlotPool:
    client = FakeClient(store.slot_dir)
    client.save_tokens = n_tokens  # what each save of this backend says it held: tells the turns apart
    return make_pool(client, store)


def tier_on(pool: SlotPool, memory: MemoryStore, origin: str, fence: int | None) -> SharedTier:
    """The backend's uploader, as runtime.py and join_replicas set it up: one per backend, fenced by the replica's
    lease (every backend of a replica gets the same token), or not fenced without a directory."""
    tier = SharedTier(memory, pool.snapshots, FP, origin, functools.partial(import_snapshot, pool))
    pool.snapshots.on_commit = tier.committed
    if fence is not None:
        pool.snapshots.fence = lambda _key: fence
    return tier


async def run_turn(pool: SlotPool, k: SessionKey, chain: list[Any], n_tokens: int = 40) -> CacheOutcome:
    lease = await pool.acquire(k, chain)
    outcome = lease.cache.outcome
    lease.release(TurnEnd.COMPLETED, n_tokens)
    return outcome


def manifest_of(memory: MemoryStore, tier: SharedTier, k: SessionKey) -> Manifest:
    return Manifest.from_json(json.loads(memory.objects[tier.manifest_key(k, SnapshotKind.SESSION)]))


# -- defect 1: an older upload replaces a sibling backend's newer one ----------------------------------------------


@pytest.mark.parametrize("fence", [1, None], ids=["same-lease-token", "no-directory"])
async def test_defect1_an_older_queued_upload_does_not_replace_a_sibling_backends_newer_one(
        stores: Callable[[str], SnapshotStore], fence: int | None) -> None:
    """Two backends of one replica, each with its own uploader, both fenced with the replica's token (or, without a
    directory, neither fenced). Turn N of S is saved on backend X and queued for upload; S moves to backend Y (a
    drain, a failover), whose turn N+1 is saved and uploaded first. Then X's queued upload of turn N lands."""
    memory = MemoryStore()
    pool_x, pool_y = pool_on(stores("x"), n_tokens=40), pool_on(stores("y"), n_tokens=80)
    tier_x = tier_on(pool_x, memory, "replica-1 backend x", fence)
    tier_y = tier_on(pool_y, memory, "replica-1 backend y", fence)

    await run_turn(pool_x, S, chain_of("s1"))
    await flush(pool_x)  # committed on X: its upload waits in X's queue
    await run_turn(pool_y, S, chain_of("s1", "s2"))
    await flush(pool_y)
    await upload_all(tier_y)
    newer = await pool_y.snapshots.get(S)
    assert newer is not None and manifest_of(memory, tier_y, S).meta.checksum == newer.checksum

    await upload_all(tier_x)  # the older turn's upload, late

    after = manifest_of(memory, tier_x, S)
    assert (after.meta.checksum, after.meta.n_tokens) == (newer.checksum, newer.n_tokens), (
        f"the manifest went back from turn N+1 ({newer.n_tokens} tokens, from {tier_y._origin}) to turn N "
        f"({after.meta.n_tokens} tokens, from {after.origin}), version {after.version}")
    assert tier_y.blob_key(newer.checksum) in memory.objects, "the newer version's object was deleted"


# -- defect 2: a move takes a stale copy, because "newest" is judged by last_used ----------------------------------


@dataclass
class FakeMember:
    """One backend as BackendGroup sees it (group.Member), over a fake llama-server."""

    url: str
    pool: SlotPool
    service: Any = field(default_factory=lambda: SimpleNamespace(health=SimpleNamespace(up=True)))

    @property
    def backend(self) -> BackendInfo:
        return BackendInfo(self.url, MODEL, "/models/m.gguf", 1, 4096, "b1", FP)

    @property
    def client(self) -> Any:
        return self.pool.client

    @property
    def snapshots(self) -> Snapshots:
        return self.pool.snapshots


async def moved_then_restored_as_prefix(stores: Callable[[str], SnapshotStore]
                                        ) -> tuple[list[FakeMember], BackendGroup, FakeMember, FakeMember]:
    """S's turn 1 on its first owner; the owner drains and S moves, with its snapshot, to a second owner, where turn 2
    is saved. Then, on the first owner, another conversation on the same system prompt restores S's (old) state as
    its prefix: that restore bumps the old copy's last_used past the new one's. Returns the members, the group, and
    the first and second owners."""
    members = [FakeMember(f"http://gpu-{n}:8080", pool_on(stores(f"gpu-{n}"), n_tokens=40 * n)) for n in (1, 2, 3)]
    group = BackendGroup(members, 1.25)  # type: ignore[arg-type]
    first = await group.owner_for(S)
    await run_turn(first.pool, S, chain_of("s1"))
    await flush(first.pool)
    group.drain(first.url, True)
    second = await group.owner_for(S)
    assert second is not first
    await run_turn(second.pool, S, chain_of("s1", "s2"))
    await flush(second.pool)
    await asyncio.sleep(0.01)  # a later moment, whatever the clock's resolution
    await run_turn(first.pool, OTHER, [])  # the slot goes to something else
    restored = await first.pool.acquire(NEIGHBOUR, chain_of("n1"))
    assert restored.cache.outcome is CacheOutcome.PREFIX and restored.cache.restored_from == S.session_id
    restored.release(TurnEnd.COMPLETED, 30)
    await first.pool.snapshots.settle()
    stale, newest = await first.snapshots.get(S), await second.snapshots.get(S)
    assert stale is not None and newest is not None and stale.checksum != newest.checksum
    assert stale.last_used > newest.last_used  # the precondition of the defect: the stale copy "looks newest"
    return members, group, first, second  # type: ignore[return-value]


async def test_defect2_a_moving_session_takes_its_newest_turn_not_a_copy_restored_as_a_prefix(
        stores: Callable[[str], SnapshotStore]) -> None:
    _, group, first, second = await moved_then_restored_as_prefix(stores)
    newest = await second.snapshots.get(S)
    assert newest is not None
    group.drain(second.url, True)  # S moves again, to the third member: it must take turn 2 along
    dest = await group.owner_for(S)
    assert dest is not second and dest is not first
    got = await dest.snapshots.get(S)
    assert got is not None
    chain = await dest.snapshots.chain(got)
    turn2 = len(chain_of("s1", "s2"))
    assert (got.checksum, got.n_tokens, len(chain)) == (newest.checksum, newest.n_tokens, turn2), (
        f"S moved to {dest.url} with the stale copy of {first.url} (turn 1): {got.n_tokens} tokens, a chain of "
        f"{len(chain)}, instead of turn 2 on {second.url} ({newest.n_tokens} tokens, a chain of {turn2})")


async def test_defect2_after_a_restart_the_holder_of_the_newest_turn_owns_the_session(
        stores: Callable[[str], SnapshotStore]) -> None:
    members, _, first, second = await moved_then_restored_as_prefix(stores)
    restarted = BackendGroup(members, 1.25)  # type: ignore[arg-type]
    await restarted.learn_owners()
    owner = restarted.placement.owner(S.session_id)
    assert owner == second.url, (
        f"after a restart S's owner is {owner} (the first owner {first.url} holds turn 1); turn 2 is on {second.url}")


# -- defect 3: a client can bypass the lease with X-Slotkeeper-Hops ------------------------------------------------


def client_request(headers: list[tuple[bytes, bytes]], app: Any = None) -> Request:
    """A request as a client sends it, straight to a replica (nobody forwarded it)."""
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "headers": headers, "scheme": "http", "server": ("127.0.0.1", 11434),
             "client": ("10.0.0.9", 50000), "root_path": "", "http_version": "1.1", "app": app}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    return Request(scope, receive)


def test_defect3_a_hops_header_that_is_not_a_number_counts_as_no_hop() -> None:
    request = client_request([(HOPS.encode(), b"\xb2")])
    assert request.headers[HOPS] == "\u00b2"
    assert hops_of(request, Peers(SECRET, R2, [R1])) == 0


async def test_defect3_a_forged_hops_header_does_not_take_a_session_from_its_lease_holder(
        replicas: tuple[Replica, Replica]) -> None:
    one, two = replicas
    session = ""
    token = None
    for i in range(40):  # a session whose lease replica 1 holds
        runner, route = await serve(replicas, one, f"h{i}")
        if runner is one:
            session, token = f"h{i}", route.token
            break
    assert session and token is not None
    forwarded: list[str] = []

    def lease_holder(request: httpx.Request) -> httpx.Response:
        forwarded.append(str(request.url))
        return httpx.Response(200, json={"ok": True})

    forwarding = Replicas(two.directory, 5.0, Peers(SECRET, R2, [R1]))
    await forwarding.http.aclose()
    forwarding.http = httpx.AsyncClient(transport=httpx.MockTransport(lease_holder))
    app = SimpleNamespace(state=SimpleNamespace(replicas=forwarding))
    here = object()  # replica 2's own turns
    state = SimpleNamespace(turns=here, group=None)
    try:
        forged = client_request([(b"content-type", b"application/json"), (HOPS.encode(), b"2")], app)
        answer = await turns_for(forged, state, SessionKey(MODEL, session, IdSource.HEADER))  # type: ignore[arg-type]
        # The holder's next turn: it still runs there, under the same lease.
        after = await one.run(session)
        assert after is not None and (after.local, after.token) == (True, token), (
            f"a client's 'X-Slotkeeper-Hops: 2' sent to replica 2 took session {session} from replica 1, which held "
            f"its lease (token {token}): replica 1's next turn is routed as {after}")
        assert answer is not here and forwarded and forwarded[0].startswith(R1), (
            "replica 2 ran the session itself instead of forwarding it to the lease holder")
    finally:
        await forwarding.aclose()


# -- defect 4: SharedTier.bring imports the store's older version over a newer commit still running ---------------


async def test_defect4_a_turn_during_a_background_commit_keeps_the_newer_local_state(
        stores: Callable[[str], SnapshotStore], monkeypatch: pytest.MonkeyPatch) -> None:
    memory = MemoryStore()
    store = stores("host")
    pool = pool_on(store)
    tier = tier_on(pool, memory, "host-a", None)
    await run_turn(pool, S, chain_of("s1"))
    await flush(pool)
    await upload_all(tier)  # the store has turn 1
    edited = chain_of("s1 edited by the client", "s2")
    await run_turn(pool, S, edited)  # the client edited its history: turn 2 does not extend turn 1

    # S is evicted: its save is written by the backend, and committed in the background (held here a moment).
    gate, entered = threading.Event(), threading.Event()
    commit = store.commit

    def slow_commit(*args: Any, **kwargs: Any) -> Any:
        if not gate.is_set():
            entered.set()
            gate.wait(10)
        return commit(*args, **kwargs)

    monkeypatch.setattr(store, "commit", slow_commit)
    try:
        await run_turn(pool, OTHER, [])
        assert await asyncio.to_thread(entered.wait, 5)
        # S's next turn arrives during that commit: the service first brings S in from the shared tier.
        bring = asyncio.create_task(tier.bring(S, SnapshotKind.SESSION))
        await asyncio.sleep(0.1)
    finally:
        gate.set()
    brought = await bring
    await pool.snapshots.settle()
    local = await pool.snapshots.get(S)
    assert local is not None
    kept = await pool.snapshots.chain(local)
    assert kept == edited, (
        f"the store's older version (turn 1, chain of {len(chain_of('s1'))}) was imported over the newer local "
        f"commit (turn 2, chain of {len(edited)}): S's snapshot now has a chain of {len(kept)}, and the tier "
        f"downloaded {tier.downloads}")
    assert brought is None


# -- defect 5: an explicit id in the side states' namespace ---------------------------------------------------------

SIDE_LOOKING = "~side-0123456789abcdef"


@pytest.mark.parametrize("where", ["header", *(f"body:{f}" for f in SESSION_BODY_FIELDS if f != "id"), "body:id",
                                   "hint", "agent", "import"])
def test_defect5_an_explicit_id_may_not_take_the_side_states_prefix(where: str) -> None:
    """Fixed on main: identity.py refuses the reserved prefix (sidestates.RESERVED_PREFIX) for every explicit id, and
    the import's `as` name; side states are a kind of their own and no longer deleted by name at start."""
    with pytest.raises(BadRequest, match="keeps for the names it makes itself"):
        if where == "header":
            resolve_session("m", {"x-session-id": SIDE_LOOKING}, {}, [])
        elif where.startswith("body:"):
            resolve_session("m", {}, {where.removeprefix("body:"): SIDE_LOOKING}, [])
        elif where == "hint":
            resolve_session("m", {}, {}, [], hint=SIDE_LOOKING)
        elif where == "agent":
            resolve_session("m", {"x-session-id": SIDE_LOOKING, "x-claude-code-agent-id": "a1"}, {}, [])
        else:
            checked_session_id(f"  {SIDE_LOOKING}  ", "the import")


# -- defect 6: replica URLs read from Redis ---------------------------------------------------------------------------


async def test_defect6_a_replica_url_written_into_redis_is_never_contacted_unless_allowed(
        redis_server: RedisServer) -> None:
    """Whoever can write to Redis announces a replica of their own and takes a session's lease for it. A replica
    whose allow-list does not name it leaves it out: the session is not forwarded there (with its client's
    credentials), and runs here."""
    import redis as sync_redis

    evil = "http://collector.example:80"
    client = sync_redis.Redis.from_url(redis_server.url)
    peers = Peers(SECRET, R2, [R1])
    two = Replica(R2, redis_server.url, [B3], allows=peers.allows)
    try:
        views = {"models": {MODEL: [{"url": "http://gpu:8080", "up": True, "draining": False}]}, "at": 0}
        for replica in (evil, "http://collector.example:80/steal?x=", "file:///etc/passwd"):
            client.set(f"sk:replica:{replica}", json.dumps(views), px=60_000)
            client.sadd("sk:replicas", replica)
        assert await two.directory.beat()
        assert two.directory.status()["replicas"] == []  # none of them is taken as a replica
        client.set(f"sk:lease:{MODEL}:taken", f"{evil}|99", px=60_000)  # a lease "held" by the stranger
        route = await two.run("taken")
        assert route is not None and route.local and route.replica == R2
        for i in range(20):  # and no new session is ever placed there
            placed = await two.run(f"new-{i}")
            assert placed is not None and placed.local
    finally:
        await two.directory.close()
        client.close()


async def test_defect6_a_forged_set_of_forwarding_headers_routes_as_none(replicas: tuple[Replica, Replica]) -> None:
    """Every X-Slotkeeper-* header a client may forge, sent to replica 2 for a session replica 1 holds: the request
    is forwarded to the holder as one without them is, and the holder keeps its lease."""
    one, two = replicas
    session = ""
    for i in range(40):
        runner, _ = await serve(replicas, one, f"f{i}")
        if runner is one:
            session = f"f{i}"
            break
    assert session
    forwarded: list[httpx.Request] = []

    def lease_holder(request: httpx.Request) -> httpx.Response:
        forwarded.append(request)
        return httpx.Response(200, json={"ok": True})

    forwarding = Replicas(two.directory, 5.0, Peers(SECRET, R2, [R1]))
    await forwarding.http.aclose()
    forwarding.http = httpx.AsyncClient(transport=httpx.MockTransport(lease_holder))
    app = SimpleNamespace(state=SimpleNamespace(replicas=forwarding))
    state = SimpleNamespace(turns=object(), group=None)
    forged = [(b"x-slotkeeper-forwarded", R1.encode()), (HOPS.encode(), b"2"),
              (b"x-slotkeeper-sent-at", b"1800000000"), (b"x-slotkeeper-signature", b"00" * 32)]
    try:
        for headers in ([], forged):
            answer = await turns_for(client_request([(b"content-type", b"application/json"), *headers], app),
                                     state, SessionKey(MODEL, session, IdSource.HEADER))  # type: ignore[arg-type]
            assert answer is not state.turns
        assert len(forwarded) == 2 and all(str(r.url).startswith(R1) for r in forwarded)
        assert forwarded[0].headers["x-slotkeeper-hops"] == forwarded[1].headers["x-slotkeeper-hops"] == "1"
        after = await one.run(session)
        assert after is not None and after.local
    finally:
        await forwarding.aclose()


# -- defects 7, 8, 11: leases and the directory's time bound --------------------------------------------------------


async def test_defect7_a_turn_longer_than_the_idle_window_keeps_its_lease(redis_server: RedisServer) -> None:
    running = {"long": True}
    one = Replica(R1, redis_server.url, [B1], running=lambda _m, s: running.get(s, False))
    try:
        assert await one.directory.beat()
        for session in ("long", "idle"):
            route = await one.run(session)
            assert route is not None and route.local and route.token is not None
            one.directory._held[(MODEL, session)].used -= ACTIVE_SECONDS + 1  # the turn began long ago
        assert await one.directory.beat()
        assert one.directory.fence(MODEL, "long") is not None  # still running: kept, and refreshed in Redis
        assert one.directory.fence(MODEL, "idle") is None  # idle: given up
        running["long"] = False
        assert await one.directory.beat()
        assert one.directory.fence(MODEL, "long") is not None  # its idle time counts from the turn's end
    finally:
        await one.directory.close()


async def test_defect8_a_lease_given_up_is_not_kept_in_memory_when_a_route_used_it_meanwhile(
        redis_server: RedisServer) -> None:
    import redis as sync_redis

    one = Replica(R1, redis_server.url, [B1])
    directory = one.directory
    try:
        assert await directory.beat()
        route = await one.run("s")
        assert route is not None and route.token is not None
        held = directory._held[(MODEL, "s")]
        held.used -= ACTIVE_SECONDS + 1  # idle: the next beat gives it up
        real = directory._redis.pipeline

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = real(*args, **kwargs)
            execute = pipe.execute

            async def racing_execute(*a: Any, **k: Any) -> Any:
                held.used = time.time()  # a route used the lease while the release was on its way
                return await execute(*a, **k)

            pipe.execute = racing_execute
            return pipe

        directory._redis.pipeline = pipeline
        await directory._keep_leases()  # the heartbeat's part that refreshes or gives up leases
        directory._redis.pipeline = real
        client = sync_redis.Redis.from_url(redis_server.url)
        try:
            in_redis = client.get(f"sk:lease:{MODEL}:s")
        finally:
            client.close()
        assert in_redis is None  # released in Redis...
        assert directory.fence(MODEL, "s") is None  # ...and so not claimed here with a token nobody holds
        again = await one.run("s")
        assert again is not None and again.token is not None and again.token > route.token  # taken anew
    finally:
        await directory.close()


async def test_defect11_a_directory_that_does_not_answer_holds_a_request_one_call_bound_at_most(
        redis_server: RedisServer) -> None:
    one = Replica(R1, redis_server.url, [B1])
    try:
        assert await one.directory.beat()
        assert redis_server.process is not None
        os.kill(redis_server.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            route = await one.run("stalled")
            waited = time.monotonic() - started
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        assert route is None and one.directory.down
        assert waited < CALL_SECONDS + 0.5, f"a route waited {waited:.2f} s for a directory that does not answer"
        # Down: the next requests do not wait for it at all, until a heartbeat finds it back.
        started = time.monotonic()
        assert await one.run("stalled") is None and time.monotonic() - started < 0.1
        assert await one.directory.beat() and not one.directory.down
    finally:
        await one.directory.close()


# -- defect 9: saves while the lease is not known ----------------------------------------------------------------------


async def test_defect9_while_the_directory_is_down_the_holders_saves_still_upload(
        stores: Callable[[str], SnapshotStore]) -> None:
    """A session saved under lease token 7, then Redis goes away (the replica knows no lease: fence None). Its next
    saves keep the token of the version they follow, with a newer stamp, and are uploaded over the store's
    (f5dbaf1 uploaded them with token 0 and refused every one: `fence or 0 < 7`)."""
    memory = MemoryStore()
    pool = pool_on(stores("host"))
    tier = tier_on(pool, memory, "replica-1", 7)
    await run_turn(pool, S, chain_of("s1"))
    await flush(pool)
    await upload_all(tier)
    assert manifest_of(memory, tier, S).version.fence == 7
    pool.snapshots.fence = lambda _key: None  # the directory does not answer
    for turn in ("s2", "s3"):
        await run_turn(pool, S, chain_of("s1", turn))
        await flush(pool)
        await upload_all(tier)
        local = await pool.snapshots.get(S)
        assert local is not None and manifest_of(memory, tier, S).meta.checksum == local.checksum
        assert local.version.fence == 7
    assert tier.uploads == 3 and tier.refused_older == 0


# -- defect 10: removing a damaged object ------------------------------------------------------------------------------


async def test_defect10_a_damaged_download_does_not_take_away_a_manifest_rewritten_meanwhile(
        stores: Callable[[str], SnapshotStore]) -> None:
    memory = MemoryStore()
    pool_a, pool_b = pool_on(stores("a"), n_tokens=40), pool_on(stores("b"))
    tier_a, tier_b = tier_on(pool_a, memory, "host-a", None), tier_on(pool_b, memory, "host-b", None)
    await run_turn(pool_a, S, chain_of("s1"))
    await flush(pool_a)
    await upload_all(tier_a)
    [blob] = memory.blobs()
    memory.objects[blob] = bytes(b ^ 0xFF for b in memory.objects[blob])  # damaged at rest
    # A saves and uploads turn 2 while B is downloading the damaged turn 1 (before B takes it away).
    pool_a.client.save_tokens = 80  # type: ignore[attr-defined]
    await run_turn(pool_a, S, chain_of("s1", "s2"))
    await flush(pool_a)
    turn2 = await pool_a.snapshots.get(S)
    assert turn2 is not None
    real_get_file = memory.get_file
    calls = 0

    def get_file(key: str, path: Path) -> int:
        nonlocal calls
        n = real_get_file(key, path)
        calls += 1
        if calls == 2:  # B's second (and last) download of the damaged file: A's upload lands right after it
            asyncio.run_coroutine_threadsafe(upload_all(tier_a), loop).result(10)
        return n

    loop = asyncio.get_running_loop()
    memory.get_file = get_file  # type: ignore[method-assign]
    assert await tier_b.bring(S, SnapshotKind.SESSION) is None  # turn 1 is damaged: refused
    after = manifest_of(memory, tier_a, S)
    assert not after.withdrawn and after.meta.checksum == turn2.checksum, (
        "the damaged download took away the manifest that host A rewrote meanwhile")
    assert tier_a.blob_key(turn2.checksum) in memory.objects


def test_an_explicit_id_of_a_derived_shape_names_only_its_own_conversation() -> None:
    """The names slotkeeper derives for conversations sent without an id (`chat-<16 hex>`, `sys-<16 hex>.c<12 hex>`)
    are reserved: a client may send one back for the conversation it names (it is then the same session as with no
    id), never to take another conversation's."""
    system = ["You are terse."]
    opening = {"role": "user", "content": "first question"}
    with_system = resolve_session("m", {}, {}, system, opening=opening)
    without = resolve_session("m", {}, {}, [], opening=opening)
    assert with_system.session_id.startswith("sys-") and without.session_id.startswith("chat-")
    for derived, texts in ((with_system, system), (without, [])):
        echoed = resolve_session("m", {"x-session-id": derived.session_id}, {}, texts, opening=opening)
        assert echoed == derived
        other = {"role": "user", "content": "another conversation's opening"}
        with pytest.raises(BadRequest, match="has the shape of the names slotkeeper derives"):
            resolve_session("m", {"x-session-id": derived.session_id}, {}, texts, opening=other)
    # A first turn's name, sent back: the same first turn (a retry keeps its name), then the conversation it began
    # once it has an answer; with another opening, refused.
    first = resolve_session("m", {}, {}, system, opening=opening)
    assert first.session_id.startswith(with_system.session_id.split(".t")[0] + ".t")
    assert resolve_session("m", {"x-session-id": first.session_id}, {}, system, opening=opening) == first
    reply = {"role": "assistant", "content": "an answer"}
    second = resolve_session("m", {}, {}, system, opening=opening, reply=reply)
    assert resolve_session("m", {"x-session-id": first.session_id}, {}, system, opening=opening,
                           reply=reply) == second
    with pytest.raises(BadRequest, match="has the shape of the names slotkeeper derives"):
        resolve_session("m", {"x-session-id": first.session_id}, {}, system,
                        opening={"role": "user", "content": "another opening"})
    # Ids of other shapes are the client's own, whatever they start with.
    for own in ("chat-1", "chat-0123456789ABCDEF", "sys-prompt-a", "chat-0123456789abcdef0"):
        assert resolve_session("m", {"x-session-id": own}, {}, [], opening=opening).session_id == own
