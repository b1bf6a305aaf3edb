"""Scenario `beyond`: more conversations than llama-server's RAM cache holds, taking turns on one slot.

A 27B model at 30k tokens has a state of several GB, so llama-server's 8 GiB RAM cache holds one or two of them. Here
the RAM cache is sized for 2 of 8 conversations (from a measured state size), against llama-server with its default
RAM cache (which holds them all on the generated models) and slotkeeper in front of a `--cache-ram 0` llama-server
with its RAM dir, as launch mode sets it up. The conversations go round-robin, so an LRU cache that holds 2 of them
never has the next one; every resumed turn (the history plus one new user message) is sent to every target in
rotating order. Measured: time to the first streamed content chunk, and tokens prefilled and reused."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    BenchConfig,
    describe,
    keeper_record,
    machine,
    make_model,
    processes,
    ratio,
    state_size,
    stream_chat,
)
from bench.switch import next_turn, opening

TARGETS = ("llama-server small-ram", "llama-server default", "slotkeeper")
DEFAULT_CACHE_RAM = 8192
# Each resumed turn adds a fixed answer and a user message: about this many tokens, for sizing the small cache.
TOKENS_PER_TURN = 100


def shape(config: BenchConfig) -> tuple[int, int]:
    """Conversations, and how many of their states the small RAM cache is sized for."""
    return (3, 1) if config.small else (8, 2)


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    model = make_model(root, config.model_size)
    tokens = config.tokens[0]
    n_sessions, states = shape(config)
    ctx = tokens + config.rounds * 200 + 1024
    samples: list[dict[str, Any]] = []
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        sessions = {f"b{k}": opening(f"b{k}", tokens, 7000 + k) for k in range(n_sessions)}
        scratch = procs.backend("beyond-scratch", cache_ram=0, ctx_per_slot=ctx)
        probe = state_size(client, scratch.url, {"messages": next(iter(sessions.values()))})
        scratch.stop()
        final_tokens = probe["tokens"] + config.rounds * TOKENS_PER_TURN
        small_ram = max(1, math.ceil(states * final_tokens * probe["bytes_per_token"] / 2**20))
        small = procs.backend("beyond-small-ram", cache_ram=small_ram, ctx_per_slot=ctx)
        default = procs.backend("beyond-default", cache_ram=DEFAULT_CACHE_RAM, ctx_per_slot=ctx)
        behind = procs.backend("beyond-behind", cache_ram=0, ctx_per_slot=ctx, ram_dir=True)
        keeper = procs.slotkeeper("beyond-slotkeeper", behind)
        urls = {TARGETS[0]: small.url, TARGETS[1]: default.url, TARGETS[2]: keeper.url}
        for session, messages in sessions.items():  # first turns: every target prefills every conversation once
            for url in urls.values():
                stream_chat(client, url, messages, session, config.answer_tokens)
        turn_no = 0
        for rnd in range(1, config.rounds + 1):
            for k, session in enumerate(list(sessions)):
                messages = next_turn(sessions[session], 20_000 * rnd + 100 * k)
                sessions[session] = messages
                order = [TARGETS[(turn_no + i) % len(TARGETS)] for i in range(len(TARGETS))]
                turn_no += 1
                for target in order:
                    since = time.time()
                    result = stream_chat(client, urls[target], messages, session, config.answer_tokens)
                    sample: dict[str, Any] = {
                        "round": rnd, "session": session, "target": target, "position": order.index(target),
                        "ttft_ms": result.ttft_ms, "total_ms": result.total_ms, "prompt_n": result.prompt_n,
                        "cache_n": result.cache_n, "prompt_ms": result.prompt_ms}
                    if target == "slotkeeper":
                        sample["cache"] = keeper_record(client, keeper.url, session, since)["cache"]
                    samples.append(sample)
    return {"scenario": "beyond", "config": config.as_json(), "machine": machine(), "targets": list(TARGETS),
            "shape": {"conversations": n_sessions, "small_ram_states": states, "small_ram_mib": small_ram,
                      "default_cache_ram_mib": DEFAULT_CACHE_RAM, "context_tokens": tokens, "state_probe": probe},
            "samples": samples, "summary": summarize(samples)}


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    per_target: dict[str, Any] = {}
    for target in TARGETS:
        mine = [s for s in samples if s["target"] == target]
        per_target[target] = {"ttft_ms": describe([s["ttft_ms"] for s in mine]),
                              "prompt_n_median": statistics.median(s["prompt_n"] for s in mine),
                              "cache_n_median": statistics.median(s["cache_n"] for s in mine)}
    keeper = [s for s in samples if s["target"] == "slotkeeper"]
    per_target["slotkeeper"]["cache_states"] = {c: sum(1 for s in keeper if s["cache"] == c)
                                                for c in sorted({s["cache"] for s in keeper})}
    by_turn: dict[tuple[int, str], dict[str, float]] = {}
    for s in samples:
        by_turn.setdefault((s["round"], s["session"]), {})[s["target"]] = s["ttft_ms"]
    keeper_median = per_target["slotkeeper"]["ttft_ms"]["median"]
    ratios = {}
    for target, label in ((TARGETS[0], "small_ram_over_slotkeeper"), (TARGETS[1], "default_over_slotkeeper")):
        ratios[label] = {
            "of_medians": ratio(per_target[target]["ttft_ms"]["median"], keeper_median),
            "median_per_turn": statistics.median(ratio(t[target], t["slotkeeper"]) for t in by_turn.values()),
        }
    return {"targets": per_target, "ratios": ratios}
