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


@dataclass
class AppState:
    settings: Settings
    backend: BackendInfo
    client: UpstreamClient
    store: SnapshotStore
    pool: SlotPool
    service: TurnService
    started: float


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.slotkeeper
    return state
