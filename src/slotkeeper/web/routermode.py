"""slotkeeper in front of a llama-server in router mode: one backend state per model the router offers, made the
first time a client asks for the model (or at start, for a model the router already has loaded), all of them saving
into the router's one slot dir, under one index and disk budget. Which models are loaded is the model switch's
decision (serving/swaps.py); nothing slotkeeper sends on its own names a model that is not loaded."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from slotkeeper.cache.operations import flush
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.config import Settings
from slotkeeper.errors import SlotkeeperError
from slotkeeper.serving.backend import capability_of, discover, kv_fingerprint, kv_setting
from slotkeeper.serving.service import TurnService
from slotkeeper.serving.swaps import ModelSwitch
from slotkeeper.types import BackendInfo
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.health import BackendHealth
from slotkeeper.upstream.launchargs import kv_arguments
from slotkeeper.upstream.launcher import StartedBackend
from slotkeeper.upstream.router import RouterApi, child_command, child_option, is_router, max_instances
from slotkeeper.upstream.supervisor import Supervisor
from slotkeeper.web.runtime import RunningBackend, make_pool, open_backend
from slotkeeper.web.state import AppState
from slotkeeper.web.takingturns import ModelsTakingTurns, file_stat

log = logging.getLogger("slotkeeper")


async def start_runtime(settings: Settings) -> RunningBackend | RouterRuntime:
    """Start (or attach to) the backend of these settings, and serve it: a single server as one backend, a router
    as one backend per model."""
    snapshots, started, client = await open_backend(settings)
    try:
        props = await client.get_json("/props")
    except BaseException:
        await client.aclose()
        await started.stop(settings.shutdown_budget.stopping)
        await snapshots.close()
        raise
    if not is_router(props):
        return await RunningBackend.assemble(settings, snapshots, started, client)
    try:
        return await RouterRuntime.start(settings, snapshots, started, client, props)
    except BaseException:
        await client.aclose()
        await started.stop(settings.shutdown_budget.stopping)
        await snapshots.close()
        raise


class RouterModelState:
    """One model of the router, once it was first loaded: its state (as any backend's) and its KV check on reload."""

    def __init__(self, state: AppState, snapshots: Snapshots, child: tuple[object, ...]) -> None:
        self.state = state
        self._snapshots = snapshots
        # What the KV setting was last probed under: the child's command line and the router process's generation,
        # and the model file's size and modification time.
        self._checked = (child, file_stat(state.backend.model_path))

    @property
    def client(self) -> UpstreamClient:
        return self.state.client

    @property
    def pool(self) -> SlotPool:
        return self.state.pool

    async def reverify(self, child: tuple[object, ...]) -> bool:
        """The model was loaded again (its child is another process): probe its KV setting in slot 0, which holds
        nothing now, and save and look up under what it shows (the same fingerprint when nothing changed).

        Not when nothing its KV bytes depend on can have changed since the last probe: the same command line from
        the same router process (so the same environment) and the same model file (size and modification time, as
        the model's identity is cached by); a child of that kind runs the same setting. True when it probed."""
        backend = self.state.backend
        checked = (child, file_stat(backend.model_path))
        if checked == self._checked and checked[1] is not None:
            return False
        setting = await kv_setting(self.client, self._snapshots, backend.kv_base, backend.meta)
        fingerprint = kv_fingerprint(backend.kv_base, setting)
        if fingerprint != backend.fingerprint:
            log.warning("model %r came back with other KV settings (fingerprint %s, was %s): states saved before are "
                        "not restored under them", backend.model_id, fingerprint, backend.fingerprint)
        self._snapshots.refingerprint(fingerprint)
        self.state.backend = dataclasses.replace(backend, fingerprint=fingerprint)
        self._checked = checked
        return True


class RouterRuntime(ModelsTakingTurns):
    """A router and the states of its models; `states` grows as models are first loaded (`on_state` is told)."""

    def __init__(self, settings: Settings, snapshots: Snapshots, started: StartedBackend, client: UpstreamClient,
                 props: dict[str, Any]) -> None:
        super().__init__()
        self.settings = settings
        self._snapshots = snapshots
        self._started = started
        self._client = client
        self.props = props
        self.switch = ModelSwitch(
            RouterApi(client), settings.max_loaded or max_instances(props), self._start_model,
            health=BackendHealth(client.base_url), swap_wait=settings.swap_wait_seconds,
            load_timeout=settings.start_timeout, backend_wait=settings.backend_wait_seconds,
            keep_alive=settings.keep_alive)
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(cls, settings: Settings, snapshots: Snapshots, started: StartedBackend, client: UpstreamClient,
                    props: dict[str, Any]) -> RouterRuntime:
        runtime = cls(settings, snapshots, started, client, props)
        switch = runtime.switch
        models = await switch.api.models()
        switch.learn(models)
        for model in models:
            if model.loaded:
                await switch.adopt(model.name)
        bound = switch.max_loaded
        log.info("llama-server router at %s offers %d model(s) (%s), %s loaded; %s; snapshots in %s", client.base_url,
                 len(models), ", ".join(m.name for m in models) or "none",
                 ", ".join(switch.loaded()) or "none", f"at most {bound} loaded at once" if bound else
                 "no bound on loaded models", snapshots.slot_dir)
        if settings.shared_store is not None:
            log.warning("the shared store (--shared-store) is not used in front of a router yet: each model's "
                        "snapshots stay on this host")
        runtime._tasks.append(asyncio.create_task(switch.watch()))
        supervisor = runtime._supervisor()
        if supervisor is not None:
            runtime._tasks.append(asyncio.create_task(supervisor.run()))
        return runtime

    def _supervisor(self) -> Supervisor | None:
        """A supervisor for a router slotkeeper started: when it dies, every model it had loaded lost its slots."""
        server = self._started.server
        if server is None:
            return None

        def lost(reason: str) -> None:
            for entry in self.switch.entries.values():
                if entry.status == "loaded":
                    self.switch.lost(entry, reason)

        return Supervisor(server, ready_timeout=self.settings.start_timeout, health=self.switch.health, on_lost=lost)

    @property
    def url(self) -> str:
        return self._client.base_url

    @property
    def up(self) -> bool:
        """Whether the router answers."""
        return self.switch.health.up

    @property
    def slot_dir(self) -> Path:
        return self._snapshots.slot_dir

    def listed(self) -> list[BackendInfo]:
        """Every model the router offers, as slotkeeper knows it: what its discovery read, once it was loaded, else
        what its child's arguments say."""
        out = []
        for name, entry in self.switch.entries.items():
            state = self._by_name.get(name)
            if state is not None:
                out.append(state.backend)
                continue
            args = self._args.get(name, ())
            parallel = _int(child_option(args, "--parallel", "-np")) or 1
            ctx = _int(child_option(args, "--ctx-size", "-c")) or 0
            out.append(BackendInfo(url=self._client.base_url, model_id=entry.name,
                                   model_path=child_option(args, "--model", "-m") or "", n_slots=parallel,
                                   n_ctx_slot=ctx // parallel, build_info="", fingerprint=""))
        return out

    @property
    def _args(self) -> dict[str, tuple[str, ...]]:
        return self.switch.args

    async def _start_model(self, name: str) -> RouterModelState:
        """Discover a loaded model as any backend is (its props, slots, slot dir, KV probe), and make its state."""
        settings = self.settings
        client = UpstreamClient(self._client.base_url, read_timeout=settings.upstream_read_timeout,
                                slot_op_timeout=settings.slot_op_timeout, model=name)
        snapshots = self._snapshots.sharing()
        args = self._args.get(name, ())
        try:
            backend = await discover(client, snapshots, name, kv_arguments(args[1:]))
        except BaseException:
            await client.aclose()
            raise
        capability = await asyncio.to_thread(capability_of, backend.props)
        health = BackendHealth(f"{client.base_url} ({name})")
        pool = make_pool(settings, backend, client, snapshots, capability, health)
        await asyncio.to_thread(pool.learn_from_disk)
        service = TurnService(client, pool, health, settings.backend_wait_seconds)
        state = AppState(settings, backend, client, pool, service, time.time())
        self.add_state(name, state)
        log.info("router model %r: %d slot(s) of %d tokens, fingerprint %s", name, backend.n_slots,
                 backend.n_ctx_slot, backend.fingerprint)
        return RouterModelState(state, snapshots, (child_command(args), self.switch.health.recoveries))

    async def stop(self) -> None:
        """Save every loaded model's changed slots (within half the shutdown bound), then stop what was started."""
        budget = self.settings.shutdown_budget
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget.saving
        loaded = [s for s in self.states if s.client.admitted]
        try:
            flushed = await asyncio.wait_for(asyncio.gather(*(flush(s.pool) for s in loaded)), budget.saving)
            log.info("shutdown: saved %d changed slot(s) of %d loaded model(s)", sum(f.saved for f in flushed),
                     len(loaded))
        except TimeoutError:
            log.warning("shutdown: saving the changed slots took more than %.0f s (half of shutdown_timeout); "
                        "the slots not saved by then lose their latest turns", budget.saving)
        except SlotkeeperError as exc:
            log.warning("shutdown: saving the changed slots failed: %s", exc.message)
        for state in self.states:
            await state.pool.aclose(max(0.0, deadline - loop.time()))
            await state.client.aclose()
        await self._client.aclose()
        await self._started.stop(budget.stopping)
        await self._snapshots.close()


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
