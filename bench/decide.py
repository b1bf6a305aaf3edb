"""Scenario `decide`: what deciding by tokens costs a turn, side by side with an earlier slotkeeper.

Two conversations of about 30k tokens each on one slot (`--parallel 1`, the backend's RAM cache off, a RAM dir as
in launch mode). Their turns alternate so that every other request is a switch (the state is restored), and each
switch is followed by a hot turn of the same conversation. Every fourth switch resumes a conversation under a new
id with its first user message changed (the reminder block at its end moved to the newest message, as agents do on
resume): there the message chains cannot tell which state shares the most (no state holds that message whole, and
no own state breaks the tie), so slotkeeper asks the backend for the request's tokens.

Measured per request: slotkeeper's own time, the request's wall time minus what the backend reports for the prompt
and the answer (`timings.prompt_ms`, `predicted_ms`) and minus the restore and save the turn waited for (its
journal row). That is what slotkeeper adds: its HTTP hop, the look-ups, the planner, the tokens when asked for. The
newer slotkeeper also reports `decide_ms`, the decision alone.

The earlier slotkeeper runs from another checkout's `src` when `SLOTKEEPER_BENCH_BASELINE` names it (for example a
`git worktree add /tmp/baseline f5dbaf1`: then `/tmp/baseline/src`); without it, only this checkout is measured."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import BenchConfig, keeper_record, machine, make_model, percentile, processes
from tests.support import Slotkeeper, words

BASELINE_ENV = "SLOTKEEPER_BENCH_BASELINE"
REMINDER = "<system-reminder>The date is 2026-12-03. Keep answers short.</system-reminder>\n"
SYSTEM = "You are a coding agent working in a large repository. "
CONTEXT = 32768


def conversation(seed: int, history_words: int) -> list[dict[str, str]]:
    """A long conversation's messages: a system prompt, a first message with a reminder, and a long history."""
    messages = [{"role": "system", "content": SYSTEM + words(1500, 1)},
                {"role": "user", "content": "Task: " + words(200, seed) + "\n" + REMINDER}]
    for i in range(6):
        messages.append({"role": "assistant", "content": words(history_words // 12, seed * 100 + i)})
        messages.append({"role": "user", "content": words(history_words // 12, seed * 200 + i)})
    return messages


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    history = 800 if config.small else 33000  # about 29k tokens with the system prompt: "a switch at 30k"
    model = make_model(root, config.model_size)
    targets: dict[str, str | None] = {"slotkeeper": None}
    baseline = os.environ.get(BASELINE_ENV)
    if baseline:
        targets["slotkeeper, earlier"] = baseline
    rounds = 4 if config.small else 8
    samples: list[dict[str, Any]] = []
    for name, src in targets.items():
        samples += _run_target(root / name.replace(", ", "-"), model, name, src, history, rounds)
    return {"scenario": "decide", "config": config.as_json(), "machine": machine(), "baseline": baseline,
            "samples": samples, "summary": summarize(samples)}


def _run_target(root: Path, model: Path, name: str, src: str | None, history: int,
                rounds: int) -> list[dict[str, Any]]:
    saved = os.environ.get("PYTHONPATH")
    if src is not None:
        os.environ["PYTHONPATH"] = src  # the earlier checkout's package, ahead of this one's editable install
    try:
        with processes(root, model) as procs, httpx.Client(timeout=600) as client:
            backend = procs.backend(f"{name}-backend", cache_ram=0, ctx_per_slot=CONTEXT, ram_dir=True)
            keeper = procs.slotkeeper(name, backend)
            return _drive(client, keeper, name, history, rounds)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _drive(client: httpx.Client, keeper: Slotkeeper, name: str, history: int, rounds: int) -> list[dict[str, Any]]:
    chats = {"a": conversation(1, history), "b": conversation(2, history)}
    samples = []
    for label in ("a", "b"):
        _ask(client, keeper, label, chats[label], "first")  # prefills, not measured
    for i in range(rounds):
        for which in ("a", "b"):
            label, messages = which, chats[which]
            moved = i % 4 == 3
            if moved:  # the reminder leaves the first message for the newest one, as an agent's resume does
                messages[1]["content"] = messages[1]["content"].replace(REMINDER, "")
                messages.append({"role": "user", "content": REMINDER + words(40, 900 + i)})
                label = f"{label}-resumed-{i}"  # and the resumed run is named anew
            else:
                messages.append({"role": "user", "content": words(40, 700 + i)})
            samples.append({"target": name, **_ask(client, keeper, label, messages, "switch-tokens" if moved
                                                   else "switch")})
            messages.append({"role": "assistant", "content": words(20, 800 + i)})
            messages.append({"role": "user", "content": words(30, 600 + i)})
            samples.append({"target": name, **_ask(client, keeper, label, messages, "hot")})
            messages.append({"role": "assistant", "content": words(20, 500 + i)})
    return samples


def _ask(client: httpx.Client, keeper: Slotkeeper, label: str, messages: list[dict[str, str]],
         kind: str) -> dict[str, Any]:
    since = time.time()
    started = time.perf_counter()
    response = client.post(f"{keeper.url}/v1/chat/completions", headers={"X-Session-Id": f"decide-{label}"},
                           json={"messages": messages, "max_tokens": 1, "temperature": 0})
    wall_ms = (time.perf_counter() - started) * 1000
    response.raise_for_status()
    timings = response.json()["timings"]
    row = keeper_record(client, keeper.url, f"decide-{label}", since)
    backend_ms = float(timings.get("prompt_ms") or 0) + float(timings.get("predicted_ms") or 0)
    own_ms = wall_ms - backend_ms - float(row["restore_ms"]) - float(row["save_ms"])
    return {"kind": kind, "cache": row["cache"], "tokens": int(timings["cache_n"]) + int(timings["prompt_n"]),
            "cache_n": int(timings["cache_n"]), "wall_ms": wall_ms, "own_ms": own_ms,
            "decide_ms": row.get("decide_ms")}


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target in sorted({s["target"] for s in samples}):
        per_kind: dict[str, Any] = {}
        for kind in ("hot", "switch", "switch-tokens"):
            rows = [s for s in samples if s["target"] == target and s["kind"] == kind]
            if not rows:
                continue
            own = [s["own_ms"] for s in rows]
            decided = [s["decide_ms"] for s in rows if s["decide_ms"] is not None]
            per_kind[kind] = {"n": len(rows), "own_ms_p50": statistics.median(own), "own_ms_p90": percentile(own, 90),
                              "decide_ms_p50": statistics.median(decided) if decided else None,
                              "decide_ms_max": max(decided) if decided else None,
                              "tokens_p50": statistics.median(s["tokens"] for s in rows),
                              "reused_p50": statistics.median(s["cache_n"] for s in rows)}
        out[target] = per_kind
    return out


def section(r: dict[str, Any]) -> list[str]:
    lines = [
        "## decide: what deciding by tokens costs a turn",
        "",
        "Two conversations of about 30k tokens on one slot, taking turns: every other request is a switch (its state "
        "restored), each followed by a hot turn; every fourth switch resumes a conversation whose first message "
        "changed (a reminder moved, as agents do on resume), where the message chains cannot tell which state shares "
        "the most and slotkeeper asks the backend for the request's tokens. *Own ms* is the wall time minus what the "
        "backend reports for prompt and answer and minus the restore and save the turn waited for: what slotkeeper "
        "adds. *Decide ms* is the decision alone (look-ups, tokens, plan), from the request's journal row. "
        + (f"The earlier slotkeeper is `{r['baseline']}`." if r.get("baseline") else ""),
        "",
        "| target | request | n | tokens p50 | reused p50 | own ms p50 | own ms p90 | decide ms p50 | decide ms max |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for target, kinds in r["summary"].items():
        for kind, k in kinds.items():
            decide = f"{k['decide_ms_p50']:.1f}" if k["decide_ms_p50"] is not None else "-"
            most = f"{k['decide_ms_max']:.1f}" if k["decide_ms_max"] is not None else "-"
            lines.append(f"| {target} | {kind} | {k['n']} | {k['tokens_p50']:,.0f} | {k['reused_p50']:,.0f} "
                         f"| {k['own_ms_p50']:.1f} | {k['own_ms_p90']:.1f} | {decide} | {most} |")
    return [*lines, ""]
