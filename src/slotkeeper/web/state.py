"""The objects one running slotkeeper is made of, kept on the app and handed to routes: one AppState per backend,
and the Backends that picks one by a request's model name. A model on several backends has a BackendGroup, shared
by its members' states, that sends each turn to its session's owner."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from starlette.requests import Request

from slotkeeper.cache.chain import Link
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.systemprompt import SystemPrompt
from slotkeeper.config import Settings
from slotkeeper.errors import BadRequest, NotFound
from slotkeeper.fleet.group import BackendGroup
from slotkeeper.serving.service import (
    BodyBuilder,
    HungUp,
    Prewarm,
    ProgressCallback,
    StreamTurn,
    TurnRecord,
    TurnService,
)
from slotkeeper.serving.swaps import ModelStatus
from slotkeeper.types import BackendInfo, SessionKey
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.process import ServerProcess
from slotkeeper.upstream.supervisor import Supervisor


class Turns(Protocol):
    """What routes run turns and pre-warms with: a backend's TurnService, or its model's BackendGroup."""

    async def unary(self, api: str, key: SessionKey, path: str, build: BodyBuilder, side: bool = False,
                    hung_up: HungUp | None = None, chat: Mapping[str, Any] | None = None,
                    chain: Sequence[Link] | None = None) -> tuple[Any, TurnRecord]: ...

    async def open_stream(self, api: str, key: SessionKey, path: str, build: BodyBuilder, side: bool = False,
                          hung_up: HungUp | None = None,
                          chat: Mapping[str, Any] | None = None,
                          chain: Sequence[Link] | None = None) -> StreamTurn: ...

    async def prewarm(self, model: str, system: SystemPrompt, progress: ProgressCallback | None = None,
                      pin: bool = False, domain: str = "") -> Prewarm: ...


@dataclass
class AppState:
    """One backend (one model) and what slotkeeper keeps for it."""

    settings: Settings
    backend: BackendInfo
    client: UpstreamClient
    pool: SlotPool
    service: TurnService
    started: float
    # The server process slotkeeper runs (launch and embedded modes) and its supervisor; None in attach mode.
    server: ServerProcess | None = None
    supervisor: Supervisor | None = None
    # The model's backends when it has several (shared by their states); None for a model on one backend.
    group: BackendGroup | None = None

    @property
    def turns(self) -> Turns:
        """Where this model's turns go: the group's owner of each session, or this backend's own service."""
        return self.group if self.group is not None else self.service

    @property
    def snapshots(self) -> Snapshots:
        """The backend's snapshots: the only way to its index rows and files (each read waits for pending writes)."""
        return self.pool.snapshots

    def serves(self, model: str) -> bool:
        name = model.removesuffix(":latest")
        return name in (self.backend.model_id, self.settings.model_alias)


class TakingTurns(Protocol):
    """Models that take turns, a state each made when the model is first loaded: a llama-server router's
    (web/routermode.py), or slotkeeper's own under max_loaded (web/localmodels.py)."""

    def names(self) -> list[str]: ...
    def state_of(self, name: str) -> AppState | None: ...
    def keep(self, name: str, seconds: float | None) -> None: ...
    async def unload(self, name: str, why: str) -> None: ...
    def expires(self, name: str) -> float | None: ...
    def status(self) -> list[ModelStatus]: ...
    @property
    def slot_dir(self) -> Path: ...
    @property
    def up(self) -> bool: ...
    async def ready(self, name: str, hung_up: HungUp | None = None) -> AppState: ...
    def listed(self) -> list[BackendInfo]: ...


class Backends:
    """Every backend, in configuration order (`all`), and one state per model (`models`: a model's first backend,
    whose `turns` go to the whole group). With one model, every request goes to it whatever model it names (the
    dialects decide whether a wrong name is an error); with several, the model name picks the model.

    Where models take turns (`taking_turns`: a router's, or max_loaded), a model's state is made when it is first
    loaded: `ready` makes it (a turn's way in), `for_model` only finds it (an operator's view, which loads nothing);
    `add` takes each new one and tells `on_add`."""

    def __init__(self, states: Sequence[AppState], taking_turns: TakingTurns | None = None) -> None:
        assert states or taking_turns is not None
        self.all = list(states)
        self.models = [s for s in self.all if s.group is None or s.group.members[0] is s]
        self.taking_turns = taking_turns
        self.on_add: list[Callable[[AppState], None]] = []

    def add(self, state: AppState) -> None:
        self.all.append(state)
        self.models.append(state)
        for listener in self.on_add:
            listener(state)

    @property
    def default(self) -> AppState:
        return self.models[0]

    def turn_name(self, model: str | None) -> str:
        """The name of a requested model that takes turns (`name:latest` is `name`; no name: the only model)."""
        assert self.taking_turns is not None
        names = self.taking_turns.names()
        if not model:
            if len(names) == 1:
                return names[0]
            raise BadRequest(f"name a model: slotkeeper offers {', '.join(repr(n) for n in names)}")
        if model in names:
            return model
        name = model.removesuffix(":latest")
        if name in names:
            return name
        offered = ", ".join(repr(n) for n in names) or "none"
        raise NotFound(f"model '{model}' not found: slotkeeper offers {offered}")

    async def ready(self, model: str | None, hung_up: HungUp | None = None) -> AppState:
        """The state a turn of `model` runs on; where models take turns, loading the model the first time."""
        if self.taking_turns is None:
            return self.for_model(model)
        return await self.taking_turns.ready(self.turn_name(model), hung_up)

    def for_model(self, model: str | None) -> AppState:
        if self.taking_turns is not None:
            if not model and self.models:  # an operator's view without a name: a loaded model, else any known
                return next((s for s in self.models if s.client.admitted), self.models[0])
            if not model:
                raise NotFound("no model has been loaded since slotkeeper started: the first request that names one "
                               "loads it")
            name = self.turn_name(model)
            found = self.taking_turns.state_of(name)
            if found is None:
                raise NotFound(f"model '{name}' has not been loaded since slotkeeper started: nothing of it is "
                               "known yet")
            return found
        if len(self.models) == 1 or not model:
            return self.default
        for state in self.models:
            if state.serves(model):
                return state
        served = ", ".join(repr(s.backend.model_id) for s in self.models)
        raise NotFound(f"model '{model}' not found: slotkeeper serves {served}")

    def listed(self) -> list[tuple[BackendInfo, float]]:
        """Every model served, with when slotkeeper started serving it: where models take turns, each of them, loaded
        or not (a model never loaded is described from its settings)."""
        if self.taking_turns is None:
            return [(s.backend, s.started) for s in self.models]
        started = {s.backend.model_id: s.started for s in self.models}
        return [(info, started.get(info.model_id, time.time())) for info in self.taking_turns.listed()]

    def members_of(self, model: str | None) -> list[AppState]:
        """Every backend of the model `model` names (of every model without a name)."""
        if not model:
            return self.all
        state = self.for_model(model)
        return [s for s in self.all if s.group is state.group] if state.group is not None else [state]


async def caught_up(states: Sequence[AppState]) -> None:
    """Wait (bounded) until the writes every backend's snapshots have started are done, for a consistent view of
    counters and listings."""
    await asyncio.gather(*(state.snapshots.caught_up() for state in states))


def backends(request: Request) -> Backends:
    found: Backends = request.app.state.backends
    return found


def app_state(request: Request, model: str | None = None) -> AppState:
    """The backend an operator's request is about: the one serving `model` (the default one without a name)."""
    return backends(request).for_model(model)


async def turn_state(request: Request, model: str | None = None) -> AppState:
    """The backend a turn of `model` goes to (where models take turns: loading the model the first time, while the
    client waits)."""
    return await backends(request).ready(model, request.is_disconnected)
