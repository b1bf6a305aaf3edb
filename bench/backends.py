"""Scenario `backends`: one model on one llama-server and on three, behind slotkeeper, against round-robin load
balancing in front of three plain llama-servers (bench/roundrobin.py, their default RAM cache on).

The traffic is the day's (bench/day.py: OpenWebUI chats with their title and tag tasks, two coding agents and a
subagent on one agent prompt, a Claude-Code-shaped client), without the restart, and with every conversation sent
from its own client thread at once, its steps in order: eight conversations compete for the backends, as a team's
do. Each llama-server has one slot (`--parallel 1`), and the machine's cores are shared out among the servers of a
target (`-t`: all of them for one server; one each for three on two cores).

*slotkeeper, 2 replicas over 3 backends* is two slotkeepers sharing a session directory (Redis) and a snapshot store
(moto's S3 server), one over two of the servers and one over the third, with each request sent to a random one of
them, as a plain balancer in front of two hosts would.

Reported per target: wall time and throughput (requests per second), time to first token (every request, and the
resumed turns: a conversation's turns after its first), reuse efficiency (as in `day`: the prompt tokens not
prefilled, summed over every backend's /metrics, over the longest prefix each request shares with an earlier one),
and how the prompt tokens spread over the backends."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench import day
from bench.common import BenchConfig, machine, make_model, prime, processes, state_size
from bench.messages import PrefillCounters, prefill_counters
from slotkeeper.upstream.launcher import free_port
from tests.support import (
    REPLICA_ARGS,
    Backend,
    ObjectStoreServer,
    RedisServer,
    Slotkeeper,
    backends_config,
    wait_healthy,
)

TARGETS = ("slotkeeper, 1 backend", "slotkeeper, 3 backends", "slotkeeper, 2 replicas over 3 backends",
           "round-robin, 3 llama-servers")
MODEL_NAME = "day"


def conversations(steps: list[day.Step]) -> dict[str, list[day.Step]]:
    """The day's steps by conversation (a new chat's title task goes with its first turn), in their order."""
    out: dict[str, list[day.Step]] = {}
    for step in steps:
        out.setdefault(step[-1].conversation, []).append(step)
    return out


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    model = make_model(root, config.model_size)
    steps = day.traffic(config)
    requests = [r for step in steps for r in step]
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        scratch = procs.backend("backends-scratch", 0, 32768, extra_args=("--metrics",))
        day.tokenize(client, scratch.url, steps)
        longest = max(requests, key=lambda r: len(r.tokens))
        probe = state_size(client, scratch.url, longest.render)
        scratch.stop()
    ctx = max(len(r.tokens) for r in requests) + 256
    by_conversation = conversations(steps)
    samples: list[dict[str, Any]] = []
    totals: dict[str, dict[str, Any]] = {}
    for name in TARGETS:
        rows, total = run_target(root / name.replace(" ", "-").replace(",", ""), model, name, by_conversation, ctx)
        samples += rows
        totals[name] = total
    return {
        "scenario": "backends", "config": config.as_json(), "machine": machine(), "targets": list(TARGETS),
        "order": list(TARGETS),
        "traffic": {"conversations": len(by_conversation), "steps": len(steps), "requests": len(requests),
                    "prompt_tokens": sum(len(r.tokens) for r in requests),
                    "shared_prefix_tokens": sum(r.shared for r in requests), "concurrency": len(by_conversation),
                    "parallel_per_backend": 1, "ctx_per_slot": ctx},
        "state_probe": probe, "samples": samples, "summary": summarize(requests, samples, totals),
    }


def run_target(root: Path, model: Path, name: str, by_conversation: dict[str, list[day.Step]],
               ctx: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    metrics = ("--metrics",)
    label = name.replace(" ", "-").replace(",", "")
    n = 1 if "1 backend" in name else 3
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        cache_ram = day.DEFAULT_CACHE_RAM if name.startswith("round-robin") else 0
        # The machine's cores shared out: three servers of two threads each on two cores would mostly wait.
        threads = ("-t", str(max(1, (os.cpu_count() or 2) // n)))
        backends = [procs.backend(f"{label}-{i}", cache_ram, ctx, extra_args=(*metrics, *threads)) for i in range(n)]
        for backend in backends:
            prime(client, backend.url)
        urls = front(procs, root, label, name, backends)
        base = [prefill_counters(client, b.url) for b in backends]
        rows: list[dict[str, Any]] = []
        lock = threading.Lock()

        def converse(conversation: str, steps: list[day.Step]) -> None:
            pick = random.Random(conversation)  # several replicas: each step to a random one, as a balancer would
            with httpx.Client(timeout=600) as own:
                for index, step in enumerate(steps):
                    results = day.run_step(own, pick.choice(urls), step)
                    with lock:
                        for r, sent in zip(step, results, strict=True):
                            rows.append({"target": name, "conversation": conversation, "turn": index, "kind": r.kind,
                                         "status": sent.status, "ttft_ms": sent.ttft_ms, "total_ms": sent.total_ms,
                                         "prompt_tokens": len(r.tokens), "shared_prefix": r.shared,
                                         "reported_prompt_tokens": sent.reported_prompt,
                                         **({"error": sent.error} if sent.error else {})})

        threads = [threading.Thread(target=converse, args=item) for item in by_conversation.items()]
        t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - t0
        spent = [prefill_counters(client, b.url) - b0 for b, b0 in zip(backends, base, strict=True)]
    total = PrefillCounters(sum(s.prefilled for s in spent), sum(s.reused for s in spent),
                            sum(s.seconds for s in spent))
    return rows, {"prefilled": total.prefilled, "cached": total.reused, "prompt_seconds": total.seconds,
                  "wall_seconds": wall, "backends": n,
                  "prompt_tokens_per_backend": [s.prefilled + s.reused for s in spent]}


def front(procs: Any, root: Path, label: str, name: str, backends: list[Backend]) -> list[str]:
    """What the clients talk to: slotkeeper over the backends (one model, one [[backends]] table each), two
    slotkeeper replicas sharing a session directory (Redis) and a snapshot store (moto's S3 server), the first over
    two of the backends and the second over the third, or the round-robin balancer."""
    if "replicas" in name:
        redis = RedisServer(root / "redis").start()
        procs.stack.callback(redis.stop)
        store = ObjectStoreServer(root / "s3.log").start()
        procs.stack.callback(store.stop)
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        shared = ("--directory", redis.url, "--shared-store", f"s3://{store.bucket}/bench", "--shared-endpoint",
                  store.url, *REPLICA_ARGS)
        return [_keeper(procs, root, f"{label}-a", backends[:2], shared),
                _keeper(procs, root, f"{label}-b", backends[2:], shared)]
    if name.startswith("round-robin"):
        port = free_port()
        log = (root / f"{label}.log").open("ab")
        process = subprocess.Popen([sys.executable, "-m", "bench.roundrobin", "--port", str(port),
                                    *(b.url for b in backends)], stdout=log, stderr=subprocess.STDOUT)
        procs.stack.callback(log.close)
        procs.stack.callback(lambda: (process.terminate(), process.wait(10)))
        wait_healthy(f"http://127.0.0.1:{port}", process, 60)
        return [f"http://127.0.0.1:{port}"]
    return [_keeper(procs, root, label, backends)]


def _keeper(procs: Any, root: Path, label: str, backends: list[Backend], extra: tuple[str, ...] = ()) -> str:
    config = backends_config(root / f"{label}.toml", MODEL_NAME, backends)
    keeper = Slotkeeper(root / label / "cache", root / f"{label}.log",
                        extra_args=("--config", str(config), "--save-idle-seconds", "2", *extra))
    procs.stack.callback(keeper.stop)
    return keeper.start(timeout=120).url


def summarize(requests: list[day.Request], samples: list[dict[str, Any]],
              totals: dict[str, dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(len(r.tokens) for r in requests)
    shared = sum(r.shared for r in requests)
    out: dict[str, Any] = {}
    for name in TARGETS:
        mine = [s for s in samples if s["target"] == name]
        t = totals[name]
        ok = [s for s in mine if s["status"] == 200]
        resumed = [s["ttft_ms"] for s in ok if s["turn"] > 0 and s["kind"] not in day.TASK_KINDS]
        spread = t["prompt_tokens_per_backend"]
        out[name] = {
            "requests": len(mine), "errors": len(mine) - len(ok),
            "wall_seconds": t["wall_seconds"], "requests_per_second": len(ok) / t["wall_seconds"],
            "ttft_ms": day.ttft_stats([s["ttft_ms"] for s in ok]), "resumed_ttft_ms": day.ttft_stats(resumed),
            "prompt_tokens": prompt, "shared_prefix_tokens": shared, "prefilled": t["prefilled"],
            "reused": prompt - t["prefilled"], "efficiency": (prompt - t["prefilled"]) / shared if shared else None,
            "prompt_seconds": t["prompt_seconds"], "backends": t["backends"],
            "prompt_tokens_per_backend": spread,
            "busiest_backend_vs_mean": max(spread) / (sum(spread) / len(spread)) if sum(spread) else None,
        }
    return out
