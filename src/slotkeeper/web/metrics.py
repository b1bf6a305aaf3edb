"""Prometheus metrics at `/metrics`: request outcomes and token counts as they happen, cache state read at scrape.

Each app has its own registry. Counters of the pool and the store are read from them when scraped, never copied.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slotkeeper import __version__
from slotkeeper.cache.store import QUARANTINE_DIR
from slotkeeper.journal import RequestEntry
from slotkeeper.web.state import AppState, app_state

router = APIRouter()

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQUEST_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_BYTES = tuple(float(2**n) for n in range(20, 36, 2))  # 1 MiB .. 16 GiB


class Metrics:
    """The registry of one running slotkeeper; subscribes to its request journal and cache events."""

    def __init__(self, state: AppState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("slotkeeper_requests", "Requests by API and how their slot got its state "
                                "(hot, restored, prefix, cold).", ["api", "cache"], registry=r)
        self.request_errors = Counter("slotkeeper_request_errors", "Requests answered with an HTTP error status "
                                      "(499: the client hung up).", ["api", "status"], registry=r)
        self.tokens_reused = Counter("slotkeeper_tokens_reused", "Prompt tokens the backend took from the slot's "
                                     "state instead of prefilling (timings.cache_n).", registry=r)
        self.tokens_prefilled = Counter("slotkeeper_tokens_prefilled", "Prompt tokens the backend prefilled "
                                        "(timings.prompt_n).", registry=r)
        self.tokens_generated = Counter("slotkeeper_tokens_generated", "Tokens generated (timings.predicted_n).",
                                        registry=r)
        self.seconds_saved = Counter("slotkeeper_prefill_seconds_saved", "Estimated prefill time avoided: reused "
                                     "tokens at the measured prefill rate, by cache path.", ["cache"], registry=r)
        self.request_seconds = Histogram("slotkeeper_request_duration_seconds", "Time from slot lease to the end "
                                         "of the response.", ["api"], buckets=_REQUEST_SECONDS, registry=r)
        self.save_seconds = Histogram("slotkeeper_save_duration_seconds", "Time to save a slot and index the "
                                      "snapshot.", buckets=_SECONDS, registry=r)
        self.restore_seconds = Histogram("slotkeeper_restore_duration_seconds", "Time to restore a snapshot into a "
                                         "slot.", buckets=_SECONDS, registry=r)
        self.save_bytes = Histogram("slotkeeper_save_bytes", "Size of each saved snapshot.", buckets=_BYTES,
                                    registry=r)
        self.restore_bytes = Histogram("slotkeeper_restore_bytes", "Size of each restored snapshot.", buckets=_BYTES,
                                       registry=r)
        self.backend_up = Gauge("slotkeeper_backend_up", "1 when the backend answered /health at the last scrape.",
                                registry=r)
        r.register(_StateCollector(state))
        self._journal = state.service.journal
        self._journal.subscribe(self.observe_request)
        state.pool.events.subscribe(self)

    def observe_request(self, entry: RequestEntry) -> None:
        self.requests.labels(entry.api, entry.cache).inc()
        if entry.status >= 400:
            self.request_errors.labels(entry.api, str(entry.status)).inc()
        self.tokens_reused.inc(entry.cache_n or 0)
        self.tokens_prefilled.inc(entry.prompt_n or 0)
        self.tokens_generated.inc(entry.predicted_n or 0)
        self.request_seconds.labels(entry.api).observe(entry.ms / 1000)
        self.seconds_saved.labels(entry.cache).inc(entry.prefill_seconds_saved(self._journal.ms_per_token))

    # CacheObserver
    def saved(self, ms: float, n_bytes: int, n_tokens: int) -> None:
        self.save_seconds.observe(ms / 1000)
        self.save_bytes.observe(n_bytes)

    def restored(self, ms: float, n_bytes: int, n_tokens: int) -> None:
        self.restore_seconds.observe(ms / 1000)
        self.restore_bytes.observe(n_bytes)

    async def render(self, state: AppState) -> bytes:
        self.backend_up.set(1 if await state.client.healthy() else 0)
        return await asyncio.to_thread(generate_latest, self.registry)


class _StateCollector(Collector):
    """Reads the pool's counters, the slots and the snapshot index when scraped."""

    def __init__(self, state: AppState) -> None:
        self._state = state

    def describe(self) -> list[Metric]:
        return []  # values are read at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        state = self._state
        pool, stats = state.pool, state.pool.restore_stats
        yield _counter("slotkeeper_saves", "Slot states saved to disk.", pool.saves)
        yield _counter("slotkeeper_failed_saves", "Saves that failed (the previous snapshot was kept).",
                       pool.failed_saves)
        yield _counter("slotkeeper_restores", "Snapshots restored into a slot.", pool.restores)
        yield _counter("slotkeeper_restores_effective", "Restores the next response reused (timings.cache_n).",
                       stats.effective)
        yield _counter("slotkeeper_restores_ineffective", "Restores the next response did not reuse: the model may "
                       "not support restoring (see docs/troubleshooting.md).", stats.ineffective)
        yield _gauge("slotkeeper_restore_effective", "0 once restoring was switched off for this backend.",
                     0 if stats.disabled else 1)
        yield _gauge("slotkeeper_queue_length", "Requests waiting for a slot.", pool.queue_length)
        slots = pool.slots
        yield _gauge("slotkeeper_slots", "Slots of the backend.", len(slots))
        yield _gauge("slotkeeper_slots_occupied", "Slots holding a session's state.",
                     sum(s.occupant is not None for s in slots))
        yield _gauge("slotkeeper_slots_busy", "Slots leased to a running request or being saved.",
                     sum(s.busy for s in slots))
        yield _gauge("slotkeeper_slots_dirty", "Slots whose state changed since their last save.",
                     sum(s.dirty for s in slots))
        tokens = GaugeMetricFamily("slotkeeper_slot_tokens", "Tokens in each slot's state.", labels=["slot"])
        for slot in slots:
            tokens.add_metric([str(slot.slot_id)], slot.n_tokens)
        yield tokens
        snapshots = state.store.list()
        yield _gauge("slotkeeper_snapshots", "Session snapshots in the index.", len(snapshots))
        yield _gauge("slotkeeper_snapshot_bytes", "Bytes of the indexed snapshot files.",
                     sum(s.n_bytes for s in snapshots))
        yield _gauge("slotkeeper_quarantined_files", "Snapshot files moved aside after failing a check.",
                     _count_files(state.store.slot_dir / QUARANTINE_DIR))
        if state.supervisor is not None:
            yield _counter("slotkeeper_backend_restarts", "Times slotkeeper restarted the server it runs (launch and "
                           "embedded modes) after it exited on its own.", state.supervisor.restarts)
        info = GaugeMetricFamily("slotkeeper_info", "This slotkeeper and its backend.",
                                 labels=["version", "model", "fingerprint"])
        info.add_metric([__version__, state.backend.model_id, state.backend.fingerprint], 1)
        yield info


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _count_files(path: os.PathLike[str]) -> int:
    try:
        return sum(1 for entry in os.scandir(path) if entry.is_file())
    except FileNotFoundError:
        return 0


def metrics_of(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


@router.get("/metrics", include_in_schema=False)
async def scrape(request: Request) -> Response:
    body = await metrics_of(request).render(app_state(request))
    return Response(body, media_type=CONTENT_TYPE_LATEST)
