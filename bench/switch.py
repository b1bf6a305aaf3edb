"""Scenario `switch`: K sessions of C-token contexts taking turns on one slot (llama-server `--parallel 1`).

Every resumed turn (the session's history plus one new user message) is sent to three targets, in rotating order
so that machine noise falls on all of them alike: llama-server alone with `--cache-ram 0`, llama-server alone with
its default host-memory prompt cache (`--cache-ram 8192`), and slotkeeper in front of a `--cache-ram 0`
llama-server. Measured: time to the first streamed content chunk, tokens prefilled (`prompt_n`) and reused
(`cache_n`), the backend's own prompt time (`timings.prompt_ms`) and the rest of the time to first token, and
slotkeeper's own save and restore times.

Scenario `reading`: the same turns, each request sent after a pause of READING_PAUSE_SECONDS, as when a person reads
an answer before going to another conversation, and slotkeeper runs with its default idle saves (so the state of the
turn that just ended is on disk when the next conversation takes the slot, if the pause is long enough)."""

from __future__ import annotations

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
    stream_chat,
)
from slotkeeper.config import Settings
from tests.support import SYSTEM, words

TARGETS = ("llama-server cram0", "llama-server default", "slotkeeper")
# Before each request of the `reading` scenario, for every target alike.
READING_PAUSE_SECONDS = 1.0
# slotkeeper's own default, in place of the `--save-idle-seconds -1` the test helpers start it with.
DEFAULT_SAVE_IDLE_SECONDS = f"{Settings.save_idle_seconds:g}"


def opening(session: str, tokens: int, seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{SYSTEM} Conversation {session}."},
            {"role": "user", "content": words(tokens, seed)}]


def next_turn(messages: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """The history plus a fixed assistant answer and one new user message (the same text for every target, so
    every target is asked exactly the same thing)."""
    return [*messages, {"role": "assistant", "content": words(30, seed)},
            {"role": "user", "content": words(40, seed + 1)}]


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    """Back to back, slotkeeper saving only on a switch: every switch waits for the save of the state it evicts."""
    return _run(config, root, "switch", 0.0, ())


def run_reading(config: BenchConfig, root: Path) -> dict[str, Any]:
    """A pause before every request, slotkeeper with its default idle saves."""
    return _run(config, root, "reading", READING_PAUSE_SECONDS, ("--save-idle-seconds", DEFAULT_SAVE_IDLE_SECONDS))


def _run(config: BenchConfig, root: Path, scenario: str, pause: float, keeper_args: tuple[str, ...]
         ) -> dict[str, Any]:
    model = make_model(root, config.model_size)
    ctx = max(config.tokens) + config.rounds * 200 + 1024
    samples: list[dict[str, Any]] = []
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        cram0 = procs.backend("switch-cram0", cache_ram=0, ctx_per_slot=ctx)
        default = procs.backend("switch-default", cache_ram=8192, ctx_per_slot=ctx)
        behind = procs.backend("switch-behind", cache_ram=0, ctx_per_slot=ctx, ram_dir=True)
        keeper = procs.slotkeeper("switch-slotkeeper", behind, *keeper_args)
        urls = {TARGETS[0]: cram0.url, TARGETS[1]: default.url, TARGETS[2]: keeper.url}
        turn_no = 0
        for tokens in config.tokens:
            sessions = {f"c{tokens}-s{k}": opening(f"c{tokens}-s{k}", tokens, 1000 * k + tokens)
                        for k in range(config.sessions)}
            for session, messages in sessions.items():  # first turns: every target prefills every session once
                for url in urls.values():
                    stream_chat(client, url, messages, session, config.answer_tokens)
            for rnd in range(1, config.rounds + 1):
                for k, session in enumerate(list(sessions)):
                    messages = next_turn(sessions[session], 10_000 * rnd + 100 * k)
                    sessions[session] = messages
                    order = [TARGETS[(turn_no + i) % len(TARGETS)] for i in range(len(TARGETS))]
                    turn_no += 1
                    for target in order:
                        time.sleep(pause)
                        since = time.time()
                        result = stream_chat(client, urls[target], messages, session, config.answer_tokens)
                        sample: dict[str, Any] = {
                            "tokens": tokens, "round": rnd, "session": session, "target": target,
                            "position": order.index(target), "ttft_ms": result.ttft_ms,
                            "total_ms": result.total_ms, "prompt_n": result.prompt_n, "cache_n": result.cache_n,
                            "prompt_ms": result.prompt_ms,
                        }
                        if target == "slotkeeper":
                            row = keeper_record(client, keeper.url, session, since)
                            sample.update({"cache": row["cache"], "restored": row["restored"],
                                           "restore_ms": row["restore_ms"], "save_ms": row["save_ms"]})
                        samples.append(sample)
    return {"scenario": scenario, "config": config.as_json(), "machine": machine(), "targets": list(TARGETS),
            "pause_seconds": pause, "keeper_args": list(keeper_args), "samples": samples,
            "summary": summarize(samples, config)}


def summarize(samples: list[dict[str, Any]], config: BenchConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tokens in config.tokens:
        rows = [s for s in samples if s["tokens"] == tokens]
        per_target: dict[str, Any] = {}
        for target in TARGETS:
            mine = [s for s in rows if s["target"] == target]
            per_target[target] = {
                "ttft_ms": describe([s["ttft_ms"] for s in mine]),
                "prompt_n_median": statistics.median(s["prompt_n"] for s in mine),
                "cache_n_median": statistics.median(s["cache_n"] for s in mine),
                # The backend's own prompt evaluation, and the rest of the time to first token: what a switch costs
                # besides the prefill (the RAM cache's swap, or slotkeeper's save, restore and proxying), apart from
                # how fast each llama-server process happens to run.
                "prompt_ms_median": statistics.median(s["prompt_ms"] for s in mine),
                "beyond_prompt_ms_median": statistics.median(s["ttft_ms"] - s["prompt_ms"] for s in mine),
            }
        keeper_rows = [s for s in rows if s["target"] == "slotkeeper"]
        per_target["slotkeeper"].update({
            "restore_ms": describe([s["restore_ms"] for s in keeper_rows]),
            "save_ms": describe([s["save_ms"] for s in keeper_rows]),
            # Switches that waited for a save of the evicted state (the others found it saved while the slot idled).
            "switches_with_save": sum(1 for s in keeper_rows if s["save_ms"] > 0),
            "cache_states": {c: sum(1 for s in keeper_rows if s["cache"] == c)
                             for c in sorted({s["cache"] for s in keeper_rows})},
        })
        # Ratios of medians, and the median of ratios taken turn by turn (the same turn sent to each target).
        by_turn: dict[tuple[int, str], dict[str, float]] = {}
        for s in rows:
            by_turn.setdefault((s["round"], s["session"]), {})[s["target"]] = s["ttft_ms"]
        keeper_median = per_target["slotkeeper"]["ttft_ms"]["median"]
        ratios = {}
        for target, label in ((TARGETS[0], "cram0_over_slotkeeper"), (TARGETS[1], "default_over_slotkeeper")):
            ratios[label] = {
                "of_medians": ratio(per_target[target]["ttft_ms"]["median"], keeper_median),
                "median_per_turn": statistics.median(ratio(t[target], t["slotkeeper"]) for t in by_turn.values()),
            }
        out[str(tokens)] = {"targets": per_target, "ratios": ratios}
    return out
