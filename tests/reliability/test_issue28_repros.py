"""Reproductions of the confirmed defects of issue 28 (the scale-out layer), each with the project's own classes:
fake backends (tests/unit/test_pool.FakeClient), the in-memory object store (tests/unit/test_shared_tier.MemoryStore)
and, for the session directory, a real redis-server on loopback (tests/support.RedisServer). No llama-server runs.

Each test asserts what a correct system must do. The ones the current code fails are marked xfail(strict=True), so
that a fix turns them into an XPASS (a failure of this file): remove the mark with the fix."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.shared import Manifest, SharedTier
from slotkeeper.cache.slots import TurnEnd
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.errors import BadRequest
from slotkeeper.group import BackendGroup
from slotkeeper.identity import SESSION_BODY_FIELDS, checked_session_id, resolve_session
from slotkeeper.types import BackendInfo, CacheOutcome, IdSource, SessionKey, SnapshotKind
from slotkeeper.web.replicas import HOPS, Replicas, hops_of, turns_for
from tests.support import RedisServer
from tests.unit.test_directory import B1, B2, B3, MODEL, R1, R2, Replica, serve
from tests.unit.test_pool import FP, FakeClient, chain_of, key, make_pool
from tests.unit.test_shared_tier import MemoryStore, upload_all

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
    tier = SharedTier(memory, pool.snapshots, FP, origin, pool.import_snapshot)
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
    await pool_x.flush()  # committed on X: its upload waits in X's queue
    await run_turn(pool_y, S, chain_of("s1", "s2"))
    await pool_y.flush()
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
    await first.pool.flush()
    group.drain(first.url, True)
    second = await group.owner_for(S)
    assert second is not first
    await run_turn(second.pool, S, chain_of("s1", "s2"))
    await second.pool.flush()
    await asyncio.sleep(0.01)  # a later moment, whatever the clock's resolution
    await run_turn(first.pool, OTHER, [])  # the slot goes to something else
    restored = await first.pool.acquire(NEIGHBOUR, chain_of("n1"))
    assert restored.cache.outcome is CacheOutcome.PREFIX and restored.cache.restored_from == S.session_id
    restored.release(TurnEnd.COMPLETED, 30)
    await first.pool.settle()
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


@pytest.mark.xfail(strict=True, raises=ValueError,
                   reason="issue 28 defect 3: hops_of accepts what str.isdigit() accepts ('\\xb2', SUPERSCRIPT TWO, "
                          "as one latin-1 byte), and int() then raises")
def test_defect3_a_hops_header_that_is_not_a_number_counts_as_no_hop() -> None:
    request = client_request([(HOPS.encode(), b"\xb2")])
    assert request.headers[HOPS] == "\u00b2"
    assert hops_of(request) == 0


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def two_replicas(redis_server: RedisServer) -> AsyncIterator[tuple[Replica, Replica]]:
    one, two = Replica(R1, redis_server.url, [B1, B2]), Replica(R2, redis_server.url, [B3])
    assert await one.directory.beat() and await two.directory.beat() and await one.directory.beat()
    yield one, two
    for replica in (one, two):
        await replica.directory.close()


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="issue 28 defect 3: any client's X-Slotkeeper-Hops: 2 makes a replica run the session "
                          "local_only, without the lease; it records itself as owner and the holder gives its lease up")
async def test_defect3_a_forged_hops_header_does_not_take_a_session_from_its_lease_holder(
        two_replicas: tuple[Replica, Replica]) -> None:
    one, two = two_replicas
    session = ""
    token = None
    for i in range(40):  # a session whose lease replica 1 holds
        runner, route = await serve(two_replicas, one, f"h{i}")
        if runner is one:
            session, token = f"h{i}", route.token
            break
    assert session and token is not None
    forwarded: list[str] = []

    def lease_holder(request: httpx.Request) -> httpx.Response:
        forwarded.append(str(request.url))
        return httpx.Response(200, json={"ok": True})

    replicas = Replicas(two.directory, 5.0)
    await replicas.http.aclose()
    replicas.http = httpx.AsyncClient(transport=httpx.MockTransport(lease_holder))
    app = SimpleNamespace(state=SimpleNamespace(replicas=replicas))
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
        await replicas.aclose()


# -- defect 4: SharedTier.bring imports the store's older version over a newer commit still running ---------------


async def test_defect4_a_turn_during_a_background_commit_keeps_the_newer_local_state(
        stores: Callable[[str], SnapshotStore], monkeypatch: pytest.MonkeyPatch) -> None:
    memory = MemoryStore()
    store = stores("host")
    pool = pool_on(store)
    tier = tier_on(pool, memory, "host-a", None)
    await run_turn(pool, S, chain_of("s1"))
    await pool.flush()
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
    await pool.settle()
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
