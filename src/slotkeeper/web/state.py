"""The objects one running slotkeeper is made of, kept on the app and handed to routes: one AppState per backend,
and the Backends that picks one by a request's model name."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request

from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.config import Settings
from slotkeeper.errors import NotFound
from slotkeeper.service import TurnService
from slotkeeper.types import BackendInfo
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.process import ServerProcess
from slotkeeper.upstream.supervisor import Supervisor


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

    @property
    def snapshots(self) -> Snapshots:
        """The backend's snapshots: the only way to its index rows and files (each read waits for pending writes)."""
        return self.pool.snapshots

    def serves(self, model: str) -> bool:
        name = model.removesuffix(":latest")
        return name in (self.backend.model_id, self.settings.model_alias)


class Backends:
    """Every backend, in configuration order. With one, every request goes to it whatever model it names (the
    dialects decide whether a wrong name is an error); with several, the model name picks the backend."""

    def __init__(self, states: Sequence[AppState]) -> None:
        assert states
        self.all = list(states)

    @property
    def default(self) -> AppState:
        return self.all[0]

    def for_model(self, model: str | None) -> AppState:
        if len(self.all) == 1 or not model:
            return self.default
        for state in self.all:
            if state.serves(model):
                return state
        served = ", ".join(repr(s.backend.model_id) for s in self.all)
        raise NotFound(f"model '{model}' not found: slotkeeper serves {served}")


async def caught_up(states: Sequence[AppState]) -> None:
    """Wait (bounded) until the writes every backend's snapshots have started are done, for a consistent view of
    counters and listings."""
    await asyncio.gather(*(state.snapshots.caught_up() for state in states))


def backends(request: Request) -> Backends:
    found: Backends = request.app.state.backends
    return found


def app_state(request: Request, model: str | None = None) -> AppState:
    """The backend a request goes to: the one serving `model` (the default one without a name)."""
    return backends(request).for_model(model)
