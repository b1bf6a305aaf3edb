"""The objects one running slotkeeper is made of, kept on the app and handed to routes."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.config import Settings
from slotkeeper.service import TurnService
from slotkeeper.types import BackendInfo
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.process import ServerProcess
from slotkeeper.upstream.supervisor import Supervisor


@dataclass
class AppState:
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


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.slotkeeper
    return state
