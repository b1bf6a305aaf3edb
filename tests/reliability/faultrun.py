"""The randomized fault test, in the spirit of Jepsen: two slotkeeper replicas over three real llama.cpp servers (A
runs two, B one), a real redis-server and moto's S3 server on loopback, clients sending each turn of their sessions
to a random replica, and a nemesis that, at random moments, kills (kill -9) or stops (SIGSTOP) a backend or a
replica, kills Redis, makes the object store fail or stall its requests, drains a backend, damages a KV block on a
backend's disk or in the object store, and sweeps the object store (two phases, a short grace) while uploads run.
Two hosts saving one prefix with other bytes needs no fault: a session that moves prefills on its new backend the
tokens its old one decoded, and the two round differently. Everything the run sees is recorded: every request
(acknowledged or not, with its `cache_n`), every fault, the manifests' versions and the lease holders read from the
store and Redis over time, and the leases the replicas' logs say they took. At the end every session's next token is
asked through slotkeeper (from whatever state it restores) and from a fresh prefill on a server of its own: their
log-probabilities must agree, so no restore used bytes that were not its prefix's. The checker (faultcheck.py) then
says what was violated.

Seeded: the seed fixes the faults, their targets and durations, and which replica each turn goes to; a failing seed
replays the same schedule (the machine's timing still varies). By hand, for a long run:

    python -m tests.reliability.faultrun --seed 7 --minutes 30 --kind binary --out faults-7.json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from slotkeeper.upstream.launcher import free_port
from tests.reliability.faultcheck import MIN_RESTORE_TOKENS, Fault, LeaseTaken, ManifestSample, Turn, check
from tests.support import (
    REPLICA_ARGS,
    Backend,
    ObjectStoreServer,
    RedisServer,
    Slotkeeper,
    backend_index,
    backends_config,
    saved_state_bytes,
    snapshot_tokens,
    wait_until,
    words,
)

MODEL = "tiny"
PREFIX = "faults"
SYSTEM = "You answer in a few words. " + words(200, 11)
FAULT_KINDS = ("kill-backend", "stop-backend", "kill-replica", "stop-replica", "redis-down", "store-fail",
               "store-stall", "drain", "damage-block", "damage-object", "sweep-store")
# The sweep-store fault's grace: far longer than a replica stays stopped (5 s at most), as the real one (an hour) is
# far longer than any upload's last look takes to its manifest.
SWEEP_GRACE_SECONDS = 12.0


# -- the object store, behind a proxy that fails or stalls on command ------------------------------------------------


class StoreProxy:
    """A loopback HTTP proxy in front of the S3 server: `mode` "ok" passes requests on, "fail" answers each with 503
    (an S3 error), "stall" holds each until the mode changes."""

    def __init__(self, upstream: str) -> None:
        self.mode = "ok"
        self._changed = threading.Condition()
        target = urllib.parse.urlsplit(upstream)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._changed:
                    proxy._changed.wait_for(lambda: proxy.mode != "stall", timeout=120)
                    failing = proxy.mode == "fail"
                if failing:
                    error = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ServiceUnavailable</Code>"
                             b"<Message>the nemesis</Message></Error>")
                    self.send_response(503)
                    self.send_header("content-type", "application/xml")
                    self.send_header("content-length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                    self.send_response(answer.status)
                    for k, v in answer.getheaders():
                        if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                            self.send_header(k, v)
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that hung up (a replica killed mid-request): nothing to report

        self.server = Server(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> StoreProxy:
        self._thread.start()
        return self

    def set(self, mode: str) -> None:
        with self._changed:
            self.mode = mode
            self._changed.notify_all()

    def stop(self) -> None:
        self.set("ok")
        self.server.shutdown()
        self.server.server_close()


# -- the cluster ---------------------------------------------------------------------------------------------------


@dataclass
class Cluster:
    redis: RedisServer
    store: ObjectStoreServer
    proxy: StoreProxy
    backends: list[Backend]
    keepers: list[Slotkeeper]  # replica A (backends 0 and 1), replica B (backend 2)

    def replica_of(self, backend: int) -> Slotkeeper:
        return self.keepers[0] if backend < 2 else self.keepers[1]


@contextmanager
def cluster(root: Path, kind: str, model: Path) -> Iterator[Cluster]:
    with ExitStack() as stack:
        backends = [Backend(kind, model, root / f"slots-{i}", root / f"backend-{i}.log") for i in range(3)]
        for backend in backends:
            stack.callback(backend.stop)
            backend.start()
        redis = RedisServer(root / "redis").start()
        stack.callback(redis.stop)
        store = ObjectStoreServer(root / "s3.log").start()
        stack.callback(store.stop)
        proxy = StoreProxy(store.url).start()
        stack.callback(proxy.stop)
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "faults")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "faults")
        keepers = []
        for name, mine in (("a", backends[:2]), ("b", backends[2:])):
            config = backends_config(root / f"{name}.toml", MODEL, mine)
            keeper = Slotkeeper(root / f"{name}-cache", root / f"{name}.log", extra_args=(
                "--config", str(config), "--save-idle-seconds", "0.3", "--directory", redis.url, "--shared-store",
                f"s3://{store.bucket}/{PREFIX}", "--shared-endpoint", proxy.url,
                # The checker's floor, fixed: under the measured rule a loaded machine could find a short state
                # cheaper to prefill than to restore, which the checker would count as a lost turn.
                "--min-restore-tokens", str(MIN_RESTORE_TOKENS), *REPLICA_ARGS))
            stack.callback(keeper.stop)
            keepers.append(keeper.start(timeout=120))
        if not wait_until(lambda: all("joined with" in Path(k.log_path).read_text(errors="replace")
                                      for k in keepers), timeout=30):
            raise RuntimeError("the replicas did not see each other")
        yield Cluster(redis, store, proxy, backends, keepers)


# -- the nemesis ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    pause: float  # seconds after the previous fault was healed
    kind: str
    target: int  # a backend (0-2), a replica (0-1), or unused
    duration: float


def schedule(seed: int, n: int) -> list[Planned]:
    """The faults of a run, from its seed alone."""
    rng = random.Random(seed)
    planned = []
    for _ in range(n):
        kind = rng.choice(FAULT_KINDS)
        target = rng.randrange(2) if kind in ("kill-replica", "stop-replica", "drain") else rng.randrange(3)
        planned.append(Planned(round(rng.uniform(1.0, 4.0), 2), kind, target, round(rng.uniform(1.0, 5.0), 2)))
    return planned


def _signal(process: Any, sig: int) -> None:
    if process is not None and process.poll() is None:
        os.kill(process.pid, sig)


def inflict(c: Cluster, planned: Planned, http: httpx.Client) -> tuple[str, Callable[[], object]]:
    """Apply one fault; returns its target's name and what heals it."""
    kind, i = planned.kind, planned.target
    if kind == "kill-backend":
        backend = c.backends[i]
        backend.stop(signal.SIGKILL)
        return backend.url, backend.start
    if kind == "stop-backend":
        backend = c.backends[i]
        _signal(backend.process, signal.SIGSTOP)
        return backend.url, lambda: _signal(backend.process, signal.SIGCONT)
    if kind == "kill-replica":
        keeper = c.keepers[i]
        keeper.stop(signal.SIGKILL)
        return keeper.url, lambda: keeper.start(timeout=120)
    if kind == "stop-replica":
        keeper = c.keepers[i]
        _signal(keeper.process, signal.SIGSTOP)
        return keeper.url, lambda: _signal(keeper.process, signal.SIGCONT)
    if kind == "redis-down":
        c.redis.stop(signal.SIGKILL)
        return "redis", c.redis.start
    if kind in ("store-fail", "store-stall"):
        c.proxy.set(kind.removeprefix("store-"))
        return "store", lambda: c.proxy.set("ok")
    if kind == "damage-block":
        damage_block(c.backends[i].slot_dir, random.Random(planned.duration))
        return c.backends[i].url, lambda: None
    if kind == "damage-object":
        damage_object(c.store, random.Random(planned.duration))
        return "store", lambda: None
    if kind == "sweep-store":
        sweeper = threading.Thread(target=sweep_twice, args=(c.store,), daemon=True)
        sweeper.start()
        return "store", lambda: None
    backend = c.backends[i]  # drain: one of replica A's two backends
    admin = c.keepers[0].url + "/api/backend/drain"
    http.post(admin, json={"backend": backend.url, "draining": True}).raise_for_status()
    return backend.url, lambda: http.post(admin, json={"backend": backend.url, "draining": False}).raise_for_status()


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x5A])


def damage_block(slot_dir: Path, rng: random.Random) -> None:
    """Flip a byte of a KV block on a backend's disk (bit rot): its bytes no longer match its name."""
    blocks = sorted(p for p in (slot_dir / "blocks").glob("??/*.blk"))
    if blocks:
        victim = rng.choice(blocks)
        with contextlib.suppress(OSError):  # removed meanwhile
            victim.write_bytes(_flip_last_byte(victim.read_bytes()))


def damage_object(store: ObjectStoreServer, rng: random.Random) -> None:
    """Flip a byte of a KV block in the object store."""
    s3 = store.client()
    keys = sorted(store.keys(f"{PREFIX}/kv/"))
    if keys:
        key = rng.choice(keys)
        try:
            body = s3.get_object(Bucket=store.bucket, Key=key)["Body"].read()
            s3.put_object(Bucket=store.bucket, Key=key, Body=_flip_last_byte(body))
        except Exception:  # removed meanwhile
            pass


def sweep_twice(store: ObjectStoreServer) -> None:
    """Sweep the object store as a host does (fleet/sweep.py), with a short grace: mark, wait past the grace, sweep
    again (which removes what stayed unnamed) while the replicas keep uploading."""
    from slotkeeper.fleet.objectstore import S3Store
    from slotkeeper.fleet.sweep import sweep

    objects = S3Store(f"s3://{store.bucket}/{PREFIX}", endpoint=store.url)
    try:
        sweep(objects, grace=SWEEP_GRACE_SECONDS, stray=1.0)
        time.sleep(SWEEP_GRACE_SECONDS + 1)
        sweep(objects, grace=SWEEP_GRACE_SECONDS, stray=1.0)
    except Exception as exc:  # the store failing (another fault): the sweep is tried again at the next one
        print(f"fault run: a sweep of the store failed: {exc}", file=sys.stderr, flush=True)


def nemesis(c: Cluster, plan: list[Planned], until: float, faults: list[Fault], stop: threading.Event) -> None:
    with httpx.Client(timeout=30) as http:
        for planned in plan:
            if stop.wait(planned.pause) or time.time() + planned.duration > until:
                return
            started = time.time()
            try:
                target, heal = inflict(c, planned, http)
            except Exception as exc:  # e.g. a drain sent while another fault holds the replica: none was made
                print(f"fault run: {planned.kind} could not be made ({exc!r})", file=sys.stderr, flush=True)
                continue
            stop.wait(planned.duration)
            try:
                heal()
            except Exception as exc:  # the fault stays in place: it counts until the end of the run
                print(f"fault run: {planned.kind} of {target} could not be healed ({exc!r})", file=sys.stderr,
                      flush=True)
                faults.append(Fault(planned.kind, target, started, until + 3600))
                continue
            faults.append(Fault(planned.kind, target, started, time.time()))


# -- the clients ---------------------------------------------------------------------------------------------------


# A conversation ends after this many turns and a new one takes its place (under the next name), as a person
# starts a new chat: the prompt stays well within the backends' context (8192 tokens per slot).
TURNS_PER_CONVERSATION = 50


@dataclass
class Session:
    base: str
    messages: list[dict[str, str]] = field(default_factory=list)
    acked: int = 0
    conversation: int = 0

    @property
    def name(self) -> str:
        return f"{self.base}.{self.conversation}"

    def next_body(self) -> dict[str, Any]:
        if self.acked >= TURNS_PER_CONVERSATION:
            self.messages, self.acked, self.conversation = [], 0, self.conversation + 1
        if not self.messages:
            self.messages.append({"role": "system", "content": SYSTEM})
        user = {"role": "user", "content": words(30, self.acked * 31 + sum(map(ord, self.name)))}
        return {"model": MODEL, "messages": [*self.messages, user], "max_tokens": 4, "temperature": 0}


def _dialect_error(response: httpx.Response) -> bool:
    try:
        error = response.json().get("error")
    except ValueError:
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def one_turn(http: httpx.Client, keeper: Slotkeeper, session: Session, turns: list[Turn]) -> None:
    """One request of `session` to `keeper`, recorded; an acknowledged one extends the session's conversation."""
    body = session.next_body()
    started = time.time()
    try:
        response = http.post(keeper.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session.name})
    except httpx.HTTPError:
        turns.append(Turn(session.name, started, time.time(), keeper.url, 0))
        return
    ended = time.time()
    if response.status_code != 200:
        turns.append(Turn(session.name, started, ended, keeper.url, response.status_code,
                          dialect_error=_dialect_error(response)))
        return
    data = response.json()
    t = data.get("timings") or {}
    turns.append(Turn(session.name, started, ended, keeper.url, 200, int(t.get("cache_n", 0)),
                      int(t.get("cache_n", 0)) + int(t.get("prompt_n", 0)),
                      response.headers.get("x-slotkeeper-backend", "")))
    session.messages = [*body["messages"], {"role": "assistant",
                                            "content": data["choices"][0]["message"]["content"] or ""}]
    session.acked += 1


def client(c: Cluster, sessions: list[Session], rng: random.Random, until: float, turns: list[Turn]) -> None:
    """Turns of `sessions` in a loop until `until`, each to a random replica. Each request on a connection of its own:
    a pooled keep-alive connection that the server closes as idle just as the client reuses it fails with no
    response, a race of the client's pool. Seed 1323334352 failed so once: a request to a replica that was up, and
    answered another request 90 ms before, failed in 1 ms with no status and no line in the replica's log."""
    with httpx.Client(timeout=90, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        while time.time() < until:
            for session in sessions:
                if time.time() >= until:
                    return
                one_turn(http, rng.choice(c.keepers), session, turns)


# -- what the store and Redis hold, over time ----------------------------------------------------------------------


def sampler(c: Cluster, stop: threading.Event, manifests: list[ManifestSample],
            holders: list[ManifestSample]) -> None:
    import redis as sync_redis

    s3 = c.store.client()
    lease_key = re.compile(rf"^sk:lease:{re.escape(MODEL)}:(.+)$")
    while not stop.wait(0.5):
        now = time.time()
        try:
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=c.store.bucket,
                                                                      Prefix=f"{PREFIX}/manifests/"):
                for item in page.get("Contents", []):
                    if "/session/" not in item["Key"]:
                        continue
                    data = json.loads(s3.get_object(Bucket=c.store.bucket, Key=item["Key"])["Body"].read())
                    version = data.get("state_version") or [0, 0]
                    # Versions are ordered per manifest, and a manifest lives under its backend's fingerprint: a
                    # backend probed after a restart under a placeholder or another KV setting writes another one.
                    fingerprint = item["Key"].split("/manifests/", 1)[1].split("/", 1)[0]
                    manifests.append(ManifestSample(now, f"{data['session']}@{fingerprint}",
                                                    (int(version[0]), int(version[1]))))
        except Exception:  # the store is read directly (not through the proxy), but an object may go meanwhile
            pass
        try:
            client = sync_redis.Redis.from_url(c.redis.url, socket_timeout=0.5, socket_connect_timeout=0.5)
            try:
                for key in client.scan_iter("sk:lease:*"):
                    match = lease_key.match(urllib.parse.unquote(key.decode() if isinstance(key, bytes) else key))
                    value = client.get(key)
                    if match and value is not None:
                        text = value.decode() if isinstance(value, bytes) else str(value)
                        holders.append(ManifestSample(now, match[1], (int(text.rpartition("|")[2]), 0)))
            finally:
                client.close()
        except Exception:  # Redis is down: nothing to read
            pass


LEASE_LINE = re.compile(r"^(\S+ \S+) INFO slotkeeper\.directory: lease (taken|given up): session [^/]+/(\S+), "
                        r"fencing token (\d+), replica (\S+?)(?: \(.*\))?$")


def leases_in(logs: list[Path]) -> tuple[list[LeaseTaken], list[LeaseTaken]]:
    """The leases the replicas' logs say they took, and gave up."""
    taken: list[LeaseTaken] = []
    given_up: list[LeaseTaken] = []
    for path in logs:
        for line in path.read_text(errors="replace").splitlines():
            match = LEASE_LINE.match(line)
            if match:
                stamp, millis = match[1].split(",")
                at = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
                (taken if match[2] == "taken" else given_up).append(LeaseTaken(at, match[3], match[5],
                                                                               int(match[4])))
    return taken, given_up


# -- the bytes -----------------------------------------------------------------------------------------------------

# A chunk of cells whose KV differs from a fresh prefill's by more than this (relative L2) was written for other tokens
# or settings: rounding (a decoded token against a batch prefill of it) is about 1e-3, another rope or other tokens
# of order 0.1 to 1. (The next token's log-probabilities cannot tell: on a random-weight model a state restored under
# another rope base moved them by 0.009, less than the rounding of decoded tokens does on a 2,000-token state.)
FOREIGN_KV = 0.05
_CHUNK = 16


def foreign_bytes(c: Cluster, root: Path, kind: str, model: Path) -> tuple[list[str], int]:
    """Every saved state as slotkeeper would hand it to its backend (assembled from its blocks, each checked against
    its name) against the KV a fresh prefill of its tokens writes, chunk by chunk; returns the violations and how many
    states were compared. A state that names a block the nemesis damaged cannot be assembled (its restore would
    refuse it): it is not compared."""
    from slotkeeper.cache.blockstore import DamagedState

    reference = Backend(kind, model, root / "reference-slots", root / "reference.log").start()
    found: list[str] = []
    compared = 0
    try:
        with httpx.Client(base_url=reference.url, timeout=120) as http:
            for keeper, mine in ((c.keepers[0], c.backends[:2]), (c.keepers[1], c.backends[2:])):
                for n, backend in enumerate(mine, start=1):
                    for row in _rows(backend_index(keeper.cache_dir, MODEL, n)):
                        try:
                            data = saved_state_bytes(backend.slot_dir, row)
                        except (DamagedState, OSError):
                            continue
                        problem = _compare_with_prefill(http, reference.slot_dir, data)
                        compared += 1
                        if problem:
                            found.append(f"saved state {row['session_id']} ({row['kind']}) on {backend.url}: "
                                         f"{problem}")
    finally:
        reference.stop()
    return found, compared


def _rows(index: Path) -> list[dict[str, Any]]:
    import sqlite3

    db = sqlite3.connect(index)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM snapshots")]
    finally:
        db.close()


def _compare_with_prefill(http: httpx.Client, slot_dir: Path, data: bytes) -> str | None:
    import numpy as np

    from slotkeeper.cache.slotformat import parse_layout

    saved = slot_dir / "compared.bin"
    saved.write_bytes(data)
    layout = parse_layout(saved)
    if layout is None:
        return None  # not a state this code reads by regions (kept whole): nothing to compare by cells
    tokens = snapshot_tokens(saved)
    answer = http.post("/completion", json={"prompt": tokens, "n_predict": 0, "cache_prompt": False, "id_slot": 0})
    answer.raise_for_status()
    http.post("/slots/0?action=save", json={"filename": "fresh.bin"}).raise_for_status()
    fresh_layout = parse_layout(slot_dir / "fresh.bin")
    if fresh_layout is None or fresh_layout.n_cells != layout.n_cells or \
            len(fresh_layout.regions) != len(layout.regions):
        return f"its layout {layout} is not a fresh prefill's {fresh_layout}"
    ours, theirs = np.fromfile(saved, dtype=np.uint8), np.fromfile(slot_dir / "fresh.bin", dtype=np.uint8)
    n = layout.n_cells
    for r, f in zip(layout.regions, fresh_layout.regions, strict=True):
        if (r.n_outer, r.cell_bytes, r.type_id) != (f.n_outer, f.cell_bytes, f.type_id) or r.type_id != 1:
            continue  # f16 KV only (the runs' default); another type is not decoded here
        a = ours[r.offset:r.offset + r.n_outer * n * r.cell_bytes].reshape(r.n_outer, n, r.cell_bytes)
        b = theirs[f.offset:f.offset + f.n_outer * n * f.cell_bytes].reshape(f.n_outer, n, f.cell_bytes)
        for start in range(0, n, _CHUNK):
            x = np.ascontiguousarray(a[:, start:start + _CHUNK]).view("<f2").astype(np.float32)
            y = np.ascontiguousarray(b[:, start:start + _CHUNK]).view("<f2").astype(np.float32)
            scale = float(np.linalg.norm(y)) or 1.0
            distance = float(np.linalg.norm(x - y)) / scale
            if not distance < FOREIGN_KV:
                return (f"cells {start}-{min(start + _CHUNK, n) - 1} differ from a fresh prefill of its tokens by "
                        f"{distance:.3g} (relative)")
    return None


# -- one run -------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    seed: int
    kind: str
    seconds: float
    sessions: int
    turns: int
    acknowledged: int
    failed: int
    faults: dict[str, int]
    violations: list[str]

    @property
    def n_faults(self) -> int:
        return sum(self.faults.values())


def run(root: Path, model: Path, kind: str, seed: int, seconds: float, n_sessions: int = 8,
        threads: int = 3) -> Result:
    turns: list[Turn] = []
    faults: list[Fault] = []
    manifests: list[ManifestSample] = []
    holders: list[ManifestSample] = []
    print(f"fault run: seed {seed}, {kind} backends, {seconds:.0f} s", file=sys.stderr, flush=True)
    with cluster(root, kind, model) as c:
        rng = random.Random(seed)
        sessions = [Session(f"s{seed}-{i}") for i in range(n_sessions)]
        until = time.time() + seconds
        stop = threading.Event()
        workers = [threading.Thread(target=client, args=(c, sessions[i::threads], random.Random(rng.random()),
                                                         until, turns)) for i in range(threads)]
        workers.append(threading.Thread(target=sampler, args=(c, stop, manifests, holders), daemon=True))
        plan = schedule(seed, int(seconds))  # more than a run can use: it stops at `until`
        workers.append(threading.Thread(target=nemesis, args=(c, plan, until, faults, stop)))
        for w in workers:
            w.start()
        for w in workers[:threads]:
            w.join()
        stop.set()
        for w in workers[threads:]:
            w.join(timeout=180)
        # After the last fault: one more turn of every session on a quiet cluster, so that the checker also judges
        # the state each session ended with; then every session's next token, restored against a fresh prefill.
        time.sleep(2)
        last = random.Random(seed + 1)
        with httpx.Client(timeout=90) as http:
            for session in sessions:
                one_turn(http, last.choice(c.keepers), session, turns)
            for keeper in c.keepers:  # every save of the last turns committed
                http.get(keeper.url + "/api/sessions", params={"kind": "all"}, timeout=60)
        foreign, compared = foreign_bytes(c, root, kind, model)
        print(f"fault run: compared {compared} saved states with a fresh prefill of their tokens", file=sys.stderr,
              flush=True)
        leases, given_up = leases_in([Path(k.log_path) for k in c.keepers])
    violations = check(turns, faults, manifests, leases, holders, given_up) + foreign
    acked = sum(1 for t in turns if t.ok)
    result = Result(seed, kind, seconds, n_sessions, len(turns), acked, len(turns) - acked,
                    dict(Counter(f.kind for f in faults)), violations)
    print(f"fault run: seed {seed}: {len(turns)} turns ({acked} acknowledged), {result.n_faults} faults "
          f"{result.faults}, {len(violations)} violation(s)", file=sys.stderr, flush=True)
    for violation in violations:
        print(f"  violation: {violation}", file=sys.stderr, flush=True)
    # What the checker judged, kept with the logs: a failing run in CI names its faults here and in root.
    (root / "history.json").write_text(json.dumps({"seed": seed, "kind": kind, "faults": [asdict(f) for f in faults],
                                                   "turns": [asdict(t) for t in turns]}) + "\n")
    if violations:
        for fault in sorted(faults, key=lambda f: f.started):
            print(f"  fault: {fault.kind} of {fault.target} from {fault.started:.1f} to {fault.ended:.1f}",
                  file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability.faultrun",
                                     description="The randomized fault test of two replicas over three backends.")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--kind", choices=["binary", "embedded"], default="binary")
    parser.add_argument("--out", type=Path, help="write the result here as JSON")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="run in DIR and keep it (the processes' logs, slot dirs, Redis's file); default: a "
                        "temporary directory, removed after")
    args = parser.parse_args(argv)
    from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model

    with tempfile.TemporaryDirectory(prefix="slotkeeper-faults-") as tmp:
        root = Path(tmp) if args.keep is None else args.keep
        root.mkdir(parents=True, exist_ok=True)
        model = root / "tiny.gguf"
        write_tiny_model(model, TinyModelSpec())
        result = run(root, model, args.kind, args.seed, args.minutes * 60)
    if args.out is not None:
        args.out.write_text(json.dumps({**asdict(result), "faults_injected": result.n_faults}, indent=2) + "\n")
    return 0 if not result.violations else 1


if __name__ == "__main__":
    sys.exit(main())
