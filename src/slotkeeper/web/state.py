"""The objects one running slotkeeper is made of, kept on the app and handed to routes: one AppState per backend,
and the Backends that picks one by a request's model name."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request

from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.store import SnapshotStore
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
    store: SnapshotStore
    pool: SlotPool
    service: TurnService
    started: float
    # The server process slotkeeper runs (launch and embedded modes) and its supervisor; None in attach mode.
    server: ServerProcess | None = None
    supervisor: Supervisor | None = None

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


# How long an operator's view (listings, counters, /metrics) waits for saves still being committed in the background
# so that it shows them; past this it shows what is indexed so far.
VIEW_SETTLE_SECONDS = 5.0


async def settled(states: Sequence[AppState]) -> None:
    """Wait (bounded) until the saves every backend's pool has started are committed, for a consistent view."""
    await asyncio.gather(*(state.pool.settle(timeout=VIEW_SETTLE_SECONDS) for state in states))


def backends(request: Request) -> Backends:
    found: Backends = request.app.state.backends
    return found


def app_state(request: Request, model: str | None = None) -> AppState:
    """The backend a request goes to: the one serving `model` (the default one without a name)."""
    return backends(request).for_model(model)
