"""One turn end to end: lease a slot for the session, send the request to the backend, release with the outcome.

Speaks no client dialect itself: routes hand it a session and an upstream body and frame what comes back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import httpx

from slotkeeper.cache.chain import Link, message_chain
from slotkeeper.cache.pool import SlotLease, SlotPool, TurnEnd
from slotkeeper.dialects.framing import SseDecoder, TimingsScanner, UpstreamEvent
from slotkeeper.errors import SlotkeeperError, UpstreamError, UpstreamUnavailable
from slotkeeper.journal import RequestEntry, RequestJournal
from slotkeeper.types import SessionKey
from slotkeeper.upstream.client import UpstreamClient, iter_errors_as_unavailable

log = logging.getLogger("slotkeeper.turn")

BodyBuilder = Callable[[int], Mapping[str, Any]]


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

    def headers(self) -> dict[str, str]:
        headers = {"X-Slotkeeper-Session": header_safe(self.key.session_id), "X-Slotkeeper-Cache": self.lease.outcome,
                   "X-Slotkeeper-Slot": str(self.lease.slot_id)}
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
        self.lease.release(end, self.n_tokens(), int(cache_n) if isinstance(cache_n, int | float) else None)
        entry = RequestEntry(
            self.api, self.lease.side, self.key.model, self.key.session_id, self.lease.slot_id, str(self.lease.outcome),
            self.lease.restored_tokens, self.lease.restore_ms, self.lease.save_ms, _int(t.get("cache_n")),
            _int(t.get("prompt_n")), _int(t.get("predicted_n")), _float(t.get("prompt_ms")), self.status, end.value,
            (time.perf_counter() - self.started) * 1000,
        )
        log.info("%s", entry.log_line(), extra={"request": entry})
        if self.journal is not None:
            self.journal.add(entry)


class TurnService:
    def __init__(self, client: UpstreamClient, pool: SlotPool) -> None:
        self.client = client
        self.pool = pool
        self.journal = RequestJournal()
        # Set by the backend watch: while the backend is known to be down, fail at once instead of queueing.
        self.backend_down = False

    def _check_backend(self) -> None:
        if self.backend_down:
            raise UpstreamUnavailable(f"the backend at {self.client.base_url} is not answering; try again shortly")

    async def unary(self, api: str, key: SessionKey, path: str, build: BodyBuilder,
                    side: bool = False) -> tuple[Any, TurnRecord]:
        """A non-streaming turn: returns the backend's JSON answer and the record of what the cache did.

        A side request (a title or tag task) runs without becoming its session's state (see SlotPool.acquire).
        """
        self._check_backend()
        record = TurnRecord(api, key, await self.pool.acquire(key, _chain_of(build), side=side),
                            journal=self.journal)
        end = TurnEnd.CANCELLED
        try:
            data = await self.client.post_json(path, build(record.lease.slot_id))
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
                          side: bool = False) -> StreamTurn:
        """Lease a slot and open the backend's stream; an error answer is raised before any byte reaches the client."""
        self._check_backend()
        record = TurnRecord(api, key, await self.pool.acquire(key, _chain_of(build), side=side),
                            journal=self.journal)
        context = self.client.stream(path, build(record.lease.slot_id))
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


class StreamTurn:
    """A streaming turn in flight. `chunks()` yields the backend's bytes as they come; `close()` always runs last."""

    def __init__(self, record: TurnRecord, response: httpx.Response,
                 context: AbstractAsyncContextManager[httpx.Response], base_url: str) -> None:
        self.record = record
        self.response = response
        self._context = context
        self._base_url = base_url
        self._scanner = TimingsScanner()
        self._end = TurnEnd.CANCELLED
        self._closed = False

    @property
    def media_type(self) -> str:
        return str(self.response.headers.get("content-type", "text/event-stream"))

    async def chunks(self, on_error: Callable[[SlotkeeperError], bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.aiter_raw():
                self._scanner.feed(chunk)
                yield chunk
        except httpx.HTTPError as exc:
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
        except httpx.HTTPError as exc:
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
        except (httpx.HTTPError, SlotkeeperError):
            pass
        finally:
            if self.record.timings is None:
                self.record.timings = self._scanner.timings
            if self._end is TurnEnd.CANCELLED:
                self.record.status = 499
            self.record.finish(self._end)


def _chain_of(build: BodyBuilder) -> list[Link]:
    """The message chain of the upstream body (the same for every slot id, so any id will do)."""
    body = build(0)
    messages = body.get("messages")
    return message_chain(messages, body.get("tools")) if isinstance(messages, list) else []


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def header_safe(value: str) -> str:
    """Header values must be latin-1; percent-encode anything else."""
    return value if value.isascii() and value.isprintable() else urllib.parse.quote(value, safe="")
