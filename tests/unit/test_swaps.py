"""The model switch (serving/swaps.py) against a router that keeps its statuses in memory: which model is loaded
when, that nothing is unloaded under a running turn, that a refused or slow load fails only the turn that wanted it,
that keep_alive unloads, and that a model the router dropped on its own is loaded again and checked."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from slotkeeper.errors import UpstreamError, UpstreamUnavailable
from slotkeeper.serving.swaps import ModelSwitch
from slotkeeper.upstream.health import BackendHealth, Probe
from slotkeeper.upstream.router import RouterModel, child_command, parse_models


class FakeRouterClient:
    model = None

    def __init__(self) -> None:
        self.up = True

    async def probe(self, timeout: float = 2.0) -> Probe:
        return Probe.OK if self.up else Probe.REFUSED


class FakeRouter:
    """A router's /models, /models/load and /models/unload, in memory; `refuse` names models whose load fails."""

    def __init__(self, names: list[str]) -> None:
        self.status = dict.fromkeys(names, "unloaded")
        self.client = FakeRouterClient()
        self.refuse: set[str] = set()
        self.load_seconds = 0.0
        self.calls: list[tuple[str, str]] = []

    async def models(self) -> list[RouterModel]:
        return [RouterModel(n, s, ()) for n, s in self.status.items()]

    async def load(self, name: str, timeout: float) -> RouterModel:
        self.calls.append(("load", name))
        if name in self.refuse:
            raise UpstreamError(500, b'{"error": {"message": "failed to load"}}')
        if self.load_seconds > timeout:
            await asyncio.sleep(timeout)
            raise UpstreamUnavailable(f"the router did not get model {name!r} loaded within {timeout:g} s")
        self.status[name] = "loaded"
        return RouterModel(name, "loaded", ())

    async def unload(self, name: str, timeout: float) -> None:
        self.calls.append(("unload", name))
        self.status[name] = "unloaded"


@dataclass
class FakeSnapshots:
    async def settle(self, *args: Any, **kwargs: Any) -> bool:
        return True


@dataclass
class FakePool:
    slots: list[Any] = field(default_factory=list)
    snapshots: FakeSnapshots = field(default_factory=FakeSnapshots)
    resets: int = 0

    def generations(self) -> dict[int, int]:
        return {}

    def reset_slots(self, observed: dict[int, int], reason: str) -> list[int]:
        self.resets += 1
        return []


class FakeClient:
    def __init__(self) -> None:
        self.admitted = True


class FakeBackend:
    def __init__(self) -> None:
        self.client = FakeClient()
        self.pool = FakePool()
        self.reverified = 0

    async def reverify(self, child: tuple[object, ...]) -> bool:
        self.reverified += 1
        return True


def switch_of(router: FakeRouter, max_loaded: int = 1, swap_wait: float = 5.0, load_timeout: float = 5.0,
              keep_alive: float = -1.0) -> tuple[ModelSwitch, dict[str, FakeBackend]]:
    made: dict[str, FakeBackend] = {}

    async def start(name: str) -> FakeBackend:
        made[name] = FakeBackend()
        return made[name]

    switch = ModelSwitch(router, max_loaded, start, health=BackendHealth("router"),  # type: ignore[arg-type]
                         swap_wait=swap_wait, load_timeout=load_timeout, backend_wait=1.0, keep_alive=keep_alive)
    switch.learn([RouterModel(n, s, ()) for n, s in router.status.items()])
    return switch, made


def test_a_turn_loads_its_model_after_the_other_one_is_unloaded() -> None:
    async def run() -> None:
        router = FakeRouter(["a", "b"])
        switch, made = switch_of(router)
        leave = await switch.admit("a")
        leave()
        assert router.status == {"a": "loaded", "b": "unloaded"}
        leave = await switch.admit("b")
        leave()
        assert router.status == {"a": "unloaded", "b": "loaded"}
        assert router.calls == [("load", "a"), ("unload", "a"), ("load", "b")]
        # a's client sends nothing while a is unloaded (a request naming it would load it again)
        assert made["a"].client.admitted is False and made["a"].pool.resets == 1
        leave = await switch.admit("a")
        leave()
        assert made["a"].reverified == 1 and made["a"].client.admitted is True

    asyncio.run(run())


def test_a_model_is_not_unloaded_under_a_running_turn_and_the_waiter_fails_past_the_bound() -> None:
    async def run() -> None:
        router = FakeRouter(["a", "b"])
        switch, _ = switch_of(router, swap_wait=0.2)
        leave_a = await switch.admit("a")
        with pytest.raises(UpstreamUnavailable, match="still answering 1 request"):
            await switch.admit("b")
        assert router.status == {"a": "loaded", "b": "unloaded"}
        # a's turns are admitted again at once, and once a's turn ends b gets its room
        leave_a2 = await switch.admit("a")
        leave_a2()
        waiting = asyncio.create_task(switch.admit("b"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        leave_a()
        leave_b = await asyncio.wait_for(waiting, 2)
        leave_b()
        assert router.status == {"a": "unloaded", "b": "loaded"}

    asyncio.run(run())


def test_a_refused_or_slow_load_fails_only_its_turn() -> None:
    async def run() -> None:
        router = FakeRouter(["a", "b"])
        switch, _ = switch_of(router, load_timeout=0.1)
        router.refuse.add("b")
        with pytest.raises(UpstreamError):
            await switch.admit("b")
        assert switch.entries["b"].status == "unloaded" and not switch.entries["b"].admission.open
        router.refuse.clear()
        router.load_seconds = 1.0
        with pytest.raises(UpstreamUnavailable, match=r"within 0\.1 s"):
            await switch.admit("b")
        router.load_seconds = 0.0
        leave = await switch.admit("b")  # the next try loads it
        leave()
        assert router.status["b"] == "loaded"
        with pytest.raises(Exception, match="not found"):
            await switch.admit("nope")

    asyncio.run(run())


def test_keep_alive_zero_unloads_after_the_turn_and_a_duration_after_that_idle_time() -> None:
    async def run() -> None:
        router = FakeRouter(["a"])
        switch, _ = switch_of(router)
        leave = await switch.admit("a")
        switch.keep("a", 0)
        leave()
        for _ in range(50):
            await asyncio.sleep(0.01)
            if router.status["a"] == "unloaded":
                break
        assert router.status["a"] == "unloaded"
        leave = await switch.admit("a")
        switch.keep("a", 0.2)
        leave()
        assert switch.entries["a"].expires is not None
        await switch._expire()
        assert router.status["a"] == "loaded"  # not yet
        await asyncio.sleep(0.25)
        await switch._expire()
        assert router.status["a"] == "unloaded"
        switch.keep("a", -1)
        leave = await switch.admit("a")
        leave()
        assert switch.entries["a"].expires is None

    asyncio.run(run())


def test_a_model_the_router_dropped_is_loaded_again_and_checked() -> None:
    async def run() -> None:
        router = FakeRouter(["a", "b"])
        switch, made = switch_of(router, max_loaded=2)
        leave = await switch.admit("a")
        leave()
        router.status["a"] = "unloaded"  # its child died
        await switch.check()
        assert not switch.entries["a"].admission.open and made["a"].client.admitted is False
        leave = await switch.admit("a")
        leave()
        assert made["a"].reverified == 1 and router.calls.count(("load", "a")) == 2
        router.client.up = False  # the router itself is gone
        await switch.check()
        assert not switch.health.up and not switch.entries["a"].admission.open

    asyncio.run(run())


def test_the_router_model_list_is_read_defensively() -> None:
    models = parse_models({"data": [{"id": "a", "status": {"value": "loaded", "args": ["x", "-c", "8"]}},
                                    {"id": ""}, "junk", {"id": "b"},
                                    {"id": "c", "status": {"value": "unloaded", "failed": True, "exit_code": 1}}]})
    assert models == [RouterModel("a", "loaded", ("x", "-c", "8")), RouterModel("b", "", ()),
                      RouterModel("c", "unloaded", (), True)]
    with pytest.raises(UpstreamError):
        parse_models({"models": []})


def test_a_childs_command_is_compared_without_its_port() -> None:
    before = ("llama-server", "--port", "0", "--model", "a.gguf", "-ctk", "f16")
    after = ("llama-server", "--port", "41234", "--model", "a.gguf", "-ctk", "f16")
    assert child_command(before) == child_command(after) == ("llama-server", "--model", "a.gguf", "-ctk", "f16")
    assert child_command((*after[:-1], "bf16")) != child_command(after)
    assert child_command(("x", "--port=9", "-c", "8")) == ("x", "-c", "8")
