"""llama-server in router mode (`--models-dir DIR` or `--models-preset FILE`): one child server per model, started on
the first request that names it. What its own routes say and do, as measured at b11434: `GET /props` without a model
answers `{"role": "router", "max_instances": N, ...}`; `GET /models` lists every model it offers with its status
(`loaded`, `unloaded`, `loading`) and its child's arguments; `POST /models/load` and `/models/unload` take
`{"model": NAME}`. None of these loads a model; a request that names one does (upstream/client.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slotkeeper.errors import SlotkeeperError, UpstreamError, UpstreamUnavailable
from slotkeeper.upstream.client import UpstreamClient

LOADED = "loaded"
UNLOADED = "unloaded"
# How often a load or unload is checked for being done.
STATUS_POLL_SECONDS = 0.01


@dataclass(frozen=True, slots=True)
class RouterModel:
    """One model a router offers, as its `/models` lists it."""

    name: str
    status: str  # "loaded", "unloaded", "loading", or whatever a later build says
    args: tuple[str, ...]  # its child's command line (empty before the router planned one)
    failed: bool = False  # its child's last start failed, or it exited on its own (with `exit_code`)

    @property
    def loaded(self) -> bool:
        return self.status == LOADED


def is_router(props: Mapping[str, Any]) -> bool:
    """Whether a server's `/props` (asked without a model) is a router's."""
    return props.get("role") == "router"


def max_instances(props: Mapping[str, Any]) -> int:
    """How many models the router keeps loaded at once (`--models-max`; 0 or missing: no bound)."""
    value = props.get("max_instances")
    return value if isinstance(value, int) and value > 0 else 0


def parse_models(answer: Any) -> list[RouterModel]:
    """The models of a `/models` answer; entries without a name are skipped."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise UpstreamError(502, b'{"error": {"message": "the router\'s /models answer has no data list"}}')
    models = []
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            continue
        found = entry.get("status")
        status: dict[str, Any] = found if isinstance(found, dict) else {}
        value = status.get("value")
        args = status.get("args")
        models.append(RouterModel(entry["id"], value if isinstance(value, str) else "",
                                  tuple(str(a) for a in args) if isinstance(args, list) else (),
                                  status.get("failed") is True))
    return models


def child_option(args: Sequence[str], *names: str) -> str | None:
    """The value of an option of a child's command line (the last one given), in any of its spellings."""
    found = None
    for i, word in enumerate(args):
        for name in names:
            if word == name and i + 1 < len(args):
                found = args[i + 1]
            elif word.startswith(name + "="):
                found = word[len(name) + 1:]
    return found


def child_command(args: Sequence[str]) -> tuple[str, ...]:
    """A child's command line without its port (`0` before it starts, a free one after): what stays the same from
    one load of the model to the next unless its settings change."""
    out: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
        elif word == "--port":
            skip = True
        elif not word.startswith("--port="):
            out.append(word)
    return tuple(out)


class RouterApi:
    """The router's own routes, through a client that names no model."""

    def __init__(self, client: UpstreamClient) -> None:
        assert client.model is None
        self.client = client

    async def models(self) -> list[RouterModel]:
        return parse_models(await self.client.get_json("/models", timeout=10.0))

    async def model(self, name: str) -> RouterModel | None:
        return next((m for m in await self.models() if m.name == name), None)

    async def load(self, name: str, timeout: float) -> RouterModel:
        """Ask the router to load `name` and wait until it says loaded; raises UpstreamError (the router refused) or
        UpstreamUnavailable (not loaded within `timeout` seconds, or it failed to start)."""
        try:
            await self.client.post_json("/models/load", {"model": name}, timeout=timeout)
        except UpstreamError as exc:
            if b"already" not in exc.body.lower():  # a load of a loaded model is refused as such: it is loaded
                raise
        return await self._until(name, lambda m: m.loaded, "loaded", timeout)

    async def unload(self, name: str, timeout: float) -> None:
        """Ask the router to unload `name` and wait until it no longer says loaded (or loading)."""
        try:
            await self.client.post_json("/models/unload", {"model": name}, timeout=timeout)
        except UpstreamError as exc:
            if exc.status_code >= 500:
                raise
        await self._until(name, lambda m: m.status not in (LOADED, "loading"), "unloaded", timeout)

    async def _until(self, name: str, done: Any, what: str, timeout: float) -> RouterModel:
        deadline = time.monotonic() + timeout
        failures = 0
        while True:
            try:
                found = await self.model(name)
                failures = 0
            except SlotkeeperError:
                found = None
                failures += 1
            if found is not None and done(found):
                return found
            if (found is not None and found.failed and found.status not in (LOADED, "loading")) or failures >= 100:
                raise UpstreamUnavailable(f"the router could not get model {name!r} {what}: its server did not "
                                          "start (the router's log says why)")
            if time.monotonic() >= deadline:
                raise UpstreamUnavailable(f"the router did not get model {name!r} {what} within {timeout:g} s")
            await asyncio.sleep(STATUS_POLL_SECONDS)
