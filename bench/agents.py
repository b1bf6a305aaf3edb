"""Scenario `agents`: four real coding agents (Claude Code, Codex, OpenCode, Qwen Code, from npm at the versions
scripts/install-agents.sh pins), each running two conversations turn by turn, A1 B1 A2 B2 A3, non-interactively
(tests/agents/drivers.py), against three targets:

- slotkeeper in attach mode in front of llama-server `--parallel 1 -c 65536 --slot-save-path DIR --cache-ram 0
  --metrics` (slotkeeper as tests/support.Slotkeeper starts it: `--upstream URL --slot-dir DIR`);
- llama-server alone with its default host-memory prompt cache (`--cache-ram 8192`, its default);
- llama-server alone with `--cache-ram 0`.

The model is generated: one layer, 64 wide, the Qwen3-style template, 64k context, so the agents' 20-50k-token
prompts prefill in seconds. A recording proxy between each agent and its target caps every answer at 48 tokens
(llama-server's `-n` does not bound a request that asks for more) and records every request. Each target gets a fresh
llama-server (and slotkeeper) per agent.

Per agent and target: the prompt tokens llama-server prefilled over the whole sequence (its `/metrics` counter, so
slotkeeper's warm-ups count), the reuse efficiency ((sum of prompt tokens - prefilled) / sum of the tokens each
prompt shares with the best earlier one, exact with the backend's template and tokenizer), and the error responses.
The agents' prompts are their own and differ between targets where the agent reacts to an answer (an error, a cut-off
answer, a malformed one from the random model), so each target's efficiency is against its own prompts.

Run: `python -m bench.agents [--agent NAME ...] [--out DIR] [--keep DIR]` (or, once registered in bench/__main__.py,
`python -m bench --scenario agents`). Writes `<out>/agents.json` and prints the table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import BenchConfig, machine, processes, write_result
from slotkeeper.tinymodel import write_tiny_model
from tests.agents.analysis import describe
from tests.agents.drivers import AGENTS
from tests.agents.proxy import Record
from tests.agents.runner import (
    AGENT_MODEL,
    CONTEXT,
    as_sent,
    install_agents,
    is_generation,
    not_from_backend,
    prompt_tokens_total,
    run_sequence,
)

TARGETS = ("slotkeeper", "llama-server default", "llama-server cram0")
# llama-server's own default --cache-ram (MiB); the Backend helper always passes the option, so it is given.
DEFAULT_CACHE_RAM = 8192
NAMES = {"claude-code": "Claude Code", "codex": "Codex", "opencode": "OpenCode", "qwen-code": "Qwen Code"}


def run_one(agent: str, target: str, root: Path, model: Path, bin_dir: Path, work: Path) -> dict[str, Any]:
    """One agent's sequence against one target, on processes of its own. `work` holds the agent's HOME and project:
    the same path for every target and emptied before each, since the agents put both paths in their prompts."""
    label = target.replace(" ", "-")
    shutil.rmtree(work, ignore_errors=True)
    with processes(root, model) as procs, httpx.Client(timeout=300) as client:
        metrics = ("--metrics",)
        if target == "slotkeeper":
            backend = procs.backend(f"{label}-behind", 0, CONTEXT, extra_args=metrics)
            keeper = procs.slotkeeper(label, backend)
            result = run_sequence(agent, keeper.url, bin_dir, work, backend_url=backend.url,
                                  keeper_url=keeper.url, target=target)
        else:
            cache_ram = DEFAULT_CACHE_RAM if target == "llama-server default" else 0
            backend = procs.backend(label, cache_ram, CONTEXT, extra_args=metrics)
            result = run_sequence(agent, backend.url, bin_dir, work, backend_url=backend.url,
                                  target=target)
        if target == "slotkeeper":
            keeper.stop()  # the replays of its error responses go to llama-server alone
        result.save(root / "recordings")
        if (work / "home" / "turn-logs").is_dir():  # the agents' own output of each turn
            shutil.copytree(work / "home" / "turn-logs", root / "turn-logs", dirs_exist_ok=True)
        notes = describe(result, client, backend.url)
        ours = [r.index for r in not_from_backend(result, client, backend.url)] if target == "slotkeeper" else []
    summary = result.summary()
    if target == "slotkeeper":
        # The same requests, in the same order, straight to llama-server with its default RAM cache: the agents'
        # prompts differ from target to target (they react to the random model's answers), this one does not.
        with processes(root / "replay", model) as procs:
            direct = procs.backend("replay", DEFAULT_CACHE_RAM, CONTEXT, extra_args=("--metrics",))
            summary["same_sequence_default_prefilled"] = replay(direct.url, result.records)
    summary["errors_not_from_llama_server"] = ours
    summary["journal"] = {label: [{k: row.get(k) for k in ("session", "cache", "why", "why_detail", "cache_n",
                                                            "prompt_n", "status", "side")} for row in rows]
                          for label, rows in result.journal.items()}
    summary["caching_notes"] = notes
    return summary


def replay(backend_url: str, records: list[Record]) -> int:
    """Send the recorded generation requests that were answered, as the proxy sent them (capped), in order, to
    `backend_url`; returns the prompt tokens it prefilled for them (its own counter). A connection per request:
    llama-server closes one after a streamed answer."""
    with httpx.Client(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        before = prompt_tokens_total(client, backend_url)
        for record in records:
            if not is_generation(record) or record.failed:
                continue
            with client.stream("POST", f"{backend_url}{record.path}", json=as_sent(record)) as answer:
                answer.read()
        return prompt_tokens_total(client, backend_url) - before


def _errors(summary: dict[str, Any]) -> str:
    """Error responses, and of them those llama-server itself would not give (checked on slotkeeper's only)."""
    total, ours = len(summary["errors"]), len(summary["errors_not_from_llama_server"])
    return f"{total} ({ours} not llama-server's)" if ours else str(total)


def table(rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    head = ("| client | " + " | ".join(f"{t}: prefilled" for t in TARGETS) + " | slotkeeper's requests, "
            "llama-server default: prefilled | " + " | ".join(f"{t}: efficiency" for t in TARGETS) + " | "
            + " | ".join(f"{t}: errors" for t in TARGETS) + " |\n")
    head += "|---|" + "---:|" * (3 * len(TARGETS) + 1) + "\n"
    lines = []
    for agent, by_target in rows.items():
        prefilled = [f"{by_target[t]['prefilled']:,}" if t in by_target else "" for t in TARGETS]
        same = by_target.get("slotkeeper", {}).get("same_sequence_default_prefilled")
        prefilled.append(f"{same:,}" if same is not None else "")
        efficiency = [f"{by_target[t]['efficiency']:.3f}" if t in by_target and by_target[t]["efficiency"] is not None
                      else "" for t in TARGETS]
        errors = [_errors(by_target[t]) if t in by_target else "" for t in TARGETS]
        lines.append(f"| {NAMES.get(agent, agent)} | " + " | ".join([*prefilled, *efficiency, *errors]) + " |")
    return head + "\n".join(lines) + "\n"


def run(config: BenchConfig, root: Path, agents: tuple[str, ...] = AGENTS) -> dict[str, Any]:
    started = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    bin_dir = install_agents()
    model = root / "tiny-64x1-qwen3.gguf"
    if not model.exists():
        write_tiny_model(model, AGENT_MODEL)
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for agent in agents:
        rows[agent] = {}
        for target in TARGETS:
            t0 = time.monotonic()
            rows[agent][target] = run_one(agent, target, root / agent / target.replace(" ", "-"), model, bin_dir,
                                          root / agent / "work")
            print(f"agents: {agent} on {target}: prefilled {rows[agent][target]['prefilled']:,}, efficiency "
                  f"{rows[agent][target]['efficiency']}, {len(rows[agent][target]['errors'])} errors "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    pinned = (Path(bin_dir).parent.parent / "pinned.txt")
    return {
        "scenario": "agents", "config": config.as_json(), "machine": machine(), "targets": list(TARGETS),
        "agents": list(agents), "pinned": pinned.read_text().split() if pinned.exists() else [],
        "model": {"n_embd": AGENT_MODEL.n_embd, "n_layer": AGENT_MODEL.n_layer, "n_head": AGENT_MODEL.n_head,
                  "n_head_kv": AGENT_MODEL.n_head_kv, "n_ff": AGENT_MODEL.n_ff, "template": AGENT_MODEL.template,
                  "context_length": AGENT_MODEL.context_length},
        "llama_server": {"ctx": CONTEXT, "parallel": 1, "default_cache_ram_mib": DEFAULT_CACHE_RAM},
        "output_cap_tokens": 48, "sequence": ["A1", "B1", "A2", "B2", "A3"],
        "results": rows, "table": table(rows), "scenario_seconds": time.monotonic() - started,
    }


def section(r: dict[str, Any]) -> list[str]:
    return [
        "## agents: four real coding agents, A1 B1 A2 B2 A3 on one slot",
        "",
        f"{', '.join(r['pinned'])} from the npm registry, each running two conversations turn by turn, "
        "non-interactively, against slotkeeper (in front of a `--cache-ram 0` llama-server), llama-server with its "
        "default RAM cache, and llama-server with `--cache-ram 0`. A 1-layer, 64-wide generated model with the "
        f"Qwen3-style template, {r['llama_server']['ctx']:,} tokens of context, every answer capped at "
        f"{r['output_cap_tokens']} tokens. *Prefilled*: the prompt tokens llama-server evaluated over the whole "
        "sequence (its own counter, so slotkeeper's own evaluations count). The agents react to the random model's "
        "answers, so their requests differ from target to target; *slotkeeper's requests, llama-server default* "
        "replays the requests recorded through slotkeeper, in order, straight to a llama-server with its default RAM "
        "cache: the same sequence on both. *Efficiency*: the tokens reused over the tokens each request shares with "
        "any earlier one, exact with the backend's tokenizer.",
        "",
        r["table"],
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agents", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--agent", action="append", choices=AGENTS, help="only these agents (repeatable)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep models, logs, agents' homes and recordings in this directory")
    parser.add_argument("--note", default="", help="a remark on the conditions of the run, kept with the results")
    args = parser.parse_args(argv)
    config = BenchConfig(note=args.note)
    with tempfile.TemporaryDirectory(prefix="slotkeeper-bench-agents-") as tmp:
        root = args.keep or Path(tmp)
        started = time.monotonic()
        result = run(config, root / "agents", tuple(args.agent or AGENTS))
        result["wall_seconds"] = time.monotonic() - started
    path = write_result(args.out, "agents", result)
    print(result["table"])
    print(f"agents: {path} ({result['wall_seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
