"""Scenario `system`: new conversations that share one long system prompt with tools (a coding agent's).

N conversations each send their first turn (Anthropic-shaped, streamed: system blocks, four tools, two
`<system-reminder>` blocks in front of the user's own text), with a turn of one unrelated conversation between them,
so the slot no longer holds the shared prompt when the next conversation starts. Every turn goes to three targets in
rotating order: llama-server alone with `--cache-ram 0` (a cold prefill each time), llama-server with its default
host-memory prompt cache, and slotkeeper over a `--cache-ram 0` llama-server. slotkeeper runs the first conversation
in one pass, like the others; after it the run pauses (a person reading the answer), slotkeeper saves the idle slot
and cuts it back to the system part, saved as a system state (the cut is reported on its own), and later
conversations start from the saved state that shares the most with them. Then a second prompt of the same size is
pre-warmed with `slotkeeper prewarm` (timed), and the first conversation on it is sent to all three targets."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
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
    prime,
    processes,
    ratio,
    stream_chat,
)
from bench.messages import SystemPart, messages_body, prefill_counters, stream_messages, system_part
from tests.support import REPO, Slotkeeper, words

TARGETS = ("llama-server cram0", "llama-server default", "slotkeeper")
OTHER = "unrelated"
CUT = re.compile(r"cut back to system prompt \w+ after .*'s turn: (\d+) tokens in (\d+) ms")
IDLE_S = 1.0  # slotkeeper's --save-idle-seconds here: the pause after the first conversation is longer


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    model = make_model(root, config.model_size)
    own_tokens = 60 if config.small else 150
    ctx = config.system_tokens * 2 + 2048
    shared, prewarmed = system_part(config.system_tokens, 101), system_part(config.system_tokens, 202)
    other: list[dict[str, str]] = [{"role": "system", "content": "You are a translator."},
                                   {"role": "user", "content": words(100 if config.small else 300, 55)}]
    samples: list[dict[str, Any]] = []
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        metrics = ("--metrics",)
        behind = procs.backend("system-behind", cache_ram=0, ctx_per_slot=ctx, extra_args=metrics, ram_dir=True)
        keeper = procs.slotkeeper("system-slotkeeper", behind, "--save-idle-seconds", str(IDLE_S))
        backends = {TARGETS[0]: procs.backend("system-cram0", cache_ram=0, ctx_per_slot=ctx, extra_args=metrics).url,
                    TARGETS[1]: procs.backend("system-default", cache_ram=8192, ctx_per_slot=ctx,
                                              extra_args=metrics).url,
                    TARGETS[2]: behind.url}
        urls = {**backends, TARGETS[2]: keeper.url}
        for url in backends.values():
            prime(client, url)

        def first_turn(part: SystemPart, k: int, phase: str) -> None:
            session = f"{phase}-{k}"
            body = messages_body(part, [part.first_user(words(own_tokens, 1000 + k))], config.answer_tokens)
            for target in rotated(k):
                since, before = time.time(), prefill_counters(client, backends[target])
                r = stream_messages(client, urls[target], body, session)
                # What the backend spent on prompts for this request (slotkeeper's warm-up included), against the
                # TTFT: the rest is everything else (restore, save, proxies, waiting for a core).
                cost = prefill_counters(client, backends[target]) - before
                sample: dict[str, Any] = {"phase": phase, "conversation": k, "target": target, "ttft_ms": r.ttft_ms,
                                          "total_ms": r.total_ms, "deltas": r.deltas, "prompt_n": r.prefilled,
                                          "cache_n": r.reused, "backend_prompt_ms": cost.seconds * 1000,
                                          "backend_prefilled": cost.prefilled}
                if target == "slotkeeper":
                    row = keeper_record(client, keeper.url, session, since)
                    sample.update({"cache": row["cache"], "restored": row["restored"],
                                   "restore_ms": row["restore_ms"], "save_ms": row["save_ms"]})
                samples.append(sample)

        def between(k: int) -> None:
            for target in rotated(k):
                r = stream_chat(client, urls[target], other, OTHER, config.answer_tokens)
                samples.append({"phase": "between", "conversation": k, "target": target, "ttft_ms": r.ttft_ms,
                                "total_ms": r.total_ms, "prompt_n": r.prompt_n, "cache_n": r.cache_n})
            other.extend([{"role": "assistant", "content": words(30, 70 + k)},
                          {"role": "user", "content": words(40, 80 + k)}])

        for k in range(config.system_conversations):
            if k:
                between(k)
            first_turn(shared, k, "shared")
            if k == 0:  # a pause after the first answer: the idle slot is saved, then cut back to the system part
                deadline = time.monotonic() + 30
                while not CUT.search(keeper.log_text()) and time.monotonic() < deadline:
                    time.sleep(0.1)
        cuts = [(int(n), int(ms)) for n, ms in CUT.findall(keeper.log_text())]
        snapshot_rows = [r for r in keeper.index_rows() if r["kind"] == "system"]
        prewarm = run_prewarm(keeper, prewarmed, root)
        between(config.system_conversations)
        first_turn(prewarmed, 0, "prewarmed")
    return {"scenario": "system", "config": config.as_json(), "machine": machine(), "targets": list(TARGETS),
            "samples": samples, "summary": summarize(samples, cuts, snapshot_rows, prewarm)}


def rotated(k: int) -> list[str]:
    return [TARGETS[(k + i) % len(TARGETS)] for i in range(len(TARGETS))]


def run_prewarm(keeper: Slotkeeper, part: SystemPart, root: Path) -> dict[str, Any]:
    """`slotkeeper prewarm FILE` as an operator runs it (a new process: its start-up is in the wall time), twice:
    the first saves the system snapshot, the second finds it."""
    path = root / "prewarm.json"
    path.write_text(json.dumps(part.prewarm_body()))
    out: dict[str, Any] = {}
    for attempt in ("first", "again"):
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "prewarm", str(path), "--url", keeper.url,
                               "--json"], capture_output=True, text=True, cwd=REPO, timeout=600)
        wall_ms = (time.perf_counter() - started) * 1000
        if done.returncode != 0:
            raise RuntimeError(f"slotkeeper prewarm failed: {done.stderr[-2000:]}")
        result = json.loads(done.stdout)
        out[attempt] = {"status": result["status"], "tokens": result["tokens"], "bytes": result["bytes"],
                        "server_ms": result["ms"], "wall_ms": wall_ms}
    return out


def _target_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"ttft_ms": describe([s["ttft_ms"] for s in rows]),
            "backend_prompt_ms": describe([s["backend_prompt_ms"] for s in rows]),
            "ttft_beyond_backend_prompt_ms": describe([s["ttft_ms"] - s["backend_prompt_ms"] for s in rows]),
            "prompt_n_median": statistics.median(s["prompt_n"] for s in rows),
            "cache_n_median": statistics.median(s["cache_n"] for s in rows)}


def summarize(samples: list[dict[str, Any]], cuts: list[tuple[int, int]], snapshot_rows: list[dict[str, Any]],
              prewarm: dict[str, Any]) -> dict[str, Any]:
    shared = [s for s in samples if s["phase"] == "shared"]
    first = {s["target"]: s for s in shared if s["conversation"] == 0}
    later = [s for s in shared if s["conversation"] > 0]
    later_targets = {t: _target_stats([s for s in later if s["target"] == t]) for t in TARGETS}
    keeper_later = [s for s in later if s["target"] == "slotkeeper"]
    later_targets["slotkeeper"].update({
        "restore_ms": describe([s["restore_ms"] for s in keeper_later]),
        "save_ms": describe([s["save_ms"] for s in keeper_later]),
        "cache_states": {c: sum(1 for s in keeper_later if s["cache"] == c) for c in sorted({s["cache"]
                                                                                            for s in keeper_later})},
    })
    by_conversation: dict[int, dict[str, float]] = {}
    for s in later:
        by_conversation.setdefault(s["conversation"], {})[s["target"]] = s["ttft_ms"]
    keeper_median = later_targets["slotkeeper"]["ttft_ms"]["median"]
    ratios = {label: {"of_medians": ratio(later_targets[t]["ttft_ms"]["median"], keeper_median),
                      "median_per_conversation": statistics.median(ratio(c[t], c["slotkeeper"])
                                                                   for c in by_conversation.values())}
              for t, label in ((TARGETS[0], "cram0_over_slotkeeper"), (TARGETS[1], "default_over_slotkeeper"))}
    cut_tokens, cut_ms = cuts[0] if cuts else (0, 0)
    keeper_first = first["slotkeeper"]
    between = [s for s in samples if s["phase"] == "between"]
    prewarmed = [s for s in samples if s["phase"] == "prewarmed"]
    return {
        "conversations": len({s["conversation"] for s in shared}),
        "first_conversation": {
            "targets": {t: {"ttft_ms": s["ttft_ms"], "prompt_n": s["prompt_n"], "cache_n": s["cache_n"],
                            "backend_prompt_ms": s["backend_prompt_ms"], "backend_prefilled": s["backend_prefilled"]}
                        for t, s in first.items()},
            "slotkeeper_cache": keeper_first["cache"],
            "slotkeeper_extra_ms_over_cram0": keeper_first["ttft_ms"] - first[TARGETS[0]]["ttft_ms"],
            "cut_tokens": cut_tokens, "cut_ms": cut_ms, "cuts": len(cuts),
            "save_ms": keeper_first["save_ms"],
            "system_snapshot_bytes": sum(r["n_bytes"] for r in snapshot_rows),
            "system_snapshot_tokens": sum(r["n_tokens"] for r in snapshot_rows),
        },
        "later_conversations": {"targets": later_targets, "ratios": ratios},
        "between_ttft_ms": {t: describe([s["ttft_ms"] for s in between if s["target"] == t]) for t in TARGETS},
        "prewarm": prewarm,
        "after_prewarm": {s["target"]: {"ttft_ms": s["ttft_ms"], "prompt_n": s["prompt_n"], "cache_n": s["cache_n"],
                                        **({"cache": s["cache"]} if "cache" in s else {})} for s in prewarmed},
    }
