"""One turn end to end: lease a slot for the session, send the request to the backend, release with the outcome.

Speaks no client dialect itself: routes hand it a session and an upstream body and frame what comes back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from slotkeeper.cache.chain import Link, message_chain
from slotkeeper.cache.cutting import request_tokens, system_prefix
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.slots import SlotLease, TurnEnd
from slotkeeper.cache.systemprompt import SystemPrompt, system_prompt_of, warmup_prompt_body
from slotkeeper.cache.tokens import Tokens
from slotkeeper.dialects.framing import SseDecoder, TimingsScanner, UpstreamEvent
from slotkeeper.errors import SlotkeeperError, UpstreamError
from slotkeeper.journal import RequestEntry, RequestJournal
from slotkeeper.types import SessionKey, Snapshot, SnapshotKind
from slotkeeper.upstream.client import UpstreamClient, iter_errors_as_unavailable
from slotkeeper.upstream.health import BackendHealth
from slotkeeper.upstream.wire import TransportError, WireResponse

log = logging.getLogger("slotkeeper.turn")


class SharedBring(Protocol):
    """What a turn needs of the shared tier (fleet/shared.py, a layer above this one, which wires it in): the newest
    version of a snapshot made local when another host has one."""

    async def bring(self, key: SessionKey, kind: SnapshotKind) -> Snapshot | None: ...

BodyBuilder = Callable[[int], Mapping[str, Any]]
# Whether the client hung up (Starlette's Request.is_disconnected): a request waiting for the backend stops then.
HungUp = Callable[[], Awaitable[bool]]
# Lets a turn run on a model of a router (serving/swaps.py: loading it first when it is not); returns what the turn
# calls when it ends.
Admit = Callable[[HungUp | None], Awaitable[Callable[[], None]]]


@dataclass
class TurnRecord:
    """What happened to one request's cache, for its log line and response headers."""

    api: str
    key: SessionKey
    lease: SlotLease
    started: float = field(default_factory=time.perf_counter)
    timings: dict[str, Any] | None = None
    status: int = 200
    end: TurnEnd = TurnEnd.CANCELLED
    journal: RequestJournal | None = None
    backend: str = ""  # the URL of the backend that ran the turn
    on_finish: Callable[[], None] | None = None  # the turn leaves its model's admission (swaps.py)

    def headers(self) -> dict[str, str]:
        headers = {"X-Slotkeeper-Session": header_safe(self.key.session_id),
                   "X-Slotkeeper-Cache": self.lease.cache.outcome, "X-Slotkeeper-Slot": str(self.lease.slot_id)}
        if self.backend:
            headers["X-Slotkeeper-Backend"] = self.backend
        if self.lease.side:
            headers["X-Slotkeeper-Request"] = "side"
        return headers

    def n_tokens(self) -> int:
        t = self.timings or {}
        return int(t.get("cache_n", 0)) + int(t.get("prompt_n", 0)) + int(t.get("predicted_n", 0))

    def finish(self, end: TurnEnd) -> None:
        self.end = end
        t = self.timings or {}
        cache_n = t.get("cache_n")
        n_prompt = int(t.get("cache_n", 0) or 0) + int(t.get("prompt_n", 0) or 0)
        self.lease.release(end, self.n_tokens(), int(cache_n) if isinstance(cache_n, int | float) else None,
                           n_prompt, _float(t.get("prompt_ms")))
        cache = self.lease.cache
        entry = RequestEntry(
            self.api, self.lease.side, self.key.model, self.key.session_id, self.lease.slot_id, str(cache.outcome),
            cache.restored_tokens, cache.restore_ms, cache.save_ms, _int(t.get("cache_n")),
            _int(t.get("prompt_n")), _int(t.get("predicted_n")), _float(t.get("prompt_ms")), self.status, end.value,
            (time.perf_counter() - self.started) * 1000, restored_from=cache.restored_from, why=str(cache.why),
            why_detail=cache.detail, decide_ms=cache.decide_ms, domain=self.key.domain, lease_ms=cache.lease_ms,
        )
        log.info("%s", entry.log_line(), extra={"request": entry})
        if self.journal is not None:
            self.journal.add(entry)
        if self.on_finish is not None:
            self.on_finish()


class TurnService:
    def __init__(self, client: UpstreamClient, pool: SlotPool, health: BackendHealth | None = None,
                 backend_wait: float = 30.0) -> None:
        self.client = client
        self.pool = pool
        self.journal = RequestJournal()
        # While the backend is down (BackendHealth), a request waits up to `backend_wait` seconds for it to come
        # back before it fails in its client's dialect; 0 fails it at once.
        self.health = health if health is not None else BackendHealth(client.base_url)
        self.backend_wait = backend_wait
        # The shared tier (fleet/shared.py) when snapshots are kept in an object store too: a turn first brings in
        # the newest version of its session's and system prompt's snapshots when this host lacks them.
        self.shared: SharedBring | None = None
        # A model of a router: each turn is admitted by the model switch (swaps.py), which loads the model first when
        # it is not loaded, and never unloads it while the turn runs.
        self.admit: Admit | None = None

    async def _backend_up(self, hung_up: HungUp | None) -> Callable[[], None] | None:
        """Wait for the backend (or have a router's model loaded); returns what the turn calls at its end, if
        anything."""
        if self.admit is not None:
            return await self.admit(hung_up)
        if not self.health.up:
            log.debug("waiting up to %g s for the backend at %s", self.backend_wait, self.client.base_url)
        await self.health.wait_up(self.backend_wait, hung_up)
        return None

    async def unary(self, api: str, key: SessionKey, path: str, build: BodyBuilder,
                    side: bool = False, hung_up: HungUp | None = None,
                    chat: Mapping[str, Any] | None = None,
                    chain: Sequence[Link] | None = None) -> tuple[Any, TurnRecord]:
        """A non-streaming turn: returns the backend's JSON answer and the record of what the cache did.

        A side request (a title or tag task) runs without becoming its session's state (see SlotPool.acquire).
        While the backend is down the turn waits for it (bounded; `hung_up` says when the client went away).
        `chat` is the chat body the turn stands for when the upstream body is not one, and `chain` the request's
        chain where it is not the body's message chain (an /infill's parts); see `_acquire`.
        """
        lease, leave = await self._admitted(key, build, side, hung_up, chat, chain)
        record = TurnRecord(api, key, lease, journal=self.journal, backend=self.client.base_url, on_finish=leave)
        end = TurnEnd.CANCELLED
        body = build(record.lease.slot_id)
        record.lease.replay = (path, body)
        try:
            data = await self.client.post_json(path, body)
            if isinstance(data, dict) and isinstance(data.get("timings"), dict):
                record.timings = data["timings"]
            end = TurnEnd.COMPLETED
            return data, record
        except UpstreamError as exc:
            record.status, end = exc.status_code, TurnEnd.REJECTED
            raise
        except SlotkeeperError as exc:
            record.status, end = exc.status_code, TurnEnd.FAILED
            raise
        finally:
            record.finish(end)

    async def open_stream(self, api: str, key: SessionKey, path: str, build: BodyBuilder,
                          side: bool = False, hung_up: HungUp | None = None, chat: Mapping[str, Any] | None = None,
                          chain: Sequence[Link] | None = None) -> StreamTurn:
        """Lease a slot and open the backend's stream; an error answer is raised before any byte reaches the client.
        The backend is waited for as in `unary`, and `chat` and `chain` are as there."""
        lease, leave = await self._admitted(key, build, side, hung_up, chat, chain)
        record = TurnRecord(api, key, lease, journal=self.journal, backend=self.client.base_url, on_finish=leave)
        body = build(record.lease.slot_id)
        lease.replay = (path, body)
        context = self.client.stream(path, body)
        try:
            response = await context.__aenter__()
        except UpstreamError as exc:
            record.status = exc.status_code
            record.finish(TurnEnd.REJECTED)
            raise
        except BaseException as exc:
            record.status = exc.status_code if isinstance(exc, SlotkeeperError) else 499
            record.finish(TurnEnd.FAILED if isinstance(exc, SlotkeeperError) else TurnEnd.CANCELLED)
            raise
        return StreamTurn(record, response, context, self.client.base_url)

    async def _admitted(self, key: SessionKey, build: BodyBuilder, side: bool, hung_up: HungUp | None,
                        chat: Mapping[str, Any] | None, chain: Sequence[Link] | None
                        ) -> tuple[SlotLease, Callable[[], None] | None]:
        """Wait for the backend (or have the router's model loaded), then lease a slot; returns the lease and what
        the turn calls at its end (which is called here already if no lease was had)."""
        leave = await self._backend_up(hung_up)
        try:
            started = time.perf_counter()
            lease = await self._acquire(key, build, side, chat=chat, chain=chain)
            lease.cache.lease_ms = (time.perf_counter() - started) * 1000
            return lease, leave
        except BaseException:
            if leave is not None:
                leave()
            raise

    async def _acquire(self, key: SessionKey, build: BodyBuilder, side: bool,
                       chat: Mapping[str, Any] | None = None, chain: Sequence[Link] | None = None) -> SlotLease:
        """Lease a slot for the turn, with the state that shares the most with the request brought into it.

        The chain and the system part come from the upstream body's `messages`, or from `chat`: the chat body a
        route derived for an upstream body that has none (a Responses body's `instructions` and `input`). A given
        `chain` wins (an /infill's parts); without either, a raw prompt has none. The request's exact tokens are
        asked of the backend only when the planner needs them (cutting.py)."""
        body = chat if chat is not None else build(0)  # build: the same for every slot id, so any id will do
        messages = body.get("messages")
        if chain is None:
            chain = message_chain(messages, body.get("tools")) if isinstance(messages, list) else []
        part = None if side else system_prompt_of(body)
        system = part.without_instructions() if part is not None else None
        if self.shared is not None and not side:
            await self._bring_shared(key, system)

        # A way back up, on purpose: the request's exact tokens cost the backend a render and a tokenization, and
        # only the pool's planning knows whether the chains leave open which state shares the most (most turns never
        # ask). So the pool gets a way to ask, instead of the tokens up front.
        async def tokens() -> Tokens | None:
            return await request_tokens(self.client, body) if isinstance(messages, list) else None

        lease = await self.pool.acquire(key, chain, side=side, system=system, tokens=tokens)
        changed = lease.cache.changed_at
        if changed is not None and isinstance(messages, list) and changed < len(messages):
            # The changed message's role, as the client sent it: `message 3 (user) differs ...`.
            role = messages[changed].get("role") if isinstance(messages[changed], dict) else None
            if isinstance(role, str):
                lease.cache.detail = lease.cache.detail.replace(f"message {changed + 1} ",
                                                                f"message {changed + 1} ({role}) ", 1)
        return lease

    async def _bring_shared(self, key: SessionKey, system: SystemPrompt | None) -> None:
        """Before the pool plans the turn: the session's snapshot (unless a slot holds it) and its system prompt's
        (unless this host has one) from the shared tier, when it has a newer one. A failure costs a prefill."""
        assert self.shared is not None
        if key.is_default or self.pool.holds(key):
            return  # a hot turn: nothing to look up
        try:
            await self.shared.bring(key, SnapshotKind.SESSION)
            if system is not None and self.pool.system_snapshots and await self.pool.snapshots.get(key) is None:
                system_key = key.within(system.digest)
                if await self.pool.snapshots.system(system_key, checked=False) is None:
                    await self.shared.bring(system_key, SnapshotKind.SYSTEM)
        except Exception as exc:  # the shared tier must never fail a turn
            log.warning("bringing %s in from the shared store failed (%s): the turn starts from what this host has",
                        key, exc.message if isinstance(exc, SlotkeeperError) else repr(exc))

    async def prewarm(self, model: str, system: SystemPrompt, progress: ProgressCallback | None = None,
                      pin: bool = False, domain: str = "") -> Prewarm:
        """Warm a system prompt up ahead of time and keep it as its system snapshot (an operator's pre-warm) in
        cache domain `domain`; `pin` keeps it from the disk budget.

        Raises the backend's error when the warm-up fails; nothing is saved then.
        """
        leave = await self._backend_up(None)
        try:
            started = time.perf_counter()
            held = await self.pool.warm_lease(model, system, domain)
            end = TurnEnd.FAILED
            try:
                snapshot = held.existing if held.existing is not None else await self._warm_up(held, progress)
                end = TurnEnd.COMPLETED
            finally:
                held.release(end)
        finally:
            if leave is not None:
                leave()
        if snapshot is None:
            return Prewarm(system.digest, "too-short", self.pool.slots[held.slot_id].n_tokens, 0, False,
                           _ms_since(started))
        if pin:
            key = snapshot.key
            snapshot = await self.pool.snapshots.set_pinned(key, True, snapshot.kind) or snapshot
        status = "exists" if held.existing is not None else "saved"
        return Prewarm(system.digest, status, snapshot.n_tokens, snapshot.n_bytes, snapshot.pinned,
                       _ms_since(started))

    async def _warm_up(self, lease: SlotLease, progress: ProgressCallback | None = None,
                       wait: bool = True) -> Snapshot | None:
        """Evaluate the lease's system part into its slot and save it as the system snapshot (returned when `wait`:
        once committed; a turn goes on without waiting for the commit). A failed warm-up is logged and raised, and
        saves nothing."""
        system = lease.system
        assert system is not None
        started = time.perf_counter()
        try:
            n_tokens = await self._run_warm_up(lease.slot_id, system, progress)
        except SlotkeeperError as exc:
            self.pool.warmups.failed(lease)
            log.warning("warming up system prompt %s in slot %d failed, so no system snapshot was saved: %s",
                        system.short_id, lease.slot_id, exc.message)
            raise
        finally:
            lease.cache.warm_ms = _ms_since(started)
        snapshot = await self.pool.warmups.save_system(lease, n_tokens, wait=wait)
        log.info("system prompt %s warmed up in slot %d: %d tokens in %.0f ms%s", system.short_id, lease.slot_id,
                 n_tokens, lease.cache.warm_ms, ", saved" if snapshot is not None else "")
        return snapshot

    async def _run_warm_up(self, slot_id: int, system: SystemPrompt, progress: ProgressCallback | None) -> int:
        """Send the warm-up request; returns the prompt's token count. With `progress`, the backend reports how far
        its prefill got (return_progress) and each report is passed on.

        The warm-up evaluates the rendered system part up to where a first user message's own text begins (the
        common prefix of two renderings), so every new conversation on it strictly extends the snapshot; a backend
        without /apply-template gets the system part with an empty user message instead."""
        prefix = await system_prefix(self.client, system)
        if prefix is not None:
            path, body = "/completion", warmup_prompt_body(prefix, slot_id, progress=progress is not None)
        else:
            path, body = "/v1/chat/completions", system.warmup_body(slot_id, progress=progress is not None)
        if progress is None:
            data = await self.client.post_json(path, body)
            return _prompt_tokens(data.get("timings") if isinstance(data, dict) else None)
        timings: Any = None
        decoder = SseDecoder()
        try:
            async with self.client.stream(path, body) as response:
                async for chunk in response.aiter_raw():
                    for event in decoder.feed(chunk):
                        if not isinstance(event, dict):
                            continue
                        if "error" in event:
                            raise UpstreamError(502, json.dumps({"error": event["error"]}).encode())
                        report = event.get("prompt_progress")
                        if isinstance(report, dict):
                            await progress(int(report.get("processed", 0)), int(report.get("total", 0)))
                        if isinstance(event.get("timings"), dict):
                            timings = event["timings"]
        except TransportError as exc:
            raise iter_errors_as_unavailable(exc, self.client.base_url) from exc
        return _prompt_tokens(timings)



@dataclass(frozen=True, slots=True)
class Prewarm:
    """What a pre-warm did: saved a new system snapshot, found one, or found the prompt too short for one."""

    digest: str
    status: str  # "saved", "exists" or "too-short"
    n_tokens: int
    n_bytes: int
    pinned: bool
    ms: float


ProgressCallback = Callable[[int, int], Awaitable[None]]


def _prompt_tokens(timings: object) -> int:
    if not isinstance(timings, dict):
        raise UpstreamError(502, b'{"error": {"message": "the backend answered the warm-up without timings"}}')
    return int(timings.get("cache_n") or 0) + int(timings.get("prompt_n") or 0)


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


class StreamTurn:
    """A streaming turn in flight. `chunks()` yields the backend's bytes as they come; `close()` always runs last."""

    def __init__(self, record: TurnRecord, response: WireResponse,
                 context: AbstractAsyncContextManager[WireResponse], base_url: str) -> None:
        self.record = record
        self.response = response
        self._context = context
        self._base_url = base_url
        self._scanner = TimingsScanner()
        self._end = TurnEnd.CANCELLED
        self._closed = False

    @property
    def status_code(self) -> int:
        return self.response.status_code

    @property
    def media_type(self) -> str:
        return str(self.response.headers.get("content-type", "text/event-stream"))

    async def chunks(self, on_error: Callable[[SlotkeeperError], bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.aiter_raw():
                self._scanner.feed(chunk)
                if self._scanner.saw_done:
                    # The client has the whole answer once it has `[DONE]`; one that hangs up before the backend's
                    # connection ends (the openai client closes at `[DONE]`) did not cut the turn short.
                    self._end = TurnEnd.COMPLETED
                yield chunk
        except TransportError as exc:
            error = iter_errors_as_unavailable(exc, self._base_url)
            self._end, self.record.status = TurnEnd.FAILED, error.status_code
            log.error("stream for %s broke: %s", self.record.key, error.message)
            yield on_error(error)
            return
        self._scanner.finish()
        self.record.timings = self._scanner.timings
        self._end = TurnEnd.COMPLETED

    async def events(self) -> AsyncIterator[UpstreamEvent]:
        """The backend's stream as parsed events, for dialects that re-frame it. A broken connection is raised as
        UpstreamUnavailable after the turn is marked failed; an `{"error": ...}` event is passed on as it is."""
        decoder = SseDecoder()
        errored = False
        try:
            async for chunk in self.response.aiter_raw():
                for event in decoder.feed(chunk):
                    if isinstance(event, dict):
                        if isinstance(event.get("timings"), dict):
                            self.record.timings = event["timings"]
                        errored = errored or "error" in event
                    yield event
        except TransportError as exc:
            error = iter_errors_as_unavailable(exc, self._base_url)
            self._end, self.record.status = TurnEnd.FAILED, error.status_code
            log.error("stream for %s broke: %s", self.record.key, error.message)
            raise error from exc
        for event in decoder.finish():
            yield event
        if not errored:
            self._end = TurnEnd.COMPLETED

    async def close(self) -> None:
        """Close the backend connection (which stops its generation) and give the slot back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.shield(self._context.__aexit__(None, None, None))
        except (TransportError, SlotkeeperError):
            pass
        finally:
            if self.record.timings is None:
                self.record.timings = self._scanner.timings
            if self._end is TurnEnd.CANCELLED:
                self.record.status = 499
            self.record.finish(self._end)


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def header_safe(value: str) -> str:
    """Header values must be latin-1; percent-encode anything else."""
    return value if value.isascii() and value.isprintable() else urllib.parse.quote(value, safe="")
