"""The Markdown summary of whatever result files a run directory holds (bench/results/README.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import agents, decide, sections


def _fmt(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def _header(results: dict[str, dict[str, Any]]) -> list[str]:
    first = next(iter(results.values()))
    m, c = first["machine"], first["config"]
    # The newer scenarios state their own model, load and note in their sections.
    own = {stem for stem, r in results.items() if r["scenario"] in OWN_HEADER}
    notes = sorted({r["config"].get("note", "") for name, r in results.items() if name not in own} - {""})
    loads = ", ".join(f"{name}: {r['machine']['loadavg_at_start']}" for name, r in results.items()
                      if name not in own)
    sizes = sorted({r["config"]["model_size"] for r in results.values()})
    return [
        "# slotkeeper benchmark results",
        "",
        "Written by `python -m bench` (see `bench/__main__.py`). Every target gets the same requests, interleaved in "
        "rotating order, so slow moments of the machine fall on all targets alike and the ratios are the numbers to "
        "read; absolute times depend on the machine.",
        "",
        f"Machine: {m['cpus']} CPUs ({m['platform']}, Python {m['python']}), shared and possibly loaded by other "
        "work while this ran"
        + (f" (1/5/15-minute load averages at the start of each scenario: {loads}). " if loads else ". ") +
        f"Model: generated random-weight {' and '.join(f'`{size}`' for size in sizes)} model; llama-server with "
        f"`-t {c['threads']}`, `--parallel 1` (unless a section says otherwise)."
        f"{' CI size (`--small`).' if c['small'] else ''}",
        "",
        *(f"Note: {note}\n" for note in notes),
    ]


OWN_HEADER = ("system", "agent", "scale", "day", "title", "client", "blocks", "swap", "domains", "turns",
              "days")


def _reading(r: dict[str, Any]) -> list[str]:
    c = r["config"]
    return _switch_table(r, [
        "## reading: sessions taking turns on one slot, a reading pause before each request",
        "",
        f"The turns of `switch` ({c['sessions']} sessions round-robin on one slot, {c['rounds']} resumed turns each), "
        f"each request sent {r['pause_seconds']:g} s after the previous one ended, to every target alike, as when a "
        "person reads an answer before going to another conversation. slotkeeper runs with its default idle saves "
        f"(`{' '.join(r['keeper_args'])}`): a changed slot that stays idle is saved after twice its expected save "
        "time (at least 0.25 s, at most `--save-idle-seconds`), so the next conversation finds the previous one's "
        "state already on disk and waits for no save. *Switches with a save* counts the turns that still waited "
        "for one. Columns as in `switch`.",
        "",
    ])


def _switch(r: dict[str, Any]) -> list[str]:
    c = r["config"]
    return _switch_table(r, [
        "## switch: sessions taking turns on one slot",
        "",
        f"{c['sessions']} sessions round-robin on one slot, {c['rounds']} resumed turns each (history + one new user "
        f"message, {c['answer_tokens']}-token answers). TTFT = time to the first streamed content chunk. "
        "`cram0` = llama-server `--cache-ram 0`; `default` = llama-server with its host-memory prompt cache "
        "(`--cache-ram 8192`); slotkeeper runs in front of a `--cache-ram 0` llama-server whose `--slot-save-path` "
        "is slotkeeper's RAM dir on tmpfs (as in launch and embedded modes; docs/config.md, \"The RAM dir\"), saving "
        "on eviction (`--save-idle-seconds -1`, so the save of the previous session is inside the measured TTFT: the "
        "backend writing its file into the RAM dir, which is what *save ms* shows; the commit after it (copy to the "
        "slot dir on disk, fsync, checksum, index row) runs once the slot is handed on).",
        "",
        "*Backend prompt ms* is what the llama-server behind the target reported for evaluating the turn's prompt "
        "(`timings.prompt_ms`), and *beyond it* the rest of the time to first token: for the RAM cache its swap, for "
        "slotkeeper the save, the restore and the proxy; both include the first token's decode. Separate "
        "llama-server processes of one configuration differ in speed by up to about 15% on this machine for their "
        "whole life (measured: the same 3,285-token prefill took 5,242 ms on one and 6,679 ms on another), which "
        "the rotating order cannot cancel; the time beyond the prompt is the part that does not depend on it.",
        "",
    ])


def _switch_table(r: dict[str, Any], intro: list[str]) -> list[str]:
    lines = [
        *intro,
        "| context tokens | target | TTFT median ms | TTFT p99 ms | backend prompt ms (median) "
        "| beyond it (median) | prefilled (prompt_n) | reused (cache_n) | restore ms | save ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tokens, s in r["summary"].items():
        for target, t in s["targets"].items():
            extra = ["", ""]
            if "restore_ms" in t:
                extra = [_fmt(t["restore_ms"]["median"]), _fmt(t["save_ms"]["median"])]
            prompt = [_fmt(t["prompt_ms_median"]), _fmt(t["beyond_prompt_ms_median"])] if "prompt_ms_median" in t else [
                "", ""]
            lines.append(f"| {tokens} | {target} | {_fmt(t['ttft_ms']['median'])} | {_fmt(t['ttft_ms']['p99'])} "
                         f"| {' | '.join(prompt)} | {t['prompt_n_median']:g} | {t['cache_n_median']:g} "
                         f"| {' | '.join(extra)} |")
    lines += ["", "| context tokens | cram0 / slotkeeper (of medians, per-turn median) "
              "| default / slotkeeper (of medians, per-turn median) |", "|---:|---|---|"]
    for tokens, s in r["summary"].items():
        a, b = s["ratios"]["cram0_over_slotkeeper"], s["ratios"]["default_over_slotkeeper"]
        lines.append(f"| {tokens} | {a['of_medians']:.2f}x, {a['median_per_turn']:.2f}x "
                     f"| {b['of_medians']:.2f}x, {b['median_per_turn']:.2f}x |")
    keeper = {tokens: s["targets"]["slotkeeper"] for tokens, s in r["summary"].items()}
    if all("switches_with_save" in k for k in keeper.values()):
        lines += ["", "Switches with a save (slotkeeper): " + ", ".join(
            f"{k['switches_with_save']} of {sum(k['cache_states'].values())} at {tokens} tokens"
            for tokens, k in keeper.items()) + "."]
    return [*lines, ""]


def _overhead(r: dict[str, Any]) -> list[str]:
    c, by_threads = r["config"], r["summary"]["by_threads"]
    cpus = r["machine"]["cpus"]
    pairs = next(iter(by_threads.values()))["pairs"]
    lines = [
        "## overhead: a hot session, direct vs through slotkeeper",
        "",
        f"{pairs} pairs of requests (tiny prompt, {c['overhead_answer_tokens']} streamed tokens), one to "
        "llama-server directly and one through slotkeeper, order alternating within pairs. Added = slotkeeper "
        "minus direct, per pair. Run once with llama-server's `-t` at the CPU count, where every bit of CPU the "
        "proxy uses is taken from the model's threads, and once with one core left free, as when the model runs on "
        "a GPU or on fewer threads than the machine has: there the ratio is what the proxy itself costs.",
        "",
        "| llama-server threads | target | total median ms | TTFT median ms | chunks/s median |",
        "|---:|---|---:|---:|---:|",
    ]
    for threads, s in by_threads.items():
        for target, t in s["targets"].items():
            lines.append(f"| {threads} of {cpus} | {target} | {_fmt(t['total_ms']['median'])} "
                         f"| {_fmt(t['ttft_ms']['median'])} | {_fmt(t['chunks_per_s']['median'])} |")
    lines += [
        "",
        "| llama-server threads | added total ms p50 | added total ms p99 | added TTFT ms p50 | added TTFT ms p99 "
        "| chunks/s ratio slotkeeper / direct (per-pair median) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for threads, s in by_threads.items():
        lines.append(f"| {threads} of {cpus} | {_fmt(s['added_total_ms']['p50'], 2)} "
                     f"| {_fmt(s['added_total_ms']['p99'], 2)} | {_fmt(s['added_ttft_ms']['p50'], 2)} "
                     f"| {_fmt(s['added_ttft_ms']['p99'], 2)} | {s['chunks_per_s_ratio']['median_per_pair']:.3f} |")
    return [*lines, ""]


def _restart(r: dict[str, Any]) -> list[str]:
    c, s = r["config"], r["summary"]
    lines = [
        "## restart: resuming after llama-server and slotkeeper restarted",
        "",
        f"{c['sessions']} sessions of {s['tokens']} tokens primed through slotkeeper; both processes stopped and "
        "started again, with slotkeeper's RAM dir empty, as a clean exit or a reboot leaves it; each session's next "
        "turn through slotkeeper (restored from its file on disk) vs a cold prefill of the same turn on a fresh "
        "`--cache-ram 0` llama-server.",
        "",
        "| target | TTFT median ms | prefilled (prompt_n) | reused (cache_n) | restore ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for target, t in s["targets"].items():
        restore = _fmt(t["restore_ms"]["median"]) if "restore_ms" in t else ""
        lines.append(f"| {target} | {_fmt(t['ttft_ms']['median'])} | {t['prompt_n_median']:g} "
                     f"| {t['cache_n_median']:g} | {restore} |")
    ratio = s["ratios"]["cold_over_restored"]
    lines += ["", f"cold / restored: {ratio['of_medians']:.2f}x (of medians), "
              f"{ratio['median_per_session']:.2f}x (per-session median).", ""]
    return lines


SECTIONS = {"switch": _switch, "reading": _reading, "overhead": _overhead, "restart": _restart,
            "system": sections.system, "agent": sections.agent, "scale": sections.scale, "day": sections.day,
            "title": sections.title, "beyond": sections.beyond, "first": sections.first, "client": sections.client,
            "backends": sections.backends, "decide": decide.section, "agents": agents.section,
            "blocks": sections.blocks, "swap": sections.swap, "domains": sections.domains,
            "turns": sections.turns, "days": sections.days}


def write_report(out: Path) -> Path:
    """README.md from the result files in `out`: `<scenario>.json`, and `<scenario>-<model size>.json` of runs with
    another model than the tiny one, each section after the tiny one's."""
    results: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        for path in [out / f"{name}.json", *sorted(out.glob(f"{name}-*.json"))]:
            if path.exists():
                results[path.stem] = json.loads(path.read_text())
    lines = _header(results) if results else ["# slotkeeper benchmark results", ""]
    for stem, result in results.items():
        section = SECTIONS[result["scenario"]](result)
        if stem != result["scenario"]:  # `<scenario>-<model size>`, or a variant's run: `day-per-user`
            variant = stem.removeprefix(result["scenario"] + "-")
            size = result["config"]["model_size"]
            section[0] += f" ({size} model)" if variant == size else f" ({variant.replace('-', ' ')}, {size} model)"
        lines += section
    if results and (out / "results.png").exists():
        lines += ["![median time to first token per target](results.png)", ""]
    path = out / "README.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
