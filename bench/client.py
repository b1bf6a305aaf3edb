"""Scenario `client`: slotkeeper's own upstream client (`upstream/wire.py`) against aiohttp's, on the `overhead`
workload. Three targets on one `--cache-ram 0` llama-server: the server directly, slotkeeper as it is, and
slotkeeper with aiohttp's client in its place (bench/aiohttp_upstream.py; everything above the connection is the
same code). A tiny prompt with a long streamed answer, one hot session per slotkeeper, the order of the three
rotating from round to round. Run with llama-server on every core and with one core left free, as `overhead` is.

Measured per round: time to first chunk and total time over direct, and the streamed chunk rate as a share of
direct's, for each client; and aiohttp's figures over wire.py's, round by round."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import httpx

from bench.common import BenchConfig, describe, machine, processes, ratio, stream_chat
from bench.overhead import MESSAGES, SESSION, per_thread_count, spread

TARGETS = ("direct", "slotkeeper", "slotkeeper aiohttp")
KEEPERS = TARGETS[1:]


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    samples, by_threads = per_thread_count(config, root, _rounds, summarize)
    return {"scenario": "client", "config": config.as_json(), "machine": machine(), "targets": list(TARGETS),
            "samples": samples, "summary": {"by_threads": by_threads}}


def _rounds(config: BenchConfig, root: Path, model: Path, threads: int) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        backend = procs.backend("client-backend", cache_ram=0, ctx_per_slot=4096,
                                extra_args=("-t", str(threads)), ram_dir=True)
        wire = procs.slotkeeper("client-wire", backend)
        aio = procs.slotkeeper("client-aiohttp", backend, module="bench.aiohttp_upstream")
        urls = {"direct": backend.url, "slotkeeper": wire.url, "slotkeeper aiohttp": aio.url}
        # One slot for all three, as in `overhead`: every request sends the same short prompt, so each one finds it
        # in the slot (what differs is the answer after it), and each slotkeeper sees its one session hot.
        sessions = {"direct": SESSION, "slotkeeper": f"{SESSION}-wire", "slotkeeper aiohttp": f"{SESSION}-aiohttp"}
        for target, url in urls.items():  # warm-up: each prompt is in a slot, each session hot
            stream_chat(client, url, MESSAGES, sessions[target], config.overhead_answer_tokens)
        for rnd in range(config.overhead_requests // 2):
            order = [TARGETS[(rnd + i) % len(TARGETS)] for i in range(len(TARGETS))]
            for target in order:
                r = stream_chat(client, urls[target], MESSAGES, sessions[target], config.overhead_answer_tokens)
                samples.append({"threads": threads, "round": rnd, "target": target, "position": order.index(target),
                                "ttft_ms": r.ttft_ms, "total_ms": r.total_ms, "chunks": r.content_chunks,
                                "chunks_per_s": r.chunks_per_second, "prompt_n": r.prompt_n, "cache_n": r.cache_n,
                                "cache": r.cache_header})
    return samples


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for s in samples:
        rounds.setdefault(s["round"], {})[s["target"]] = s
    per_target = {
        target: {
            "total_ms": describe([s["total_ms"] for s in samples if s["target"] == target]),
            "ttft_ms": describe([s["ttft_ms"] for s in samples if s["target"] == target]),
            "chunks_per_s": describe([s["chunks_per_s"] for s in samples if s["target"] == target]),
        }
        for target in TARGETS
    }
    added = {
        target: {
            "added_ttft_ms": spread([r[target]["ttft_ms"] - r["direct"]["ttft_ms"] for r in rounds.values()]),
            "added_total_ms": spread([r[target]["total_ms"] - r["direct"]["total_ms"] for r in rounds.values()]),
            "chunks_per_s_ratio": statistics.median(ratio(r[target]["chunks_per_s"], r["direct"]["chunks_per_s"])
                                                    for r in rounds.values()),
        }
        for target in KEEPERS
    }
    aio, wire = KEEPERS[1], KEEPERS[0]
    return {
        "rounds": len(rounds),
        "targets": per_target,
        "over_direct": added,
        "aiohttp_over_wire": {
            "ttft_ms_difference": spread([r[aio]["ttft_ms"] - r[wire]["ttft_ms"] for r in rounds.values()]),
            "total_ms_difference": spread([r[aio]["total_ms"] - r[wire]["total_ms"] for r in rounds.values()]),
            "chunks_per_s_ratio": statistics.median(ratio(r[aio]["chunks_per_s"], r[wire]["chunks_per_s"])
                                                    for r in rounds.values()),
        },
        "cache_states": {t: sorted({str(s["cache"]) for s in samples if s["target"] == t}) for t in KEEPERS},
    }
