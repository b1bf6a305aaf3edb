"""Benchmark runner: `python -m bench [--scenario
switch|reading|overhead|restart|system|agent|scale|day|title|beyond|first|client|backends|decide|agents|blocks|swap|
domains|turns|days|all] [--small]` (`all` leaves out `agents`, which drives real coding agents installed by
scripts/install-agents.sh, `blocks`, the block store against whole files: bytes on disk, written and uploaded, and
restore TTFT, `swap`, models taking turns behind a llama-server router, `domains`, what keeping users apart
costs, `turns`, where each millisecond of each kind of turn goes, and `days`, the two judged days replayed live
against llama-server's RAM cache and hearth-llm).

Starts the llama-server processes (and slotkeepers) each scenario needs on loopback ports, measures slotkeeper
against llama-server alone side by side, and writes `<out>/<scenario>.json` and `<out>/README.md`."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import (
    agent,
    agents,
    backends,
    beyond,
    blocks,
    client,
    day,
    days,
    decide,
    domains,
    first,
    overhead,
    restart,
    scale,
    swap,
    switch,
    system,
    title,
    turns,
)
from bench.chart import write_chart
from bench.common import MODEL_SPECS, BenchConfig, write_result
from bench.report import write_report

SCENARIOS: dict[str, Callable[[BenchConfig, Path], dict[str, Any]]] = {
    "switch": switch.run, "reading": switch.run_reading, "overhead": overhead.run, "restart": restart.run,
    "system": system.run, "agent": agent.run, "scale": scale.run, "day": day.run, "title": title.run,
    "beyond": beyond.run, "first": first.run, "client": client.run, "backends": backends.run, "decide": decide.run,
    "agents": agents.run, "blocks": blocks.run, "swap": swap.run, "domains": domains.run,
    "turns": turns.run, "days": days.run,
}
# Scenarios `all` leaves out: they need what a plain test run does not have (the agents from the npm registry) or
# take long (`blocks`: several slotkeepers per block size, an S3 server; `swap`: model loads, tested on its own;
# `domains`: four targets of their own, tested on its own; `turns`: each kind of turn traced, tested on its own;
# `days`: two days on each target, tested on its own).
OPT_IN = ("agents", "blocks", "swap", "domains", "turns", "days")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--small", action="store_true", help="CI size: 2 sessions of 500 tokens, few requests")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--tokens", default=None, help="context sizes, comma-separated (default 2000)")
    parser.add_argument("--sessions", type=int, default=None, help="sessions taking turns (default 4)")
    parser.add_argument("--rounds", type=int, default=None, help="resumed turns per session (default 3)")
    parser.add_argument("--requests", type=int, default=None, help="overhead requests, both targets (default 40)")
    parser.add_argument("--conversations", type=int, default=None,
                        help="system: new conversations on the shared system prompt (default 6)")
    parser.add_argument("--system-tokens", type=int, default=None,
                        help="system, agent: tokens of the shared system prompt with its tools (default 4000)")
    parser.add_argument("--agent-turns", type=int, default=None, help="agent: coding-agent turns (default 8)")
    parser.add_argument("--agent-slots", default=None, help="agent: slot counts to run, comma-separated (default 1)")
    parser.add_argument("--snapshots", type=int, default=None, help="scale: snapshots in the index (default 10000)")
    parser.add_argument("--model-size", choices=list(MODEL_SPECS), default="tiny")
    parser.add_argument("--note", default="", help="a remark on the conditions of the run, kept with the results")
    parser.add_argument("--keep", type=Path, default=None, help="keep models, slots and logs in this directory")
    return parser.parse_args(argv)


def config_from(args: argparse.Namespace) -> BenchConfig:
    small = args.small
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else ((500,) if small else (2000,))
    return BenchConfig(
        model_size=args.model_size,
        sessions=args.sessions or (2 if small else 4),
        tokens=tokens,
        rounds=args.rounds or (2 if small else 3),
        overhead_requests=args.requests or (6 if small else 40),
        overhead_answer_tokens=50 if small else 200,
        small=small,
        system_conversations=args.conversations or (3 if small else 6),
        system_tokens=args.system_tokens or (600 if small else 4000),
        agent_turns=args.agent_turns or (3 if small else 8),
        chat_turns=2 if small else 4,
        agent_slots=tuple(int(n) for n in args.agent_slots.split(",")) if args.agent_slots else (1,),
        scale_snapshots=args.snapshots or (500 if small else 10_000),
        note=args.note,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_from(args)
    names = [n for n in SCENARIOS if n not in OPT_IN] if args.scenario == "all" else [args.scenario]
    with tempfile.TemporaryDirectory(prefix="slotkeeper-bench-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in names:
            started, load = time.monotonic(), os.getloadavg()
            result = SCENARIOS[name](config, root / name)
            result["wall_seconds"] = time.monotonic() - started
            # Scenarios describe the machine when they return; the load before they started is taken here.
            result["machine"]["loadavg_at_start"] = [round(x, 2) for x in load]
            result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
            # The generated tiny model's results are the main ones; other sizes are kept beside them.
            path = write_result(args.out, name if config.model_size == "tiny" else f"{name}-{config.model_size}",
                                result)
            print(f"{name}: {path} ({result['wall_seconds']:.0f} s)", file=sys.stderr)
    chart = write_chart(args.out)
    print(f"chart: {chart}" if chart else "chart: skipped (no matplotlib, or nothing to draw)", file=sys.stderr)
    print(f"report: {write_report(args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
