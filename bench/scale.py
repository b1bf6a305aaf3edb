"""Scenario `scale`: the snapshot index and the planner's lookups at N snapshots (default 10,000; small: 500).

A `SnapshotStore` is filled the way the pool fills it (a temporary file written as the backend would, then `commit`
with a 10-40 link message chain), with files of a few KiB so that only the index's own costs and the checksum of a
small file are timed. Then, without a backend: the own-snapshot lookup (`checked_snapshot`), `best_prefix` for four
kinds of request chain, opening the index and `reconcile()` as at start, `list()`, `usage()`, `enforce_budget` with a
budget that evicts nothing and with one that evicts about 1%, and the index's size on disk. With a backend:
slotkeeper's start-up time (until /health answers 200, polled every 0.1 s) on an empty index and on the full one."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.common import BenchConfig, Processes, describe, machine, make_model, processes
from bench.population import MODEL, Lookup, Population, chain_tokens, fill, make_population, request_chain
from slotkeeper.cache.budget import DiskBudget
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.cache.tokens import as_tokens
from slotkeeper.types import IdSource, SessionKey
from tests.support import Backend

INDEX_NAME = "index.sqlite3"  # the index's name inside slotkeeper's --cache-dir
KEEPER = "scale-slotkeeper"
BLOCK_KEEPER = "scale-blocks-slotkeeper"
BLOCK_TOKENS = 64


def timed_ms(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1000


def repeat_ms(action: Callable[[], object], times: int) -> dict[str, float]:
    return describe([timed_ms(action) for _ in range(times)])


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    n = config.scale_snapshots
    lookups = 200 if config.small else 2000
    starts = 1 if config.small else 3
    population = make_population(n)
    model = make_model(root, config.model_size)
    index = root / KEEPER / "cache" / INDEX_NAME  # where procs.slotkeeper(KEEPER, ...) keeps its index
    with processes(root, model) as procs, httpx.Client(timeout=60) as client:
        backend = procs.backend("scale-backend", cache_ram=0, ctx_per_slot=2048)
        empty_starts, fingerprint = start_times(procs, backend, client, starts)
        store = SnapshotStore(backend.slot_dir, index)
        commit_ms = fill(store, population, fingerprint)
        offline = measure_index(store, index, population, fingerprint, lookups)
        store.close()
        full_starts, _ = start_times(procs, backend, client, starts)
        budget_starts, _ = start_times(procs, backend, client, starts, "--disk-budget", "1T")
        store = SnapshotStore(backend.slot_dir, index)
        evicting = measure_eviction(store)
        store.close()
        block_states = measure_block_states(procs, client, root, population, lookups, starts)
    summary = {
        "snapshots": n,
        "system_snapshots": len(population.systems),
        "chain_links": sum(len(s.chain) for s in population.sessions) + 2 * len(population.systems),
        "fill_seconds": sum(commit_ms) / 1000,
        "commit_ms": describe(commit_ms),
        **offline,
        **evicting,
        "index_bytes": sum(p.stat().st_size for p in index.parent.glob(f"{INDEX_NAME}*")),
        "startup_ms": {"empty index": describe(empty_starts), "full index": describe(full_starts),
                       "full index, --disk-budget 1T": describe(budget_starts)},
        "block_states": block_states,
    }
    return {"scenario": "scale", "config": config.as_json(), "machine": machine(), "samples": [summary],
            "summary": summary}


def measure_index(store: SnapshotStore, index: Path, population: Population, fingerprint: str,
                  lookups: int) -> dict[str, Any]:
    rng = random.Random(5)
    keys = [SessionKey(MODEL, rng.choice(population.sessions).session_id, IdSource.HEADER) for _ in range(lookups)]
    own: list[float] = []
    for key in keys:
        started = time.perf_counter()
        if store.checked_snapshot(key, fingerprint) is None:
            raise RuntimeError(f"the stored snapshot of {key} was not found")
        own.append((time.perf_counter() - started) * 1000)
    prefix: dict[str, Any] = {}
    # As the planner asks on a cold slot: more than the one system message, which the system snapshot covers.
    cases = [(str(lookup), lookup, 2) for lookup in Lookup]
    cases.append((f"{Lookup.NEW_CHAT} (min_messages 1)", Lookup.NEW_CHAT, 1))
    for name, lookup, min_messages in cases:
        chains = [request_chain(population, lookup, rng, str(i)) for i in range(lookups)]
        times, found = [], 0
        for chain in chains:
            started = time.perf_counter()
            match = store.best_prefix(MODEL, fingerprint, chain, min_messages)
            times.append((time.perf_counter() - started) * 1000)
            found += match is not None
        prefix[name] = {**describe(times), "found": found, "min_messages": min_messages}
    started = time.perf_counter()
    again = SnapshotStore(store.slot_dir, index)
    open_ms = (time.perf_counter() - started) * 1000
    reconcile_ms = timed_ms(again.reconcile)
    again.close()
    total = sum(s.n_bytes for s in store.list(kind=None))
    return {
        "checked_snapshot_ms": describe(own),
        "best_prefix_ms": prefix,
        "open_ms": open_ms,
        "reconcile_ms": reconcile_ms,
        "list_all_ms": repeat_ms(lambda: store.list(kind=None), 5),
        "list_sessions_ms": repeat_ms(store.list, 5),
        "usage_ms": repeat_ms(store.usage, 5),
        "snapshot_bytes": total,
        "enforce_budget_nothing_ms": repeat_ms(lambda: store.enforce_budget(DiskBudget(max_bytes=2 * total)), 5),
    }


def measure_block_states(procs: Processes, client: httpx.Client, root: Path, population: Population, lookups: int,
                         starts: int) -> dict[str, Any]:
    """The same population as dense slot files kept by the block store (blocks of BLOCK_TOKENS, each stored once):
    the fill, the own-state and token look-ups, opening and reconciling the index, the start's sweep of blocks no
    state names, and slotkeeper's start-up on the full index."""
    args = ("--block-tokens", str(BLOCK_TOKENS))
    backend = procs.backend("scale-blocks-backend", cache_ram=0, ctx_per_slot=2048)
    _, fingerprint = start_times(procs, backend, client, 1, *args, keeper_name=BLOCK_KEEPER)
    index = root / BLOCK_KEEPER / "cache" / INDEX_NAME
    store = SnapshotStore(backend.slot_dir, index, block_tokens=BLOCK_TOKENS)
    commit_ms = fill(store, population, fingerprint, slot_files=True)
    rng = random.Random(7)
    own: list[float] = []
    by_tokens: list[float] = []
    found = 0
    for i in range(lookups):
        session = rng.choice(population.sessions)
        key = SessionKey(MODEL, session.session_id, IdSource.HEADER)
        started = time.perf_counter()
        if store.checked_snapshot(key, fingerprint) is None:
            raise RuntimeError(f"the stored state of {key} was not found")
        own.append((time.perf_counter() - started) * 1000)
        tokens = as_tokens(chain_tokens(request_chain(population, Lookup.NEXT_TURN, rng, f"b{i}")))
        started = time.perf_counter()
        matches = store.best_by_tokens(MODEL, fingerprint, tokens)
        by_tokens.append((time.perf_counter() - started) * 1000)
        found += bool(matches)
    n_blocks, block_bytes = store.blocks.usage()
    states = store.list(kind=None)
    whole_bytes = sum(s.n_bytes for s in states)
    stored_bytes = store._index.total_bytes()
    store.close()
    started = time.perf_counter()
    again = SnapshotStore(backend.slot_dir, index, block_tokens=BLOCK_TOKENS)
    open_ms = (time.perf_counter() - started) * 1000
    reconcile_ms = timed_ms(again.reconcile)
    sweep_ms = timed_ms(again.sweep_blocks)
    again.close()
    full_starts, _ = start_times(procs, backend, client, starts, *args, keeper_name=BLOCK_KEEPER)
    return {
        "block_tokens": BLOCK_TOKENS, "states": len(states), "blocks": n_blocks, "block_bytes": block_bytes,
        "whole_file_bytes": whole_bytes, "stored_bytes": stored_bytes,
        "fill_seconds": sum(commit_ms) / 1000, "commit_ms": describe(commit_ms),
        "checked_snapshot_ms": describe(own), "best_by_tokens_ms": {**describe(by_tokens), "found": found},
        "open_ms": open_ms, "reconcile_ms": reconcile_ms, "sweep_blocks_ms": sweep_ms,
        "startup_ms": describe(full_starts),
    }


def measure_eviction(store: SnapshotStore) -> dict[str, Any]:
    """One enforce_budget that has to evict about 1% of the bytes (least recently used first)."""
    total = sum(s.n_bytes for s in store.list(kind=None))
    started = time.perf_counter()
    evicted = store.enforce_budget(DiskBudget(max_bytes=int(total * 0.99)))
    return {"enforce_budget_1pct_ms": (time.perf_counter() - started) * 1000,
            "enforce_budget_1pct_evicted": len(evicted)}


def start_times(procs: Processes, backend: Backend, client: httpx.Client, times: int,
                *extra: str, keeper_name: str = KEEPER) -> tuple[list[float], str]:
    """Start slotkeeper `times` times over the backend: the milliseconds until /health answered 200 each time, and
    the backend's fingerprint as slotkeeper computed it."""
    out, fingerprint = [], ""
    for _ in range(times):
        started = time.perf_counter()
        keeper = procs.slotkeeper(keeper_name, backend, *extra)
        out.append((time.perf_counter() - started) * 1000)
        fingerprint = client.get(f"{keeper.url}/api/backend").json()["fingerprint"]
        keeper.stop()
    return out, fingerprint
