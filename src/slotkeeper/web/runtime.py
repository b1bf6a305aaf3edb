"""One backend brought up and down: its snapshots, server (launched, embedded or attached), health, pool, service,
watch, supervisor and housekeeping tasks. slotkeeper runs one of these per model."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import socket
import stat
import time
from pathlib import Path

from slotkeeper.cache.budget import DiskBudget
from slotkeeper.cache.capability import Capability
from slotkeeper.cache.operations import flush, import_snapshot
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.ramdir import RamDir
from slotkeeper.cache.sidestates import KEPT as SIDE_STATES_KEPT
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.config import Settings
from slotkeeper.errors import SlotkeeperError
from slotkeeper.files import make_private_dir
from slotkeeper.fleet.group import BackendGroup
from slotkeeper.fleet.objectstore import S3Store
from slotkeeper.fleet.shared import SharedTier
from slotkeeper.serving.backend import capability_of, discover
from slotkeeper.serving.kvcheck import KvCheck
from slotkeeper.serving.service import TurnService
from slotkeeper.serving.watch import BackendWatch
from slotkeeper.types import BackendInfo
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.health import BackendHealth
from slotkeeper.upstream.launcher import StartedBackend, start_backend
from slotkeeper.upstream.supervisor import Supervisor
from slotkeeper.web.state import AppState

log = logging.getLogger("slotkeeper")


class RunningBackend:
    def __init__(self, state: AppState, snapshots: Snapshots, started: StartedBackend,
                 tasks: list[asyncio.Task[None]], shared: SharedTier | None = None,
                 uploader: asyncio.Task[None] | None = None, kv_check: KvCheck | None = None,
                 watch: BackendWatch | None = None) -> None:
        self.state = state
        self._snapshots = snapshots
        self._started = started
        self._tasks = tasks
        self._shared = shared
        self._uploader = uploader  # the shared tier's (runs until the last saves are uploaded)
        self.kv_check = kv_check
        self._watch = watch
        self._server_tasks: list[asyncio.Task[None]] = []  # the watch's and the supervisor's

    def watch_server(self) -> None:
        """Run the backend's watch and (for a server slotkeeper runs) its supervisor."""
        if self._watch is not None:
            self._server_tasks.append(asyncio.create_task(self._watch.run()))
        if self.state.supervisor is not None:
            self._server_tasks.append(asyncio.create_task(self.state.supervisor.run()))

    async def stop_server(self) -> None:
        """Stop the server slotkeeper runs, on purpose (its model makes room for another: serving/swaps.py): the
        watch and supervisor first, so that the stop is not taken for a crash and the server is not started again.
        The pool, snapshots and state stay."""
        for task in self._server_tasks:
            task.cancel()
        await asyncio.gather(*self._server_tasks, return_exceptions=True)
        self._server_tasks = []
        await self._started.stop(self.state.settings.shutdown_budget.stopping)

    async def start_server(self) -> None:
        """Start the server stopped by `stop_server` again, wait until it answers, and watch it again."""
        server = self._started.server
        assert server is not None
        server.spawn()
        try:
            await server.wait_ready(self.state.settings.start_timeout)
        except BaseException:
            await asyncio.shield(server.stop(2.0))
            raise
        if self._watch is not None:
            self._watch.forget()
        self.watch_server()

    @classmethod
    async def start(cls, settings: Settings) -> RunningBackend:
        return await cls.assemble(settings, *await open_backend(settings))

    @classmethod
    async def assemble(cls, settings: Settings, snapshots: Snapshots, started: StartedBackend,
                       client: UpstreamClient) -> RunningBackend:
        """Discover the backend `open_backend` started (or named) and make everything that serves it."""
        slot_dir = snapshots.slot_dir
        try:
            backend = await discover(client, snapshots, settings.model_alias or started.model_alias,
                                     started.kv_settings)
        except BaseException:
            await client.aclose()
            await started.stop(settings.shutdown_budget.stopping)
            await snapshots.close()
            raise
        capability = await asyncio.to_thread(capability_of, backend.props, started.embedded)
        health = BackendHealth(client.base_url)  # the one answer to "is the backend up?"
        pool = make_pool(settings, backend, client, snapshots, capability, health)
        await asyncio.to_thread(pool.learn_from_disk)
        await snapshots.enforce_budget()
        service = TurnService(client, pool, health, settings.backend_wait_seconds)
        shared, uploader = None, None
        if settings.shared_store is not None:
            shared = service.shared = _shared_tier(settings, snapshots, pool, backend.fingerprint, started.url)
            uploader = asyncio.create_task(shared.run())
        watch = BackendWatch(client, pool, health)
        supervisor = _supervisor(started, health, pool, settings)
        state = AppState(settings, backend, client, pool, service, time.time(), started.server, supervisor)

        def use_fingerprint(fingerprint: str) -> None:
            snapshots.refingerprint(fingerprint)
            state.backend = dataclasses.replace(state.backend, fingerprint=fingerprint)
            if shared is not None:
                shared.fingerprint = fingerprint

        kv_check = KvCheck(client, pool, snapshots, backend.kv_base, backend.meta, backend.fingerprint,
                           use_fingerprint)
        watch.on_restart = kv_check.restarted
        log.info("serving model %r from %s: %d slot(s) of %d tokens, fingerprint %s, snapshots in %s",
                 backend.model_id, started.url, backend.n_slots, backend.n_ctx_slot, backend.fingerprint, slot_dir)
        log.info("restores (%s strategy): %s", pool.policy.strategy, pool.policy.capability.reason())
        tasks = [asyncio.create_task(_keep_budget(snapshots)), asyncio.create_task(_index_old_states(snapshots))]
        running = cls(state, snapshots, started, tasks, shared, uploader, kv_check, watch)
        running.watch_server()
        return running

    async def stop(self) -> None:
        """Save every changed slot (within half the shutdown bound, commits included), then stop what was started."""
        state, budget = self.state, self.state.settings.shutdown_budget
        # The supervisor goes first, so that stopping the server below is not taken for a crash.
        for task in (*self._server_tasks, *self._tasks):
            task.cancel()
        await asyncio.gather(*self._server_tasks, *self._tasks, return_exceptions=True)
        if self.kv_check is not None:
            await self.kv_check.aclose()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget.saving
        try:
            flushed = await asyncio.wait_for(flush(state.pool), budget.saving)
            log.info("shutdown: saved %d changed slot(s)", flushed.saved)
            if flushed.failed:
                log.warning("shutdown: saving %d changed slot(s) failed; they lose their latest turns (see the "
                            "errors above)", flushed.failed)
        except TimeoutError:
            log.warning("shutdown: saving the changed slots took more than %.0f s (half of shutdown_timeout); "
                        "the slots not saved by then lose their latest turns", budget.saving)
        committed = await state.pool.aclose(max(0.0, deadline - loop.time()))
        if self._shared is not None and self._uploader is not None:
            if not await self._shared.drain(max(1.0, deadline - loop.time())):
                log.warning("shutdown: uploads to the shared store still running were cut short; those snapshots "
                            "are uploaded after their next save")
            self._uploader.cancel()
            await asyncio.gather(self._uploader, return_exceptions=True)
        if not committed:
            log.warning("shutdown: the saves still being committed after %.0f s (half of shutdown_timeout) are cut "
                        "short; their sessions keep their previous snapshots", budget.saving)
        await state.client.aclose()
        await self._started.stop(budget.stopping)
        # Every save committed (pool.aclose) and the server that read the RAM dir gone: all of it is on disk.
        await self._snapshots.close(drop_ram_copies=committed and self._started.server is not None)


async def open_backend(settings: Settings) -> tuple[Snapshots, StartedBackend, UpstreamClient]:
    """The snapshots (the slot dir and index, opened and reconciled) and the backend (started, or named in attach
    mode, and answering /health), with a client for it; nothing is asked of it yet."""
    make_private_dir(settings.cache_dir)
    slot_dir = settings.effective_slot_dir()
    ram = open_ram_dir(settings, slot_dir)
    snapshots = await asyncio.to_thread(Snapshots.open, slot_dir, settings.index_path, ram, settings.block_tokens)
    try:
        started = await start_backend(settings, slot_dir, None if ram is None else ram.path)
    except BaseException:
        await snapshots.close()
        raise
    client = UpstreamClient(started.url, read_timeout=settings.upstream_read_timeout,
                            slot_op_timeout=settings.slot_op_timeout)
    if settings.domains and settings.mode == "attach":
        log.warning("cache domains are kept apart, but slotkeeper cannot tell whether the llama-server at %s runs "
                    "with --cache-ram 0: its own prompt cache in RAM (on by default) would hand one domain's prompt "
                    "to another; start it with --cache-ram 0", started.url)
    return snapshots, started, client


def make_pool(settings: Settings, backend: BackendInfo, client: UpstreamClient, snapshots: Snapshots,
              capability: Capability, health: BackendHealth) -> SlotPool:
    """The slot pool of one discovered backend, under these settings."""
    return SlotPool(backend.n_slots, client, snapshots, backend.fingerprint, backend.n_ctx_slot,
                    settings.save_idle_seconds, settings.min_restore_tokens, settings.max_queue,
                    settings.system_snapshots, DiskBudget(settings.disk_budget, settings.max_snapshot_age,
                                                          settings.max_system_snapshots, SIDE_STATES_KEPT),
                    capability, health, settings.side_task_hold_seconds, domains=settings.domains)


async def form_groups(states: list[AppState], load_factor: float) -> list[BackendGroup]:
    """Give the backends that serve one model (several `[[backends]]` tables of one name) a BackendGroup, with the
    owners of their sessions learnt from their indexes."""
    by_model: dict[str, list[AppState]] = {}
    for state in states:
        by_model.setdefault(state.backend.model_id, []).append(state)
    groups = []
    for model, members in by_model.items():
        if len(members) < 2:
            continue
        group = BackendGroup(members, load_factor)
        for member in members:
            member.group = group
        fingerprints = {m.backend.fingerprint for m in members}
        if len(fingerprints) > 1:
            log.warning("the backends of model %r differ in model file, slot layout or build (%d fingerprints): a "
                        "session that moves between two that differ starts cold", model, len(fingerprints))
        owned = await group.learn_owners()
        log.info("model %r runs on %d backends (%s); %d saved session(s) keep the backend that holds them; new "
                 "sessions are spread with a load bound of %.2fx the mean", model, len(members),
                 ", ".join(m.backend.url for m in members), owned, load_factor)
        groups.append(group)
    return groups


def _shared_tier(settings: Settings, snapshots: Snapshots, pool: SlotPool, fingerprint: str,
                 url: str) -> SharedTier:
    """The shared tier of one backend: its commits uploaded, what it lacks brought in (fleet/shared.py)."""
    assert settings.shared_store is not None
    try:
        store = S3Store(settings.shared_store, settings.shared_endpoint)
    except ImportError:
        raise SlotkeeperError("the shared store needs boto3: pip install 'slotkeeper[shared]'") from None
    # What the tier brings in is imported as an operator's import is: the slots stop attributing the session first.
    tier = SharedTier(store, snapshots, fingerprint, f"{socket.gethostname()} {url}",
                      functools.partial(import_snapshot, pool), settings.shared_budget)
    snapshots.on_commit = tier.committed
    log.info("shared store %s%s: saves are uploaded after their commit, and a session or system prompt this host "
             "lacks is brought from there", settings.shared_store,
             f" at {settings.shared_endpoint}" if settings.shared_endpoint else "")
    return tier


def open_ram_dir(settings: Settings, slot_dir: Path) -> RamDir | None:
    """The RAM dir of these settings, made ready; None when there is none, or it cannot be used safely (then the
    backend saves into the slot dir, as without one)."""
    path = settings.effective_ram_dir()
    if path is None:
        return None
    try:
        if settings.ram_dir is None:  # ours under /dev/shm: a parent no other user may own or swap for a link
            make_private_dir(path.parent)
            st = os.lstat(path.parent)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                raise OSError(f"{path.parent} is not a directory of this user")
        ram = RamDir(path, slot_dir, settings.effective_ram_budget)
    except OSError as exc:
        log.warning("no RAM dir (%s): the backend saves into the slot dir %s", exc, slot_dir)
        return None
    log.info("RAM dir %s: the backend saves there, and copies of recent snapshots (up to %.1f GiB) are restored "
             "from there", path, ram.budget / 1024**3)
    return ram


async def _index_old_states(snapshots: Snapshots) -> None:
    """States saved by an earlier version have no token blocks indexed: read them from their files, in the
    background (until then they are found by their chains and names)."""
    try:
        done = await snapshots.index_old_states()
    except Exception as exc:  # housekeeping: those states are still found by their chains
        log.warning("indexing the tokens of earlier saved states failed: %s", exc)
        return
    if done:
        log.info("indexed the tokens of %d state(s) saved by an earlier version", done)


async def _keep_budget(snapshots: Snapshots, interval: float = 60.0) -> None:
    """Saves enforce the disk budget as they happen; this catches snapshots that age out while nothing is saved."""
    while True:
        await asyncio.sleep(interval)
        await snapshots.enforce_budget()


def _supervisor(started: StartedBackend, health: BackendHealth, pool: SlotPool,
                settings: Settings) -> Supervisor | None:
    """A supervisor for the server slotkeeper started (none in attach mode): a crash marks the backend down and
    forgets what every slot held; the restarted server marks it up again."""
    server = started.server
    if server is None:
        return None

    def lost(reason: str) -> None:
        pool.reset_slots(pool.generations(), reason)

    return Supervisor(server, ready_timeout=settings.start_timeout, health=health, on_lost=lost)
