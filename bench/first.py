"""Scenario `first`: the first turn of a conversation on a system prompt nobody sent before, through slotkeeper and
straight to the llama-server behind it, on the same llama-server process.

slotkeeper runs the turn in one pass, as llama-server alone does, and once the slot idles cuts it back to the system
part and saves that as a system state (docs/design-pool.md), off the turn's path. Separate llama-server processes of one
configuration differ in speed by up to about 15% on this machine, so both go to one process (`--cache-ram 0`,
slotkeeper's RAM dir as its `--slot-save-path`), alternating which goes first, each with a system prompt of its own.
slotkeeper saves idle slots after 1 s, and each turn waits 2 s after the one before, so no save of the previous turn
falls inside a measured one. Measured: time to the first streamed content chunk, and slotkeeper's cuts (after the
turns, counted and timed apart)."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import BenchConfig, describe, keeper_record, machine, make_model, processes, ratio, stream_chat
from tests.support import words

TARGETS = ("llama-server", "slotkeeper")
USER_TOKENS = 150
IDLE_S = 2.0
CUT = re.compile(r"cut back to system prompt \w+ after .*'s turn: (\d+) tokens in (\d+) ms")


def conversation(seed: int, system_tokens: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"You are assistant {seed}. " + words(system_tokens, seed)},
            {"role": "user", "content": words(USER_TOKENS, seed + 1)}]


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    model = make_model(root, config.model_size)
    pairs = 2 if config.small else 6
    ctx = config.system_tokens + USER_TOKENS + 1024
    samples: list[dict[str, Any]] = []
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        behind = procs.backend("first-behind", cache_ram=0, ctx_per_slot=ctx, ram_dir=True)
        keeper = procs.slotkeeper("first-slotkeeper", behind, "--save-idle-seconds", "1")
        urls = {"llama-server": behind.url, "slotkeeper": keeper.url}
        for i in range(pairs):
            order = TARGETS if i % 2 == 0 else TARGETS[::-1]
            for position, target in enumerate(order):
                seed = 1000 * (i + 1) + (0 if target == "llama-server" else 500)
                session = f"first-{i}-{target}"
                time.sleep(IDLE_S)
                since = time.time()
                result = stream_chat(client, urls[target], conversation(seed, config.system_tokens), session,
                                     config.answer_tokens)
                sample: dict[str, Any] = {"pair": i, "target": target, "position": position,
                                          "ttft_ms": result.ttft_ms, "prompt_n": result.prompt_n,
                                          "cache_n": result.cache_n, "prompt_ms": result.prompt_ms}
                if target == "slotkeeper":
                    row = keeper_record(client, keeper.url, session, since)
                    sample.update({"cache": row["cache"], "why": row.get("why", ""), "save_ms": row["save_ms"]})
                samples.append(sample)
        time.sleep(IDLE_S)  # the last turn's cut
        cuts = [{"tokens": int(m[0]), "ms": int(m[1])} for m in CUT.findall(keeper.log_text())]
    summary = summarize(samples)
    summary["targets"]["slotkeeper"]["cut_ms"] = describe([c["ms"] for c in cuts]) if cuts else None
    return {"scenario": "first", "config": config.as_json(), "machine": machine(), "targets": list(TARGETS),
            "pairs": pairs, "samples": samples, "cuts": cuts, "summary": summary}


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    per_target = {t: {"ttft_ms": describe([s["ttft_ms"] for s in samples if s["target"] == t]),
                      "prompt_n_median": statistics.median(s["prompt_n"] for s in samples if s["target"] == t)}
                  for t in TARGETS}
    keeper = [s for s in samples if s["target"] == "slotkeeper"]
    per_target["slotkeeper"].update({"save_ms": describe([s["save_ms"] for s in keeper]),
                                     "cache_states": {c: sum(1 for s in keeper if s["cache"] == c)
                                                      for c in sorted({s["cache"] for s in keeper})}})
    by_pair: dict[int, dict[str, float]] = {}
    for s in samples:
        by_pair.setdefault(s["pair"], {})[s["target"]] = s["ttft_ms"]
    return {"targets": per_target, "slotkeeper_over_llama_server": {
        "of_medians": ratio(per_target["slotkeeper"]["ttft_ms"]["median"],
                            per_target["llama-server"]["ttft_ms"]["median"]),
        "median_per_pair": statistics.median(ratio(p["slotkeeper"], p["llama-server"]) for p in by_pair.values())}}
