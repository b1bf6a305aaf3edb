"""Shared fixtures: the generated tiny model, real backends of both kinds, and slotkeeper processes over them."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from tests.support import Backend, RedisServer, Slotkeeper

BACKEND_KINDS = ["binary", "embedded"]


@pytest.fixture(scope="session", autouse=True)
def _ram_dirs_removed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """slotkeeper removes its RAM dir (under /dev/shm) at a clean exit; the tests that kill it on purpose leave theirs
    behind, and tmpfs memory is not given back by itself: remove the ones this run made. A RAM dir is named after its
    slot dir (Settings.effective_ram_dir), so only those of this run's slot dirs go: another test run beside this one
    keeps its own."""
    parent = Path(f"/dev/shm/slotkeeper-{os.getuid()}")
    before = set(parent.iterdir()) if parent.is_dir() else set()
    yield
    if not parent.is_dir():
        return
    new = {path.name: path for path in set(parent.iterdir()) - before}
    if not new:
        return
    for root, dirs, _files in os.walk(tmp_path_factory.getbasetemp()):
        for name in dirs:
            digest = hashlib.sha256(str(Path(root, name).resolve()).encode()).hexdigest()[:16]
            if digest in new:
                shutil.rmtree(new.pop(digest), ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_tiny_model(path, TinyModelSpec())
    return path


@pytest.fixture(scope="session")
def foreign_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as the tiny model, different weights: its slot files restore into it without any error."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_tiny_model(path, TinyModelSpec(seed=999))
    return path


@pytest.fixture(params=BACKEND_KINDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


class Stack:
    """Factories for backends and slotkeepers that are all stopped when the test ends."""

    def __init__(self, tmp_path: Path, kind: str, model: Path) -> None:
        self.tmp = tmp_path
        self.kind = kind
        self.model = model
        self.slot_dir = tmp_path / "slots"
        self.cache_dir = tmp_path / "cache"
        self._processes: list[Backend | Slotkeeper] = []

    def backend(self, model: Path | None = None, **kwargs: object) -> Backend:
        backend = Backend(self.kind, model or self.model, self.slot_dir, self.tmp / f"backend-{self.kind}.log",
                          **kwargs)  # type: ignore[arg-type]
        self._processes.append(backend)
        return backend.start()

    def slotkeeper(self, backend: Backend, *extra: str) -> Slotkeeper:
        keeper = Slotkeeper(self.cache_dir, self.tmp / "slotkeeper.log", backend, tuple(extra))
        self._processes.append(keeper)
        return keeper.start()

    def stop_all(self) -> None:
        for process in reversed(self._processes):
            process.stop()


@pytest.fixture
def stack(tmp_path: Path, backend_kind: str, tiny_model: Path) -> Iterator[Stack]:
    s = Stack(tmp_path, backend_kind, tiny_model)
    try:
        yield s
    finally:
        s.stop_all()


@pytest.fixture
def client_for() -> Iterator[Callable[[Slotkeeper], httpx.Client]]:
    clients: list[httpx.Client] = []

    def make(keeper: Slotkeeper) -> httpx.Client:
        client = httpx.Client(base_url=keeper.url, timeout=120)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def two_backends(tmp_path: Path, tiny_model: Path, foreign_model: Path) -> Iterator[Slotkeeper]:
    """slotkeeper over two attached llama-servers (the binary) of the same shape, models "alpha" and "beta"."""
    servers = [Backend("binary", model, tmp_path / f"{name}-slots", tmp_path / f"{name}.log")
               for name, model in (("alpha", tiny_model), ("beta", foreign_model))]
    config = tmp_path / "slotkeeper.toml"
    config.write_text("".join(f'[[backends]]\nname = "{name}"\nupstream = "{server.url}"\n'
                              f'slot_dir = "{server.slot_dir}"\n\n'
                              for name, server in zip(("alpha", "beta"), servers, strict=True)))
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log", extra_args=("--config", str(config)))
    try:
        for server in servers:
            server.start()
        yield keeper.start(timeout=120)
    finally:
        keeper.stop()
        for server in servers:
            server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """Debian's redis-server on loopback, for the session directory's tests."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[tuple[Any, Any]]:
    """Two session-directory clients on it (tests/unit/test_directory.Replica): replica 1 with two backends,
    replica 2 with one, each having read the other's heartbeat."""
    from tests.unit.test_directory import B1, B2, B3, R1, R2, Replica

    one, two = Replica(R1, redis_server.url, [B1, B2]), Replica(R2, redis_server.url, [B3])
    assert await one.directory.beat() and await two.directory.beat() and await one.directory.beat()
    yield one, two
    for replica in (one, two):
        await replica.directory.close()
