"""Two slotkeeper replicas behind one address, sharing a session directory (Debian's redis-server on loopback, with
AOF) and a snapshot store (moto's S3 server on loopback), over three real llama.cpp servers of either kind:
replica A runs two of them, replica B one. Clients send each request to a random replica.

- Affinity: each session runs on one backend and reuses its own history there, whichever replica the client
  reached; sessions spread within the load bound over the three backends; no request fails. A session moved to
  the other replica by a drain starts there from the turn it had just run, not from the last upload.
- Failover: a backend killed (kill -9) mid-run; its sessions continue elsewhere from their last committed state,
  a stream in flight there fails in its client's dialect, and no later request fails.
- A replica killed mid-save and Redis restarted (kill -9 both): the other replica serves every session, those of
  the dead replica from their last uploaded snapshot; every file the store names is whole (size and checksum); the
  fencing tokens in both replicas' logs never repeat and only grow, and no lease was taken while another replica
  held it."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import xxhash

from slotkeeper.fleet.directory import LEASE_MS
from tests.support import (
    REPLICA_ARGS,
    Backend,
    ObjectStoreServer,
    RedisServer,
    Slotkeeper,
    backend_index,
    backends_config,
    saved_sessions,
    stored_object_bytes,
    wait_until,
    words,
)

pytestmark = pytest.mark.backend

MODEL = "tiny"
SYSTEM = "You are a patient assistant who answers briefly. " + words(120, 5)
PREFIX = "replicas"
N_SESSIONS = 12


@dataclass
class Replica:
    keeper: Slotkeeper
    backends: list[Backend]
    config: Path

    def index_of(self, backend: Backend) -> Path:
        return backend_index(self.keeper.cache_dir, MODEL, self.backends.index(backend) + 1)

    def saved(self, backend: Backend) -> dict[str, int]:
        """Session id -> the prompt tokens of its committed snapshot on `backend`."""
        return saved_sessions(self.index_of(backend))


@dataclass
class Cluster:
    redis: RedisServer
    store: ObjectStoreServer
    a: Replica
    b: Replica

    @property
    def replicas(self) -> list[Replica]:
        return [self.a, self.b]

    @property
    def backends(self) -> list[Backend]:
        return [*self.a.backends, *self.b.backends]

    def replica_of(self, url: str) -> Replica:
        return next(r for r in self.replicas if url in {b.url for b in r.backends})

    def by_url(self, url: str) -> Backend:
        return next(b for b in self.backends if b.url == url)

    def manifests(self) -> dict[str, dict[str, Any]]:
        """Session id -> its manifest in the store."""
        found = {}
        for key in self.store.keys(f"{PREFIX}/manifests/"):
            if "/session/" in key:
                body = self.store.client().get_object(Bucket=self.store.bucket, Key=key)["Body"].read()
                data = json.loads(body)
                found[data["session"]] = data
        return found


def start_replica(tmp_path: Path, name: str, backends: list[Backend], redis: RedisServer,
                  store: ObjectStoreServer) -> Replica:
    config = backends_config(tmp_path / f"{name}.toml", MODEL, backends)
    keeper = Slotkeeper(tmp_path / f"{name}-cache", tmp_path / f"{name}.log",
                        extra_args=("--config", str(config), "--save-idle-seconds", "0.3", "--directory", redis.url,
                                    "--shared-store", f"s3://{store.bucket}/{PREFIX}", "--shared-endpoint",
                                    store.url, *REPLICA_ARGS))
    return Replica(keeper.start(timeout=120), backends, config)


@pytest.fixture
def cluster(tmp_path: Path, backend_kind: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    backends = [Backend(backend_kind, tiny_model, tmp_path / f"slots-{i}", tmp_path / f"backend-{i}.log")
                for i in range(3)]
    redis = RedisServer(tmp_path / "redis")
    store = ObjectStoreServer(tmp_path / "s3.log")
    replicas: list[Replica] = []
    try:
        for backend in backends:
            backend.start()
        redis.start()
        store.start()
        replicas.append(start_replica(tmp_path, "a", backends[:2], redis, store))
        replicas.append(start_replica(tmp_path, "b", backends[2:], redis, store))
        # Each replica knows the other's backends once a heartbeat of each has been read.
        assert wait_until(lambda: all("joined with" in r.keeper.log_text() for r in replicas), timeout=30)
        yield Cluster(redis, store, replicas[0], replicas[1])
    finally:
        for replica in replicas:
            replica.keeper.stop()
        for backend in backends:
            backend.stop()
        redis.stop()
        store.stop()


def client_of(replica: Replica) -> openai.OpenAI:
    return openai.OpenAI(base_url=replica.keeper.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@dataclass
class Chat:
    """One session's conversation through the openai client, each turn sent to a random replica."""

    session: str
    messages: list[dict[str, str]] = field(default_factory=list)
    served_by: list[str] = field(default_factory=list)
    entered: list[str] = field(default_factory=list)  # the replica the client sent each turn to
    prompt_tokens: list[int] = field(default_factory=list)  # cache_n + prompt_n of each turn
    cache_n: list[int] = field(default_factory=list)

    def turn(self, client: openai.OpenAI) -> None:
        if not self.messages:
            self.messages.append({"role": "system", "content": SYSTEM})
        seed = len(self.messages) * 7 + sum(map(ord, self.session))
        self.messages.append({"role": "user", "content": words(60, seed)})
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=self.messages, max_tokens=4, temperature=0,  # type: ignore[arg-type]
            extra_headers={"X-Session-Id": self.session})
        answer = raw.parse()
        timings: dict[str, Any] = raw.http_response.json()["timings"]
        self.entered.append(str(client.base_url))
        self.served_by.append(raw.headers["x-slotkeeper-backend"])
        self.cache_n.append(int(timings["cache_n"]))
        self.prompt_tokens.append(int(timings["cache_n"]) + int(timings["prompt_n"]))
        self.messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})


def run_turns(chats: list[Chat], clients: list[openai.OpenAI], turns: int, seed: int,
              threads: int = 3) -> list[BaseException]:
    """`turns` turns of every chat over `threads` client threads, each turn sent to a random one of `clients`."""
    errors: list[BaseException] = []

    def worker(mine: list[Chat], rng: random.Random) -> None:
        for _ in range(turns):
            for chat in mine:
                try:
                    chat.turn(rng.choice(clients))
                except BaseException as exc:  # counted, and the test fails on them
                    errors.append(exc)

    workers = [threading.Thread(target=worker, args=(chats[i::threads], random.Random(seed + i)))
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return errors


def test_sessions_keep_their_backend_whichever_replica_a_client_reaches(cluster: Cluster) -> None:
    clients = [client_of(r) for r in cluster.replicas]
    chats = [Chat(f"chat-{i}") for i in range(N_SESSIONS)]
    assert run_turns(chats, clients, turns=6, seed=1) == []
    for chat in chats:
        assert len(set(chat.served_by)) == 1, (chat.session, chat.served_by)
        assert len(set(chat.entered)) == 2  # the client reached both replicas
        for turn in range(1, 6):
            assert chat.cache_n[turn] >= chat.prompt_tokens[turn - 1] - 8, (chat.session, turn, chat.cache_n,
                                                                          chat.prompt_tokens)
    loads = Counter(chat.served_by[0] for chat in chats)
    assert set(loads) == {b.url for b in cluster.backends}
    assert max(loads.values()) <= 1.25 * N_SESSIONS / 3, loads
    # Requests were forwarded both ways, and each session's snapshot is on its own backend's disk only.
    logs = [r.keeper.log_text() for r in cluster.replicas]
    assert all("forwarded to replica" in text for text in logs)
    for replica in cluster.replicas:
        metrics = httpx.get(replica.keeper.url + "/metrics", timeout=30).text
        assert "slotkeeper_directory_up 1.0" in metrics and "slotkeeper_replicas 2.0" in metrics
        forwarded = float(next(line.split()[1] for line in metrics.splitlines()
                                if line.startswith("slotkeeper_forwarded_total ")))
        assert forwarded > 0
        status = httpx.get(replica.keeper.url + "/api/backend", timeout=30).json()["directory"]
        assert status["up"] and status["replica"] == replica.keeper.url and len(status["replicas"]) == 1
    wait_until(lambda: sum(len(r.saved(b)) for r in cluster.replicas for b in r.backends) == N_SESSIONS, timeout=30)
    for replica in cluster.replicas:
        for backend in replica.backends:
            assert set(replica.saved(backend)) == {c.session for c in chats if c.served_by[0] == backend.url}
    # One lease per session, taken by the replica of its backend, under token 1.
    taken = leases(cluster)
    assert sorted(taken) == sorted(c.session for c in chats)
    for chat in chats:
        [(replica, token, _)] = taken[chat.session]
        assert token == 1 and replica == cluster.replica_of(chat.served_by[0]).keeper.url

    # Replica A's backends drained right after a turn of A's sessions, before the idle save: each session's next
    # turn moves to B's backend and starts from that turn, which A saved and uploaded before it let the lease go (a
    # fault run saw B bring the state a turn older from the store).
    on_a = [c for c in chats if cluster.replica_of(c.served_by[-1]) is cluster.a][:2]
    assert on_a
    for chat in on_a:
        chat.turn(clients[0])
    admin = cluster.a.keeper.url + "/api/backend/drain"
    for backend in cluster.a.backends:
        httpx.post(admin, json={"backend": backend.url, "draining": True}, timeout=30).raise_for_status()
    for chat in on_a:
        chat.turn(clients[0])
        assert chat.served_by[-1] == cluster.b.backends[0].url
        assert chat.cache_n[-1] >= chat.prompt_tokens[-2] - 8, (chat.session, chat.cache_n, chat.prompt_tokens)
    assert "lease given up" in cluster.a.keeper.log_text()


def test_a_killed_backends_sessions_move_with_their_last_committed_state(cluster: Cluster) -> None:
    clients = [client_of(r) for r in cluster.replicas]
    chats = [Chat(f"chat-{i}") for i in range(N_SESSIONS)]
    assert run_turns(chats, clients, turns=3, seed=2) == []
    owner = {chat.session: chat.served_by[-1] for chat in chats}
    # The victim is on replica A, whose other backend is beside it: its sessions move there or to B's.
    victim = max(cluster.a.backends, key=lambda b: sum(1 for o in owner.values() if o == b.url))
    theirs = [c for c in chats if owner[c.session] == victim.url]
    assert theirs
    # Every last turn committed and uploaded.
    assert wait_until(lambda: all(cluster.replica_of(owner[c.session]).saved(cluster.by_url(owner[c.session]))
                                  .get(c.session) == c.prompt_tokens[-1] for c in chats), timeout=30)
    assert wait_until(lambda: uploaded(cluster, theirs), timeout=30)

    doomed = theirs[0]
    with pytest.raises(openai.APIError):
        stream = clients[1].chat.completions.create(  # sent to replica B, forwarded to A, whose backend dies
            model=MODEL, messages=[*doomed.messages, {"role": "user", "content": "go on at length"}],  # type: ignore[list-item]
            max_tokens=3000, stream=True, extra_headers={"X-Session-Id": doomed.session},
            extra_body={"ignore_eos": True})
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        victim.stop(signal.SIGKILL)
        for _ in chunks:
            pass
    committed = cluster.a.saved(victim)

    assert run_turns(chats, clients, turns=2, seed=3) == []
    for chat in chats:
        if chat in theirs:
            assert chat.served_by[3] != victim.url
            assert chat.served_by[3] == chat.served_by[4]
            assert chat.cache_n[3] >= committed[chat.session] - 8, (chat.session, chat.cache_n, committed)
        else:
            assert set(chat.served_by) == {owner[chat.session]}
            assert chat.cache_n[3] >= chat.prompt_tokens[2] - 8


def test_a_replica_killed_mid_save_and_redis_restarted_lose_no_snapshot(cluster: Cluster) -> None:
    clients = [client_of(r) for r in cluster.replicas]
    chats = [Chat(f"chat-{i}") for i in range(8)]
    assert run_turns(chats, clients, turns=2, seed=4) == []
    on_a = [c for c in chats if cluster.replica_of(c.served_by[-1]) is cluster.a]
    assert on_a and len(on_a) < len(chats)
    assert wait_until(lambda: uploaded(cluster, chats), timeout=60)
    # One more turn of A's sessions, then A's servers are stopped (SIGSTOP) before its idle saves (0.3 s) start:
    # each save waits on its server, and A is killed (kill -9) in the middle of them.
    assert run_turns(on_a, [clients[0]], turns=1, seed=5, threads=1) == []
    for backend in cluster.a.backends:
        assert backend.process is not None
        os.kill(backend.process.pid, signal.SIGSTOP)
    time.sleep(1.0)
    cluster.a.keeper.stop(signal.SIGKILL)
    killed = time.time()
    for backend in cluster.a.backends:
        assert backend.process is not None
        os.kill(backend.process.pid, signal.SIGCONT)  # each finishes writing a file no index names
    # The kill caught a save waiting on its stopped server: A's index never got some session's last turn. (A save
    # whose server had written its file before the stop may still commit in the second before the kill: the file is
    # cut into blocks and indexed without the server.)
    committed = {s: n for backend in cluster.a.backends for s, n in cluster.a.saved(backend).items()}
    assert any(committed.get(c.session) != c.prompt_tokens[-1] for c in on_a), (
        committed, {c.session: c.prompt_tokens for c in on_a})
    # Redis dies and comes back (its append-only file keeps the leases and the fencing counters).
    cluster.redis.stop(signal.SIGKILL)
    last_upload = cluster.manifests()  # what the store holds for each session
    errors = run_turns(chats, [clients[1]], turns=1, seed=6, threads=2)  # some while Redis is down
    cluster.redis.start()
    errors += run_turns(chats, [clients[1]], turns=1, seed=7)
    # Until A's leases run out, B serves A's sessions without their leases (its saves are not uploaded over A's);
    # after, B takes each lease under the next token at the session's next turn.
    time.sleep(max(0.0, killed + LEASE_MS / 1000 + 1 - time.time()))
    errors += run_turns(chats, [clients[1]], turns=1, seed=8)
    assert errors == []
    for chat in on_a:
        # B restored A's sessions from their last upload (whole, or it would have been refused and fetched again).
        assert chat.cache_n[3] >= int(last_upload[chat.session]["prompt_tokens"]) - 8, (
            chat.session, chat.cache_n, last_upload[chat.session])
    b_log = cluster.b.keeper.log_text()
    assert "does not answer" in b_log and "answers again" in b_log
    # The fencing tokens: per session, each taken once, in increasing order; A's sessions were taken over by B
    # under a newer token than A's, after A's lease ran out (never while A held it).
    taken = leases(cluster)
    for session, held in taken.items():
        tokens = [token for _, token, _ in held]
        assert tokens == sorted(set(tokens)), (session, held)
    for chat in on_a:
        (first, token, _), *_, (last, newest, when) = taken[chat.session]
        assert first == cluster.a.keeper.url and last == cluster.b.keeper.url, taken[chat.session]
        assert newest > token and _unix(when) > killed
    # B's last save of each session went up under its own lease's token, over A's.
    assert wait_until(lambda: uploaded(cluster, chats), timeout=60)
    for chat in chats:
        assert cluster.manifests()[chat.session]["state_version"][0] == taken[chat.session][-1][1]
    # Every file a manifest names is whole (kept as a blob, or as a tail and blocks that put it back together).
    client = cluster.store.client()
    for session, manifest in cluster.manifests().items():
        scratch = cluster.a.keeper.cache_dir.parent / f"check-{session}"
        data = stored_object_bytes(client, cluster.store.bucket, PREFIX, manifest, scratch)
        assert len(data) == manifest["bytes"] and xxhash.xxh3_128_hexdigest(data) == manifest["checksum"], session
    # A starts again on its cache dir and joins; its clients' requests go to B, which holds every lease now.
    cluster.a.keeper.start(timeout=120)
    assert wait_until(lambda: cluster.a.keeper.log_text().count("joined with") >= 2, timeout=30)
    assert run_turns(on_a, [clients[0]], turns=1, seed=9, threads=1) == []
    assert {c.served_by[-1] for c in on_a} == {b.url for b in cluster.b.backends}


@pytest.mark.parametrize("backend_kind", ["binary"])  # the directory's part: the same over either kind of backend
def test_a_minute_without_redis_fails_no_request_and_uploads_go_on(cluster: Cluster) -> None:
    """Redis is killed for 60 s while clients go on sending each turn to a random replica: no request fails (each
    replica serves what reaches it on its own backends, a directory call waiting 1 s at most), every save is uploaded
    (it keeps its lease's token), and after Redis is back the store holds every session's last turn."""
    clients = [client_of(r) for r in cluster.replicas]
    chats = [Chat(f"chat-{i}") for i in range(6)]
    assert run_turns(chats, clients, turns=2, seed=10) == []
    assert wait_until(lambda: uploaded(cluster, chats), timeout=60)
    uploads_before = sum(r.keeper.log_text().count("uploaded the session snapshot") for r in cluster.replicas)
    cluster.redis.stop(signal.SIGKILL)
    down_until = time.monotonic() + 60
    errors: list[BaseException] = []
    rounds = 0
    while time.monotonic() < down_until:
        errors += run_turns(chats, clients, turns=1, seed=100 + rounds)
        rounds += 1
    uploads_during = sum(r.keeper.log_text().count("uploaded the session snapshot")
                         for r in cluster.replicas) - uploads_before
    cluster.redis.start()
    assert errors == [] and rounds >= 3
    assert uploads_during > 0  # saves made without a lease are uploaded too: they keep the token they follow
    assert all("does not answer" in r.keeper.log_text() for r in cluster.replicas)
    assert wait_until(lambda: all("answers again" in r.keeper.log_text() for r in cluster.replicas), timeout=30)
    assert run_turns(chats, clients, turns=1, seed=11) == []
    assert wait_until(lambda: uploaded(cluster, chats), timeout=60)
    for replica in cluster.replicas:
        metrics = httpx.get(replica.keeper.url + "/metrics", timeout=30).text
        assert "slotkeeper_directory_up 1.0" in metrics


def _unix(logged: str) -> float:
    """The time of a log line's timestamp (local time, with milliseconds)."""
    stamp, millis = logged.split(",")
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def uploaded(cluster: Cluster, chats: list[Chat]) -> bool:
    """Whether the store holds each chat's last turn."""
    manifests = cluster.manifests()
    return all(manifests.get(c.session, {}).get("prompt_tokens") == c.prompt_tokens[-1] for c in chats)


LEASE_LINE = re.compile(r"^(\S+ \S+) INFO slotkeeper\.directory: lease taken: session [^/]+/(\S+), fencing token "
                        r"(\d+), replica (\S+)$")


def leases(cluster: Cluster) -> dict[str, list[tuple[str, int, str]]]:
    """Session id -> (replica, token, time) of every lease taken, from both replicas' logs, by token."""
    found: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for replica in cluster.replicas:
        for line in replica.keeper.log_text().splitlines():
            match = LEASE_LINE.match(line)
            if match:
                found[match[2]].append((match[4], int(match[3]), match[1]))
    return {s: sorted(held, key=lambda h: h[1]) for s, held in found.items()}

