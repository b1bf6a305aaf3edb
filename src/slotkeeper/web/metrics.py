"""Prometheus metrics at `/metrics`: request outcomes and token counts as they happen, cache state read at scrape.

Each app has its own registry. Counters are read where they are counted (the snapshots; the pool's saver, restorer,
bringer and warm-ups) when scraped, never copied.
With several backends every per-backend series carries a `model` label (the backend's model name), and a `backend`
label (its URL) too when a model runs on several; with one, the series have no such label, as before there could be
several.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from slotkeeper import __version__
from slotkeeper.fleet.directory import Directory
from slotkeeper.journal import RequestEntry, RequestJournal
from slotkeeper.types import SnapshotKind
from slotkeeper.web.state import AppState, Backends, caught_up

router = APIRouter()

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQUEST_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_BYTES = tuple(float(2**n) for n in range(20, 36, 2))  # 1 MiB .. 16 GiB

M = TypeVar("M", bound=MetricWrapperBase)


def _child(metric: M, *labels: str) -> M:
    """The series of `metric` for these label values; a metric without labels is its own (only) series."""
    return metric.labels(*labels) if labels else metric


class Metrics:
    """The registry of one running slotkeeper; subscribes to each backend's request journal and cache events."""

    def __init__(self, served: Backends, directory: Directory | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        several = ("model",) if served.taking_turns is not None else label_names(served.all)
        by_model = list(several)
        self.requests = Counter("slotkeeper_requests", "Requests by API and how their slot got its state "
                                "(hot, restored, prefix, cold).", ["api", "cache", *by_model], registry=r)
        self.request_errors = Counter("slotkeeper_request_errors", "Requests answered with an HTTP error status "
                                      "(499: the client hung up).", ["api", "status", *by_model], registry=r)
        self.tokens_reused = Counter("slotkeeper_tokens_reused", "Prompt tokens the backend took from the slot's "
                                     "state instead of prefilling (timings.cache_n).", by_model, registry=r)
        self.tokens_prefilled = Counter("slotkeeper_tokens_prefilled", "Prompt tokens the backend prefilled "
                                        "(timings.prompt_n).", by_model, registry=r)
        self.tokens_generated = Counter("slotkeeper_tokens_generated", "Tokens generated (timings.predicted_n).",
                                        by_model, registry=r)
        self.reasons = Counter("slotkeeper_turn_reasons", "Requests by why the backend prefilled what it did (hot, "
                               "own, new-session, rewritten, evicted, side-task, ...: docs/clients.md).",
                               ["reason", *by_model], registry=r)
        self.prefilled_by_reason = Counter("slotkeeper_tokens_prefilled_by_reason", "Prompt tokens prefilled, by "
                                           "the request's reason.", ["reason", *by_model], registry=r)
        self.seconds_saved = Counter("slotkeeper_prefill_seconds_saved", "Estimated prefill time avoided: reused "
                                     "tokens at the measured prefill rate, by cache path.", ["cache", *by_model],
                                     registry=r)
        self.request_seconds = Histogram("slotkeeper_request_duration_seconds", "Time from slot lease to the end "
                                         "of the response.", ["api", *by_model], buckets=_REQUEST_SECONDS, registry=r)
        self.save_seconds = Histogram("slotkeeper_save_duration_seconds", "Time to save a slot and index the "
                                      "snapshot.", by_model, buckets=_SECONDS, registry=r)
        self.restore_seconds = Histogram("slotkeeper_restore_duration_seconds", "Time to restore a snapshot into a "
                                         "slot.", by_model, buckets=_SECONDS, registry=r)
        self.save_bytes = Histogram("slotkeeper_save_bytes", "Size of each saved snapshot.", by_model, buckets=_BYTES,
                                    registry=r)
        self.restore_bytes = Histogram("slotkeeper_restore_bytes", "Size of each restored snapshot.", by_model,
                                       buckets=_BYTES, registry=r)
        self.backend_up = Gauge("slotkeeper_backend_up", "1 when the backend answered /health at the last scrape.",
                                by_model, registry=r)
        r.register(_StateCollector(served.all, several))
        if directory is not None:
            r.register(_DirectoryCollector(directory))
        self._served = served
        self._several = several
        for state in served.all:
            self._observe(state)
        served.on_add.append(self._observe)  # a router's model, first loaded

    def _observe(self, state: AppState) -> None:
        labels = _model_labels(state, self._several)
        journal = state.service.journal
        journal.subscribe(_RequestObserver(self, journal, labels))
        state.pool.events.subscribe(_CacheObserver(self, labels))

    def observe_request(self, entry: RequestEntry, journal: RequestJournal, model: Sequence[str] = ()) -> None:
        self.requests.labels(entry.api, entry.cache, *model).inc()
        if entry.status >= 400:
            self.request_errors.labels(entry.api, str(entry.status), *model).inc()
        _child(self.tokens_reused, *model).inc(entry.cache_n or 0)
        _child(self.tokens_prefilled, *model).inc(entry.prompt_n or 0)
        if entry.why:
            self.reasons.labels(entry.why, *model).inc()
            self.prefilled_by_reason.labels(entry.why, *model).inc(entry.prompt_n or 0)
        _child(self.tokens_generated, *model).inc(entry.predicted_n or 0)
        self.request_seconds.labels(entry.api, *model).observe(entry.ms / 1000)
        self.seconds_saved.labels(entry.cache, *model).inc(entry.prefill_seconds_saved(journal.ms_per_token))

    async def render(self) -> bytes:
        states = self._served.all
        await caught_up(states)  # so the save counters include the saves still being committed
        ups = await asyncio.gather(*(state.client.healthy() for state in states))
        for state, up in zip(states, ups, strict=True):
            _child(self.backend_up, *_model_labels(state, self._several)).set(1 if up else 0)
        return await asyncio.to_thread(generate_latest, self.registry)


@dataclass(frozen=True)
class _RequestObserver:
    """Counts one backend's finished requests (a RequestListener)."""

    metrics: Metrics
    journal: RequestJournal
    model: tuple[str, ...]

    def __call__(self, entry: RequestEntry) -> None:
        self.metrics.observe_request(entry, self.journal, self.model)


@dataclass(frozen=True)
class _CacheObserver:
    """Times one backend's saves and restores (a CacheObserver)."""

    metrics: Metrics
    model: tuple[str, ...]

    def saved(self, ms: float, n_bytes: int, n_tokens: int) -> None:
        _child(self.metrics.save_seconds, *self.model).observe(ms / 1000)
        _child(self.metrics.save_bytes, *self.model).observe(n_bytes)

    def restored(self, ms: float, n_bytes: int, n_tokens: int) -> None:
        _child(self.metrics.restore_seconds, *self.model).observe(ms / 1000)
        _child(self.metrics.restore_bytes, *self.model).observe(n_bytes)


def label_names(states: Sequence[AppState]) -> tuple[str, ...]:
    """The labels of per-backend series: none with one backend, `model` with several models, and `backend` (its URL)
    too when a model runs on several backends."""
    if len(states) == 1:
        return ()
    return ("model", "backend") if any(s.group is not None for s in states) else ("model",)


def _model_labels(state: AppState, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(state.backend.model_id if name == "model" else state.backend.url for name in names)


@dataclass(frozen=True)
class _Reading:
    """One backend as read at a scrape: its state, and the index's usage per kind (one query)."""

    state: AppState
    usage: dict[str, dict[str, int]]

    def of(self, kind: SnapshotKind, field: str) -> int:
        return self.usage.get(str(kind), {}).get(field, 0)


# The series read at scrape time, one per backend: (name, help, value).
_COUNTERS: list[tuple[str, str, Callable[[_Reading], float]]] = [
    ("slotkeeper_saves", "Slot states saved to disk.", lambda r: r.state.snapshots.saves),
    ("slotkeeper_failed_saves", "Saves that failed (the previous snapshot was kept).",
     lambda r: r.state.snapshots.failed_saves),
    ("slotkeeper_restores", "Snapshots restored into a slot.", lambda r: r.state.pool.restorer.restores),
    ("slotkeeper_failed_restores", "Restores the backend refused or broke off (the turn ran without the snapshot).",
     lambda r: r.state.pool.restorer.failed_restores),
    ("slotkeeper_restores_effective", "Restores whose next response reused (timings.cache_n) what the request "
     "shared with the restored state.", lambda r: r.state.pool.policy.effective),
    ("slotkeeper_restores_ineffective", "Restores whose next response reused less than the request shared with "
     "the restored state (see docs/architectures.md).", lambda r: r.state.pool.policy.ineffective),
    ("slotkeeper_prompt_end_steps", "Slots brought back to their last prompt's end before a save (recurrent and "
     "hybrid models on builds without checkpoints in slot files).", lambda r: r.state.pool.saver.prompt_end_steps),
    ("slotkeeper_prompt_end_tokens", "Tokens the backend processed for those steps.",
     lambda r: r.state.pool.saver.prompt_end_tokens),
    ("slotkeeper_evictions", "Snapshots the disk budget evicted since slotkeeper started.",
     lambda r: r.state.snapshots.evictions),
    ("slotkeeper_warm_ups", "System prompts evaluated into an empty slot ahead of time (an operator's pre-warm).",
     lambda r: r.state.pool.warmups.warm_ups),
    ("slotkeeper_system_cuts", "Slots cut back to their system part once their conversation was saved and idle, "
     "that part then saved as a system state (a new system prompt, met by a turn).",
     lambda r: r.state.pool.warmups.cuts),
    ("slotkeeper_failed_warm_ups", "Pre-warms and cuts the backend refused or broke off (nothing was saved).",
     lambda r: r.state.pool.warmups.failed_warm_ups),
    ("slotkeeper_token_lookups", "Requests whose tokens slotkeeper asked the backend for, because the message "
     "chains could not tell which saved state shares the most with them.",
     lambda r: r.state.pool.bringer.token_lookups),
    ("slotkeeper_token_lookup_seconds", "Time spent asking the backend for those tokens.",
     lambda r: r.state.pool.bringer.token_lookup_ms / 1000),
    ("slotkeeper_sessions_moved_in", "Sessions of a model on several backends that moved to this one (their owner "
     "was down or overloaded), their snapshot copied here.",
     lambda r: r.state.group.moved_in.get(r.state.backend.url, 0) if r.state.group is not None else 0),
    ("slotkeeper_shared_uploads", "Snapshots uploaded to the shared store (--shared-store).",
     lambda r: _shared(r, "uploads")),
    ("slotkeeper_shared_failed_uploads", "Uploads to the shared store that failed (the snapshot stayed local).",
     lambda r: _shared(r, "failed_uploads")),
    ("slotkeeper_shared_downloads", "Snapshots brought in from the shared store.", lambda r: _shared(r, "downloads")),
    ("slotkeeper_shared_refused_downloads", "Downloads from the shared store refused as damaged.",
     lambda r: _shared(r, "refused_downloads")),
    ("slotkeeper_shared_refused_older_uploads", "Saves not uploaded because the store's manifest holds a newer version "
     "of the state (it went on on another backend or replica).", lambda r: _shared(r, "refused_older")),
    ("slotkeeper_refused_older_copies", "Copies of a saved state brought in (shared store, another backend, a move) "
     "that were not newer than the one here: refused.", lambda r: r.state.snapshots.transfers.refused_older),
]


def _shared(r: _Reading, counter: str) -> float:
    tier = getattr(r.state.service, "shared", None)
    return float(getattr(tier, counter)) if tier is not None else 0.0
_GAUGES: list[tuple[str, str, Callable[[_Reading], float]]] = [
    ("slotkeeper_restore_effective", "0 while restores that did not help keep this backend on a fallback "
     "strategy (tried again later).", lambda r: 1 if r.state.pool.policy.effective_now else 0),
    ("slotkeeper_restores_possible", "0 where restores cannot help on this backend's model and build (sessions are "
     "kept hot in their slots).", lambda r: 1 if r.state.pool.policy.restores_allowed else 0),
    ("slotkeeper_queue_length", "Requests waiting for a slot.", lambda r: r.state.pool.queue_length),
    ("slotkeeper_slots", "Slots of the backend.", lambda r: len(r.state.pool.slots)),
    ("slotkeeper_slots_occupied", "Slots holding a session's state.",
     lambda r: sum(s.occupant is not None for s in r.state.pool.slots)),
    ("slotkeeper_slots_busy", "Slots leased to a running request or being saved.",
     lambda r: sum(s.busy for s in r.state.pool.slots)),
    ("slotkeeper_slots_dirty", "Slots whose state changed since their last save.",
     lambda r: sum(s.dirty for s in r.state.pool.slots)),
    ("slotkeeper_snapshots", "Session snapshots (conversations) in the index.",
     lambda r: r.of(SnapshotKind.SESSION, "count")),
    ("slotkeeper_snapshot_bytes", "Bytes of the indexed session snapshot files.",
     lambda r: r.of(SnapshotKind.SESSION, "bytes")),
    ("slotkeeper_system_snapshots", "System-prompt snapshots in the index.",
     lambda r: r.of(SnapshotKind.SYSTEM, "count")),
    ("slotkeeper_system_snapshot_bytes", "Bytes of the indexed system-prompt snapshot files.",
     lambda r: r.of(SnapshotKind.SYSTEM, "bytes")),
    ("slotkeeper_pinned_snapshots", "Snapshots of either kind pinned (never evicted by the disk budget).",
     lambda r: sum(u.get("pinned", 0) for u in r.usage.values())),
    ("slotkeeper_disk_budget_bytes", "The disk budget's total size limit (0: none).",
     lambda r: r.state.snapshots.budget.max_bytes),
    ("slotkeeper_stored_bytes", "Bytes the saved states take on disk: whole files, tails, each KV block once.",
     lambda r: r.state.snapshots.stored_bytes_now()),
    ("slotkeeper_kv_blocks", "KV blocks in the block store, each stored once however many states share it.",
     lambda r: r.state.snapshots.blocks_now()[0]),
    ("slotkeeper_kv_block_bytes", "Bytes of the KV blocks in the block store.",
     lambda r: r.state.snapshots.blocks_now()[1]),
    ("slotkeeper_ram_copy_bytes", "Bytes of snapshot copies in the RAM dir (0 without one).",
     lambda r: r.state.snapshots.ram_bytes_now()),
    ("slotkeeper_ram_budget_bytes", "The RAM dir's budget for snapshot copies (0 without a RAM dir).",
     lambda r: r.state.snapshots.ram_budget),
    ("slotkeeper_quarantined_files", "Snapshot files moved aside after failing a check.",
     lambda r: r.state.snapshots.quarantined_now()),
]


class _DirectoryCollector(Collector):
    """The session directory of several replicas (--directory), read when scraped."""

    def __init__(self, directory: Directory) -> None:
        self._directory = directory

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        d = self._directory
        yield GaugeMetricFamily("slotkeeper_directory_up", "1 while the session directory (--directory) answers; 0: "
                                "this replica places sessions on its own backends.", value=0 if d.down else 1)
        yield GaugeMetricFamily("slotkeeper_replicas", "Replicas with a live heartbeat, this one included.",
                                value=d.replica_count)
        yield GaugeMetricFamily("slotkeeper_leases_held", "Session leases this replica holds.", value=d.leases_held)
        yield CounterMetricFamily("slotkeeper_forwarded", "Requests forwarded to the replica holding their session.",
                                  value=d.forwarded)
        yield CounterMetricFamily("slotkeeper_leases_taken", "Session leases this replica took.",
                                  value=d.leases_taken)
        yield CounterMetricFamily("slotkeeper_leases_lost", "Leases that ran out before this replica could refresh "
                                  "them.", value=d.leases_lost)


class _StateCollector(Collector):
    """Reads each backend's counters, slots and snapshot index when scraped."""

    def __init__(self, states: Sequence[AppState], several: tuple[str, ...]) -> None:
        self._states = states  # the Backends' own list: a router's model first loaded later is in it
        self._by_model = list(several)
        self._several = several

    def describe(self) -> list[Metric]:
        return []  # values are read at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        readings = [_Reading(state, state.snapshots.usage_now()) for state in self._states]
        labels = [list(_model_labels(r.state, self._several)) for r in readings]
        for name, documentation, read in _COUNTERS:
            counter = CounterMetricFamily(name, documentation, labels=self._by_model)
            for reading, values in zip(readings, labels, strict=True):
                counter.add_metric(values, read(reading))
            yield counter
        for name, documentation, read in _GAUGES:
            gauge = GaugeMetricFamily(name, documentation, labels=self._by_model)
            for reading, values in zip(readings, labels, strict=True):
                gauge.add_metric(values, read(reading))
            yield gauge
        tokens = GaugeMetricFamily("slotkeeper_slot_tokens", "Tokens in each slot's state.",
                                   labels=["slot", *self._by_model])
        for reading, values in zip(readings, labels, strict=True):
            for slot in reading.state.pool.slots:
                tokens.add_metric([str(slot.slot_id), *values], slot.n_tokens)
        yield tokens
        supervised = [(r.state.supervisor, values) for r, values in zip(readings, labels, strict=True)
                      if r.state.supervisor is not None]
        if supervised:
            restarts = CounterMetricFamily("slotkeeper_backend_restarts", "Times slotkeeper restarted the server it "
                                           "runs (launch and embedded modes) after it exited on its own.",
                                           labels=self._by_model)
            for supervisor, values in supervised:
                restarts.add_metric(values, supervisor.restarts)
            yield restarts
        info = GaugeMetricFamily("slotkeeper_info", "This slotkeeper and its backends.",
                                 labels=["version", "model", "fingerprint", *self._by_model[1:]])
        for reading, values in zip(readings, labels, strict=True):
            info.add_metric([__version__, reading.state.backend.model_id, reading.state.backend.fingerprint,
                             *values[1:]], 1)
        yield info


def metrics_of(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


@router.get("/metrics", include_in_schema=False)
async def scrape(request: Request) -> Response:
    body = await metrics_of(request).render()
    return Response(body, media_type=CONTENT_TYPE_LATEST)
