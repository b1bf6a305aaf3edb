"""Scenario `restart`: K sessions are primed through slotkeeper, then llama-server and slotkeeper are both stopped
and started again. Each session's next turn is then sent through slotkeeper (restored from disk) and, alternately,
to a separate `--cache-ram 0` llama-server that has to prefill it cold."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import BenchConfig, describe, keeper_record, machine, make_model, processes, ratio, stream_chat
from bench.switch import next_turn, opening


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    model = make_model(root, config.model_size)
    tokens = config.tokens[0]
    ctx = tokens + 1024
    sessions = {f"r{tokens}-s{k}": opening(f"r{tokens}-s{k}", tokens, 7000 + k) for k in range(config.sessions)}
    samples: list[dict[str, Any]] = []
    with httpx.Client(timeout=600) as client:
        with processes(root, model) as procs:  # before the restart
            backend = procs.backend("restart-behind", cache_ram=0, ctx_per_slot=ctx, ram_dir=True)
            keeper = procs.slotkeeper("restart-slotkeeper", backend)
            for session, messages in sessions.items():
                stream_chat(client, keeper.url, messages, session, config.answer_tokens)
        with processes(root, model) as procs:  # after: same slot dir and cache dir, new processes
            backend = procs.backend("restart-behind", cache_ram=0, ctx_per_slot=ctx, ram_dir=True)
            keeper = procs.slotkeeper("restart-slotkeeper", backend)
            cold = procs.backend("restart-cold", cache_ram=0, ctx_per_slot=ctx)
            for k, (session, messages) in enumerate(sessions.items()):
                turn = next_turn(messages, 20_000 + k)
                order = ["slotkeeper", "cold"] if k % 2 == 0 else ["cold", "slotkeeper"]
                for target in order:
                    url = keeper.url if target == "slotkeeper" else cold.url
                    since = time.time()
                    r = stream_chat(client, url, turn, session, config.answer_tokens)
                    sample: dict[str, Any] = {"session": session, "target": target, "ttft_ms": r.ttft_ms,
                                              "total_ms": r.total_ms, "prompt_n": r.prompt_n, "cache_n": r.cache_n}
                    if target == "slotkeeper":
                        row = keeper_record(client, keeper.url, session, since)
                        sample.update({"cache": row["cache"], "restored": row["restored"],
                                       "restore_ms": row["restore_ms"]})
                    samples.append(sample)
    keeper_rows = [s for s in samples if s["target"] == "slotkeeper"]
    cold_rows = [s for s in samples if s["target"] == "cold"]
    per_session: dict[str, dict[str, float]] = {s["session"]: {} for s in samples}
    for s in samples:
        per_session[s["session"]][s["target"]] = s["ttft_ms"]
    summary = {
        "tokens": tokens,
        "targets": {
            "slotkeeper restored": {"ttft_ms": describe([s["ttft_ms"] for s in keeper_rows]),
                                    "prompt_n_median": statistics.median(s["prompt_n"] for s in keeper_rows),
                                    "cache_n_median": statistics.median(s["cache_n"] for s in keeper_rows),
                                    "restore_ms": describe([s["restore_ms"] for s in keeper_rows]),
                                    "cache_states": sorted({s["cache"] for s in keeper_rows})},
            "llama-server cold": {"ttft_ms": describe([s["ttft_ms"] for s in cold_rows]),
                                  "prompt_n_median": statistics.median(s["prompt_n"] for s in cold_rows),
                                  "cache_n_median": statistics.median(s["cache_n"] for s in cold_rows)},
        },
        "ratios": {"cold_over_restored": {
            "of_medians": ratio(statistics.median(s["ttft_ms"] for s in cold_rows),
                                statistics.median(s["ttft_ms"] for s in keeper_rows)),
            "median_per_session": statistics.median(ratio(v["cold"], v["slotkeeper"])
                                                    for v in per_session.values()),
        }},
    }
    return {"scenario": "restart", "config": config.as_json(), "machine": machine(), "samples": samples,
            "summary": summary}
