"""Scenario `overhead`: what slotkeeper adds to a hot request. A tiny prompt with a long streamed answer is sent N
times to one `--cache-ram 0` llama-server, alternately directly and through slotkeeper (one session, always hot;
the order within each pair alternates too). Measured per pair: total time and time to first chunk, slotkeeper minus
direct, and the rate of streamed chunks.

It runs twice: with llama-server on every core (`-t` = the CPU count), where the proxy's CPU time is taken from the
model's threads, and with one core left free (`-t` one less), as on a machine whose cores are not all given to the
model or whose model runs on a GPU: there the ratio is what the proxy itself costs. (On one CPU only the first.)"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.common import BenchConfig, describe, machine, make_model, percentile, processes, ratio, stream_chat

MESSAGES = [{"role": "system", "content": "You are a storyteller."},
            {"role": "user", "content": "Tell me a long story about a lighthouse."}]
SESSION = "overhead"


def thread_counts() -> list[int]:
    cpus = os.cpu_count() or 1
    return [cpus, cpus - 1] if cpus > 1 else [1]


Samples = list[dict[str, Any]]


def per_thread_count(config: BenchConfig, root: Path, run_one: Callable[[BenchConfig, Path, Path, int], Samples],
                     summarize: Callable[[Samples], dict[str, Any]]) -> tuple[Samples, dict[str, Any]]:
    """`run_one` once per llama-server thread count (thread_counts), each in its own directory; returns all samples
    and each count's summary."""
    model = make_model(root, config.model_size)
    samples: Samples = []
    for threads in thread_counts():
        samples += run_one(config, root / f"t{threads}", model, threads)
    return samples, {str(t): summarize([s for s in samples if s["threads"] == t]) for t in thread_counts()}


def spread(values: list[float]) -> dict[str, float]:
    """Median, 99th percentile and mean of per-pair (or per-round) differences."""
    return {"p50": statistics.median(values), "p99": percentile(values, 99), "mean": statistics.fmean(values)}


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    samples, by_threads = per_thread_count(config, root, _run_pairs, summarize)
    return {"scenario": "overhead", "config": config.as_json(), "machine": machine(), "samples": samples,
            "summary": {"by_threads": by_threads}}


def _run_pairs(config: BenchConfig, root: Path, model: Path, threads: int) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        backend = procs.backend("overhead-backend", cache_ram=0, ctx_per_slot=4096, extra_args=("-t", str(threads)),
                                ram_dir=True)
        keeper = procs.slotkeeper("overhead-slotkeeper", backend)
        urls = {"direct": backend.url, "slotkeeper": keeper.url}
        for url in urls.values():  # warm-up: the prompt is in the slot, the session is hot
            stream_chat(client, url, MESSAGES, SESSION, config.overhead_answer_tokens)
        for pair in range(config.overhead_requests // 2):
            order = ["direct", "slotkeeper"] if pair % 2 == 0 else ["slotkeeper", "direct"]
            for target in order:
                r = stream_chat(client, urls[target], MESSAGES, SESSION, config.overhead_answer_tokens)
                samples.append({"threads": threads, "pair": pair, "target": target, "position": order.index(target),
                                "ttft_ms": r.ttft_ms, "total_ms": r.total_ms, "chunks": r.content_chunks,
                                "chunks_per_s": r.chunks_per_second, "prompt_n": r.prompt_n, "cache_n": r.cache_n,
                                "cache": r.cache_header})
    return samples


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    pairs: dict[int, dict[str, dict[str, Any]]] = {}
    for s in samples:
        pairs.setdefault(s["pair"], {})[s["target"]] = s
    added_total = [p["slotkeeper"]["total_ms"] - p["direct"]["total_ms"] for p in pairs.values()]
    added_ttft = [p["slotkeeper"]["ttft_ms"] - p["direct"]["ttft_ms"] for p in pairs.values()]
    rate_ratio = [ratio(p["slotkeeper"]["chunks_per_s"], p["direct"]["chunks_per_s"]) for p in pairs.values()]
    per_target = {
        target: {
            "total_ms": describe([s["total_ms"] for s in samples if s["target"] == target]),
            "ttft_ms": describe([s["ttft_ms"] for s in samples if s["target"] == target]),
            "chunks_per_s": describe([s["chunks_per_s"] for s in samples if s["target"] == target]),
        }
        for target in ("direct", "slotkeeper")
    }
    return {
        "pairs": len(pairs),
        "targets": per_target,
        "added_total_ms": spread(added_total),
        "added_ttft_ms": spread(added_ttft),
        "chunks_per_s_ratio": {"median_per_pair": statistics.median(rate_ratio),
                               "of_medians": ratio(per_target["slotkeeper"]["chunks_per_s"]["median"],
                                                   per_target["direct"]["chunks_per_s"]["median"])},
        "slotkeeper_cache_states": sorted({str(s["cache"]) for s in samples if s["target"] == "slotkeeper"}),
    }
