"""slotkeeper's own several models (`[[backends]]` tables it launches, or runs on the embedded server) under a
`max_loaded` bound: models that do not fit on the machine together take turns, as a router's do. The model switch
(serving/swaps.py) decides which run; loading a model starts its server (the first time: started and discovered as
any backend is), unloading one saves its changed slots and stops its server, keeping its pool and snapshots."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from slotkeeper.cache.pool import SlotPool
from slotkeeper.config import Settings
from slotkeeper.errors import SlotkeeperError
from slotkeeper.serving.swaps import ModelSwitch
from slotkeeper.types import BackendInfo
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.health import BackendHealth, Probe
from slotkeeper.upstream.launchargs import parse_command
from slotkeeper.upstream.router import LOADED, RouterModel
from slotkeeper.web.runtime import RunningBackend
from slotkeeper.web.takingturns import ModelsTakingTurns, file_stat

log = logging.getLogger("slotkeeper")


def check_bounded(units: list[Settings]) -> None:
    """A max_loaded bound needs servers slotkeeper can stop and start: no attached one, no model on several."""
    names = [u.model_alias or "" for u in units]
    if any(u.mode == "attach" for u in units):
        raise SlotkeeperError("max_loaded takes turns only among servers slotkeeper starts: every [[backends]] table "
                              "needs a launch_command or a model (no upstream)")
    if len(set(names)) != len(names):
        raise SlotkeeperError("max_loaded takes turns among models, each on one backend: give each [[backends]] "
                              "table its own name")


class _Always:
    """The loader's health: slotkeeper's own servers have no router in front that could be away."""

    async def probe(self, timeout: float = 2.0) -> Probe:
        return Probe.OK


class LocalModelState:
    """One model's backend once first started: its KV setting checked again each time its server starts again."""

    def __init__(self, running: RunningBackend) -> None:
        self.running = running
        self._checked = file_stat(running.state.backend.model_path)

    @property
    def client(self) -> UpstreamClient:
        return self.running.state.client

    @property
    def pool(self) -> SlotPool:
        return self.running.state.pool

    async def reverify(self, child: tuple[object, ...]) -> bool:
        """Probe the KV setting of the server started again, unless its model file is the one last probed (the
        command line and slotkeeper's environment are the same by construction)."""
        checked = file_stat(self.running.state.backend.model_path)
        kv_check = self.running.kv_check
        if kv_check is None or (checked == self._checked and checked is not None):
            return False
        await kv_check.probe_now()
        self._checked = checked
        return True


class _Servers:
    """What the switch loads and unloads with (swaps.ModelLoader): each model's server, started and stopped."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.running: dict[str, RunningBackend] = {}
        self.loaded: set[str] = set()
        self.client = _Always()

    async def models(self) -> list[RouterModel]:
        return [RouterModel(name, LOADED if name in self.loaded else "unloaded", ()) for name in self.names]

    async def load(self, name: str, timeout: float) -> RouterModel:
        """Start the model's server again (the first time, LocalModels._start_model starts it)."""
        running = self.running.get(name)
        if running is not None:
            await running.start_server()
        self.loaded.add(name)
        return RouterModel(name, LOADED, ())

    async def unload(self, name: str, timeout: float) -> None:
        running = self.running.get(name)
        if running is not None:
            await running.stop_server()
        self.loaded.discard(name)


class LocalModels(ModelsTakingTurns):
    """The backends of the `[[backends]]` tables, taking turns within `max_loaded`; a state each once first started
    (`on_state` is told)."""

    def __init__(self, settings: Settings, units: list[Settings]) -> None:
        super().__init__()
        self.settings = settings
        self._units = {u.model_alias or "": u for u in units}
        self._servers = _Servers(list(self._units))
        self.switch = ModelSwitch(
            self._servers, settings.max_loaded, self._start_model,
            health=BackendHealth("slotkeeper's own backends"), swap_wait=settings.swap_wait_seconds,
            load_timeout=settings.start_timeout, backend_wait=settings.backend_wait_seconds,
            keep_alive=settings.keep_alive)

    @classmethod
    async def start(cls, settings: Settings, units: list[Settings]) -> LocalModels:
        """Start the first `max_loaded` models (so that a wrong setting shows at start); the others start when a
        turn asks for them."""
        check_bounded(units)
        models = cls(settings, units)
        models.switch.learn(await models._servers.models())
        try:
            for name in list(models._units)[:settings.max_loaded]:
                await models.switch.ready(name)
        except BaseException:
            await models.stop()
            raise
        log.info("%d models take turns, at most %d running at once: %s", len(models._units), settings.max_loaded,
                 ", ".join(models._units))
        return models

    async def _start_model(self, name: str) -> LocalModelState:
        running = await RunningBackend.start(self._units[name])
        self._servers.running[name] = running
        self.add_state(name, running.state)
        return LocalModelState(running)

    # -- what the routes ask (state.TakingTurns) ---------------------------------------------------------------

    @property
    def slot_dir(self) -> Path:
        return next(iter(self._units.values())).effective_slot_dir()

    @property
    def up(self) -> bool:
        """Whether every loaded model's server is up."""
        return all(s.service.health.up for s in self.states if s.client.admitted)

    def listed(self) -> list[BackendInfo]:
        out = []
        for name, unit in self._units.items():
            state = self._by_name.get(name)
            if state is not None:
                out.append(state.backend)
                continue
            args = parse_command(unit.launch_command) if unit.launch_command else None
            path = str(args.model or "") if args is not None else str(unit.model or "")
            parallel = (args.parallel if args is not None else None) or unit.parallel or 1
            ctx = (args.ctx_size if args is not None else None) or unit.ctx_size
            out.append(BackendInfo(url="", model_id=name, model_path=path, n_slots=parallel,
                                   n_ctx_slot=ctx // parallel if args is not None else ctx, build_info="",
                                   fingerprint=""))
        return out

    async def stop(self) -> None:
        """Stop every backend started (each saves its changed slots first, as a single backend does at exit)."""
        await asyncio.gather(*(running.stop() for running in self._servers.running.values()))
