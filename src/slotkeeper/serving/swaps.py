"""Which models of a llama-server router are loaded, decided here: a model is loaded when a turn asks for it, and a
model makes room for it only once its own turns are over and its slots' unsaved states are saved.

Each model has an Admission: turns enter it while the model is loaded (and checked) and leave when they end. To
unload a model the switch closes its admission, waits for the turns inside to end (bounded by the swap wait: the
turn that wants the room fails past it, in its client's dialect), saves every changed slot, stops its client from
sending anything (a request naming an unloaded model would load it again), and asks the router to unload it; what its
slots held is then forgotten, and each conversation's next turn there restores its state from disk, as after a
restart. Loading is the other way round; a model loaded again gets its KV setting checked again (its `reverify`)
before a turn is admitted, so a state saved under other settings is never restored.

The router may also unload a model on its own (a child that died, a client of the router's own port): the watch
reads `/models` (which loads nothing) and treats a model no longer loaded as a backend that lost its slots.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from slotkeeper.cache.operations import flush
from slotkeeper.cache.pool import SlotPool
from slotkeeper.errors import NotFound, SlotkeeperError, UpstreamUnavailable
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.health import BackendHealth, Probe
from slotkeeper.upstream.router import LOADED, RouterModel, child_command

log = logging.getLogger("slotkeeper.swaps")

HungUp = Callable[[], Awaitable[bool]]
# How often the watch reads the router's model list.
WATCH_SECONDS = 1.0


class ModelBackend(Protocol):
    """What the switch needs of one model's backend (the web layer's state for it)."""

    @property
    def client(self) -> UpstreamClient: ...
    @property
    def pool(self) -> SlotPool: ...

    async def reverify(self, child: tuple[object, ...]) -> bool:
        """The model was loaded again, its child server started as `child` says (its command line and the router
        process's generation): check its KV setting before any turn runs on it (True: it was probed; False: nothing
        it depends on changed since the last probe)."""


class Prober(Protocol):
    async def probe(self, timeout: float = 2.0) -> Probe: ...


class ModelLoader(Protocol):
    """What loads and unloads the models (upstream/router.py's RouterApi; web/localmodels.py's servers of
    slotkeeper's own): their list and status, a load and an unload, each waited for; `client` is probed for health."""

    @property
    def client(self) -> Prober: ...

    async def models(self) -> list[RouterModel]: ...
    async def load(self, name: str, timeout: float) -> RouterModel: ...
    async def unload(self, name: str, timeout: float) -> None: ...


class Admission:
    """The turns running on one model, and whether new ones may start (the model is loaded and checked)."""

    def __init__(self) -> None:
        self.open = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> bool:
        if not self.open:
            return False
        self.in_flight += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    async def drained(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until no turn is inside; True when none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


@dataclass
class ModelEntry:
    """One model the router offers: its status as last read or made, its backend once it was first loaded, and its
    turns."""

    name: str
    status: str
    backend: ModelBackend | None = None
    admission: Admission = field(default_factory=Admission)
    last_used: float = 0.0
    loads: int = 0
    unloads: int = 0
    saved_at_unload: list[str] = field(default_factory=list)  # the conversations its last unload saved
    # Ollama's keep_alive: seconds the model stays loaded after its last turn, as its last request asked (None: the
    # switch's default; negative: for ever); and when (wall clock) that runs out, None for never.
    keep_alive: float | None = None
    expires: float | None = None


StartModel = Callable[[str], Awaitable[ModelBackend]]


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model's state for an operator: loaded or not, its running turns, its loads and unloads, the conversations
    its last unload saved, and when its keep_alive runs out (wall clock; None: not by time)."""

    model: str
    status: str
    turns_running: int
    loads: int
    unloads: int
    saved_at_last_unload: list[str]
    expires_at: float | None
    last_used: float | None


class ModelSwitch:
    def __init__(self, api: ModelLoader, max_loaded: int, start: StartModel, *, health: BackendHealth,
                 swap_wait: float, load_timeout: float, backend_wait: float, keep_alive: float = -1.0) -> None:
        self.api = api
        self.keep_alive = keep_alive  # the default (--keep-alive): negative keeps a model loaded until room is needed
        self.max_loaded = max_loaded  # 0: no bound of our own (the router's --models-max)
        self._start = start
        self.health = health  # the router's: up while it answers
        self._swap_wait = swap_wait
        self._load_timeout = load_timeout
        self._backend_wait = backend_wait
        self.entries: dict[str, ModelEntry] = {}
        self.args: dict[str, tuple[str, ...]] = {}  # each model's child command line, as the router last listed it
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._swapping: set[str] = set()  # models the switch is loading or unloading now (the watch leaves them)
        self._expiring: set[asyncio.Task[None]] = set()  # unloads a keep_alive of 0 started (kept referenced)

    def learn(self, models: list[RouterModel]) -> None:
        """Take the router's model list: new models are added, gone ones dropped unless they have a backend."""
        names = {m.name for m in models}
        for model in models:
            if model.args:
                self.args[model.name] = model.args
            entry = self.entries.get(model.name)
            if entry is None:
                self.entries[model.name] = ModelEntry(model.name, model.status)
            elif model.name not in self._swapping:
                entry.status = model.status
        for name in [n for n, e in self.entries.items() if n not in names and e.backend is None]:
            del self.entries[name]

    def names(self) -> list[str]:
        return list(self.entries)

    def status(self) -> list[ModelStatus]:
        """Each model as an operator sees it (`slotkeeper models`, the dashboard)."""
        return [ModelStatus(e.name, e.status, e.admission.in_flight, e.loads, e.unloads, list(e.saved_at_unload),
                            e.expires, e.last_used or None) for e in self.entries.values()]

    def loaded(self) -> list[str]:
        return [n for n, e in self.entries.items() if e.status == LOADED]

    def entry(self, name: str) -> ModelEntry:
        found = self.entries.get(name)
        if found is None:
            offered = ", ".join(repr(n) for n in self.entries) or "none"
            raise NotFound(f"model '{name}' not found: slotkeeper offers {offered}")
        return found

    async def adopt(self, name: str) -> ModelBackend:
        """At start: take a model the router already has loaded (its backend is made now; nothing else loads)."""
        entry = self.entry(name)
        entry.backend = await self._start(name)
        entry.status, entry.last_used = LOADED, time.time()
        entry.admission.open = True
        self._idle_from_now(entry)
        return entry.backend

    async def backend(self, name: str, hung_up: HungUp | None = None) -> ModelBackend:
        """The model's backend, made (the model loaded, and discovered) the first time a client asks for it."""
        entry = self.entry(name)
        if entry.backend is None:
            await self.ready(name, hung_up)
        assert entry.backend is not None
        return entry.backend

    async def admit(self, name: str, hung_up: HungUp | None = None) -> Callable[[], None]:
        """Let a turn run on `name`, loading it first when it is not loaded; returns what the turn calls when it
        ends. Raises when the model cannot be loaded, or room for it is not made within the swap wait."""
        entry = self.entry(name)
        while not entry.admission.enter():
            await self.ready(name, hung_up)
        entry.last_used = time.time()
        entry.expires = None  # not while a turn runs

        def leave() -> None:
            entry.admission.leave()
            if entry.admission.in_flight == 0:
                self._idle_from_now(entry)

        return leave

    def keep(self, name: str, seconds: float | None) -> None:
        """A request's keep_alive for `name` (None: the default), which counts from the end of its turns."""
        entry = self.entry(name)
        entry.keep_alive = seconds
        if entry.admission.open and entry.admission.in_flight == 0:
            self._idle_from_now(entry)

    def _idle_from_now(self, entry: ModelEntry) -> None:
        seconds = entry.keep_alive if entry.keep_alive is not None else self.keep_alive
        entry.expires = None if seconds < 0 else time.time() + seconds
        if seconds == 0:  # at once, not at the watch's next round
            task = asyncio.get_running_loop().create_task(self._expire())
            self._expiring.add(task)
            task.add_done_callback(self._expiring.discard)

    async def _expire(self) -> None:
        """Unload every loaded model whose keep_alive ran out and that runs no turn (its states saved first)."""
        now = time.time()
        for entry in list(self.entries.values()):
            if (entry.status == LOADED and entry.expires is not None and entry.expires <= now
                    and entry.admission.in_flight == 0):
                try:
                    await self.unload(entry.name, "its keep_alive ran out", expired=True)
                except SlotkeeperError as exc:
                    log.warning("unloading model %r after its keep_alive failed: %s", entry.name, exc.message)

    async def ready(self, name: str, hung_up: HungUp | None = None) -> None:
        """Load `name` (making room first) unless it is loaded; returns once its turns are admitted."""
        entry = self.entry(name)
        if entry.admission.open:
            return
        await self.health.wait_up(self._backend_wait, hung_up)
        async with self._lock:
            if entry.admission.open:
                return
            self._swapping.add(name)
            try:
                await self._make_room(name)
                started = time.perf_counter()
                if entry.backend is not None:
                    entry.backend.client.admitted = True  # before the load: a check must reach it
                await self.api.load(name, self._load_timeout)
                loaded = time.perf_counter()
                entry.status = LOADED
                entry.loads += 1
                if entry.backend is None:
                    entry.backend = await self._start(name)
                    then = "its discovery"
                elif await entry.backend.reverify((child_command(self.args.get(name, ())), self.health.recoveries)):
                    then = "the KV check"
                else:
                    then = "no KV check: nothing it depends on changed since the last one,"
                entry.last_used = time.time()
                entry.admission.open = True
                self._idle_from_now(entry)
                log.info("model %r loaded in %.0f ms (its server's start %.0f ms, then %s %.0f ms); its conversations "
                         "restore their states from disk", name, (time.perf_counter() - started) * 1000,
                         (loaded - started) * 1000, then, (time.perf_counter() - loaded) * 1000)
            except BaseException:
                if entry.backend is not None and not entry.admission.open:
                    entry.backend.client.admitted = False
                raise
            finally:
                self._swapping.discard(name)

    async def _make_room(self, wanted: str) -> None:
        """Unload the least recently used loaded models until `wanted` fits within the bound."""
        if self.max_loaded <= 0:
            return
        while True:
            others = [e for e in self.entries.values() if e.status == LOADED and e.name != wanted]
            if len(others) < self.max_loaded:
                return
            victim = min(others, key=lambda e: e.last_used)
            await self._unload(victim, f"to make room for {wanted!r}")

    async def unload(self, name: str, why: str, expired: bool = False) -> None:
        """Save the model's changed slots and unload it (a client's keep_alive 0, an operator's ask); `expired`:
        only if its keep_alive still has run out once the switch is free (a turn may have come meanwhile)."""
        entry = self.entry(name)
        async with self._lock:
            if entry.status != LOADED:
                return
            if expired and (entry.expires is None or entry.expires > time.time() or entry.admission.in_flight):
                return
            await self._unload(entry, why)

    async def _unload(self, entry: ModelEntry, why: str) -> None:
        self._swapping.add(entry.name)
        admission = entry.admission
        admission.open = False
        try:
            if not await admission.drained(self._swap_wait):
                admission.open = entry.backend is not None
                raise UpstreamUnavailable(
                    f"model {entry.name!r} is still answering {admission.in_flight} request(s) after "
                    f"{self._swap_wait:g} s, and it is not unloaded under a running answer; try again later")
            started = time.perf_counter()
            backend = entry.backend
            saved: list[str] = []
            if backend is not None:
                changed = [str(s.occupant) for s in backend.pool.slots if s.dirty and s.occupant is not None]
                flushed = await flush(backend.pool)
                saved = changed if not flushed.failed else []
                if flushed.failed:
                    log.warning("model %r: saving %d changed slot(s) before its unload failed; they lose their "
                                "latest turns", entry.name, flushed.failed)
                observed = backend.pool.generations()
                backend.client.admitted = False
            flushed_at = time.perf_counter()
            await self.api.unload(entry.name, self._load_timeout)
            entry.status = "unloaded"
            entry.unloads += 1
            entry.saved_at_unload = saved
            entry.expires = None
            if backend is not None:
                backend.pool.reset_slots(observed, f"model {entry.name!r} was unloaded")
            log.info("model %r unloaded (%s) in %.0f ms (saving %.0f ms); %d changed slot(s) were saved first%s",
                     entry.name, why, (time.perf_counter() - started) * 1000, (flushed_at - started) * 1000,
                     len(saved), f": {', '.join(saved)}" if saved else "")
        except BaseException:
            if entry.backend is not None and entry.status == LOADED:
                entry.backend.client.admitted = True
                admission.open = True
            raise
        finally:
            self._swapping.discard(entry.name)

    def lost(self, entry: ModelEntry, reason: str) -> None:
        """The router no longer has the model loaded, though the switch did not unload it: what its slots held is
        gone. Turns admitted before fail as their connection does; the next one loads it again."""
        entry.status = "unloaded"
        entry.admission.open = False
        backend = entry.backend
        if backend is not None:
            backend.client.admitted = False
            backend.pool.reset_slots(backend.pool.generations(), reason)
        log.warning("model %r is no longer loaded on the router (%s): its conversations restore from disk at their "
                    "next turn", entry.name, reason)

    async def watch(self) -> None:
        while True:
            await self.check()
            await self._expire()
            await asyncio.sleep(WATCH_SECONDS)

    async def check(self) -> None:
        """Read the router's model list (and health) once, and take any model it unloaded on its own for lost."""
        probe = await self.api.client.probe()
        self.health.probed(probe)
        if probe is not Probe.OK:
            if probe is Probe.REFUSED:
                for entry in self.entries.values():
                    if entry.status == LOADED and entry.name not in self._swapping:
                        self.lost(entry, "the router is not answering")
            return
        try:
            models = await self.api.models()
        except SlotkeeperError as exc:
            log.debug("reading the router's models failed: %s", exc)
            return
        now = {m.name: m for m in models}
        for entry in list(self.entries.values()):
            if entry.name in self._swapping:
                continue
            seen = now.get(entry.name)
            if entry.status == LOADED and (seen is None or not seen.loaded):
                self.lost(entry, "the router unloaded it, or its server stopped")
        self.learn(models)
        if not self.health.up:
            self.health.mark_up()
