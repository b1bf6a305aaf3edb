"""What models that take turns share, whoever starts and stops them (a llama-server router: routermode.py; the
`[[backends]]` slotkeeper starts under max_loaded: localmodels.py): a state per model, made the first time the model
is loaded and told to `on_state`, each turn admitted by the model switch, and the switch's answers for the routes."""

from __future__ import annotations

import os
from collections.abc import Callable

from slotkeeper.serving.service import HungUp
from slotkeeper.serving.swaps import ModelStatus, ModelSwitch
from slotkeeper.web.state import AppState


class ModelsTakingTurns:
    """The states of the models a ModelSwitch loads and unloads (a subclass makes `switch`)."""

    switch: ModelSwitch

    def __init__(self) -> None:
        self.states: list[AppState] = []
        self.on_state: Callable[[AppState], None] | None = None
        self._by_name: dict[str, AppState] = {}

    def add_state(self, name: str, state: AppState) -> None:
        """The model `name` was loaded the first time: its turns are admitted by the switch from now on."""
        switch = self.switch

        async def admit(hung_up: HungUp | None) -> Callable[[], None]:
            return await switch.admit(name, hung_up)

        state.service.admit = admit
        self._by_name[name] = state
        self.states.append(state)
        if self.on_state is not None:
            self.on_state(state)

    def names(self) -> list[str]:
        return self.switch.names()

    def state_of(self, name: str) -> AppState | None:
        return self._by_name.get(name)

    async def ready(self, name: str, hung_up: HungUp | None = None) -> AppState:
        """The state of the model `name`, made the first time (which loads the model)."""
        await self.switch.backend(name, hung_up)
        return self._by_name[name]

    def status(self) -> list[ModelStatus]:
        return self.switch.status()

    def keep(self, name: str, seconds: float | None) -> None:
        self.switch.keep(name, seconds)

    async def unload(self, name: str, why: str) -> None:
        await self.switch.unload(name, why)

    def expires(self, name: str) -> float | None:
        """When (wall clock) the loaded model `name` is unloaded unless a turn comes; None: not by time."""
        return self.switch.entry(name).expires


def file_stat(path: str) -> tuple[int, int] | None:
    """A model file's size and modification time (ns), as its identity is cached by; None when it is not readable
    from here (then every reload of it is probed)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns
