"""README sections of the `system`, `agent`, `scale` and `day` scenarios (see report.py for the page around them)."""

from __future__ import annotations

from typing import Any

from bench import day_openwebui


def _fmt(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def _model(r: dict[str, Any]) -> str:
    c, m = r["config"], r["machine"]
    note = f" Note: {c['note']}" if c.get("note") else ""
    end = f", at the end {m['loadavg_at_end']}" if "loadavg_at_end" in m else ""
    return (f"Model: generated `{c['model_size']}`; 1/5/15-minute load averages at the start {m['loadavg_at_start']}"
            f"{end}, {r['wall_seconds']:.0f} s in all."
            f"{' CI size (`--small`).' if c['small'] else ''}{note}")


def system(r: dict[str, Any]) -> list[str]:
    c, s = r["config"], r["summary"]
    first, later = s["first_conversation"], s["later_conversations"]
    lines = [
        "## system: new conversations on one shared system prompt",
        "",
        f"{s['conversations']} new conversations, each sending its first turn (Anthropic `/v1/messages`, streamed) "
        f"on one system prompt of about {c['system_tokens']} tokens with four tools and two `<system-reminder>` "
        "blocks in front of the user's text; one turn of an unrelated conversation runs between them, so the slot "
        "no longer holds the prompt. Targets as in `switch`; slotkeeper runs the first conversation in one pass, "
        "and after a pause (a person reading) cuts its idle slot back to the system part and saves that; later "
        "conversations start from the saved state sharing the most with them. *Backend prompt ms* is what the "
        "llama-server behind the target spent evaluating prompts for the request (its `/metrics`); the TTFT beyond "
        f"it is everything else: restore, save, the proxy, and waiting for a core on this shared machine. {_model(r)}",
        "",
        "First conversation (the prompt is new everywhere):",
        "",
        "| target | TTFT ms | backend prompt ms | prefilled by the backend | turn's prefilled (prompt_n) "
        "| turn's reused (cache_n) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for target, t in first["targets"].items():
        lines.append(f"| {target} | {_fmt(t['ttft_ms'])} | {_fmt(t['backend_prompt_ms'])} "
                     f"| {t['backend_prefilled']} | {t['prompt_n']} | {t['cache_n']} |")
    lines += [
        "",
        f"slotkeeper's TTFT on it: {first['slotkeeper_extra_ms_over_cram0']:+,.1f} ms against cram0's cold prefill of "
        f"the same turn (one sample each). Afterwards, off the requests' path, the cut: {first['cut_tokens']} tokens "
        f"in {first['cut_ms']} ms, saved as a system state of {first['system_snapshot_bytes'] / 2**20:.1f} MiB.",
        "",
        f"Later conversations ({s['conversations'] - 1}, each after the unrelated turn):",
        "",
        "| target | TTFT median ms | TTFT p99 ms | backend prompt ms (median) | TTFT beyond it (median) "
        "| prefilled (median) | reused (median) | restore ms | save ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for target, t in later["targets"].items():
        extra = ["", ""]
        if "restore_ms" in t:
            extra = [_fmt(t["restore_ms"]["median"]), _fmt(t["save_ms"]["median"])]
        beyond = t["ttft_beyond_backend_prompt_ms"]["median"]
        lines.append(f"| {target} | {_fmt(t['ttft_ms']['median'])} | {_fmt(t['ttft_ms']['p99'])} "
                     f"| {_fmt(t['backend_prompt_ms']['median'])} | {_fmt(beyond)} "
                     f"| {t['prompt_n_median']:g} | {t['cache_n_median']:g} | {' | '.join(extra)} |")
    a, b = later["ratios"]["cram0_over_slotkeeper"], later["ratios"]["default_over_slotkeeper"]
    states = ", ".join(f"{k} {v}" for k, v in later["targets"]["slotkeeper"]["cache_states"].items())
    lines += [
        "",
        f"Later conversations, cram0 / slotkeeper: {a['of_medians']:.2f}x (of medians), "
        f"{a['median_per_conversation']:.2f}x (per-conversation median); default / slotkeeper: "
        f"{b['of_medians']:.2f}x, {b['median_per_conversation']:.2f}x. slotkeeper's cache states: {states}.",
        "",
    ]
    p, after = s["prewarm"], s["after_prewarm"]
    lines += [
        f"`slotkeeper prewarm FILE` for a second prompt of the same size: {p['first']['status']}, "
        f"{p['first']['tokens']} tokens, {_fmt(p['first']['wall_ms'])} ms wall (the command's own start-up "
        f"included; {_fmt(p['first']['server_ms'])} ms in slotkeeper); run again: {p['again']['status']} in "
        f"{_fmt(p['again']['wall_ms'])} ms. The first conversation on the pre-warmed prompt then: "
        + "; ".join(f"{t} {_fmt(v['ttft_ms'])} ms TTFT, {v['prompt_n']} prefilled"
                    + (f" ({v['cache']})" if "cache" in v else "") for t, v in after.items()) + ".",
        "",
    ]
    return lines


def agent(r: dict[str, Any]) -> list[str]:
    c = r["config"]
    lines = [
        "## agent: a coding agent and a chat with side tasks sharing a backend",
        "",
        f"A coding agent ({c['agent_turns']} turns, Anthropic `/v1/messages` streamed: a system prompt of about "
        f"{c['system_tokens']} tokens, tools, a history growing by a tool call and its result each turn) and an "
        f"OpenWebUI-like chat ({c['chat_turns']} streamed turns, the first pasting a document, each followed by "
        "OpenWebUI's non-streamed `### Task:` requests under the same chat id: title and tags after the first "
        "reply, follow-ups after each) alternate: two agent turns, then a chat turn and its tasks. Targets as in "
        "`switch`. A *switched* turn is one whose slot the other conversation (or its tasks) used last: agent turns "
        "right after the chat, and the chat's turns after its first. Prefilled totals are the backends' own "
        f"`/metrics` counters over every request, slotkeeper's warm-ups included. {_model(r)}",
        "",
        "| slots | target | agent after the chat: TTFT median ms | chat after the agent: TTFT median ms "
        "| agent, consecutive turn: TTFT median ms | switched turns: TTFT p99 ms | prefilled total | reused total "
        "| prompt seconds |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def median(t: dict[str, Any], key: str) -> str:
        return _fmt(t["ttft_ms"][key]["median"]) if key in t["ttft_ms"] else ""

    for slots, s in r["summary"].items():
        for target, t in s["targets"].items():
            backend = t["backend"]
            lines.append(f"| {slots} | {target} | {median(t, 'agent switched')} | {median(t, 'chat switched')} "
                         f"| {median(t, 'agent consecutive')} | {_fmt(t['switched_ttft_ms']['p99'])} "
                         f"| {backend['prefilled']:,} | {backend['reused']:,} | {_fmt(backend['prompt_seconds'], 2)} |")
    lines += ["", "| slots | versus slotkeeper | switched turns: TTFT (of medians, per-turn median) "
              "| all main turns: TTFT (of medians) | prefilled | prompt seconds |", "|---:|---|---|---:|---:|---:|"]
    for slots, s in r["summary"].items():
        for label, key in (("cram0 / slotkeeper", "cram0_over_slotkeeper"),
                           ("default / slotkeeper", "default_over_slotkeeper")):
            x = s["ratios"][key]
            lines.append(f"| {slots} | {label} | {x['switched_ttft_of_medians']:.2f}x, "
                         f"{x['switched_ttft_median_per_turn']:.2f}x | {x['main_ttft_of_medians']:.2f}x "
                         f"| {x['prefilled']:.2f}x | {x['prompt_seconds']:.2f}x |")
    lines.append("")
    for slots, s in r["summary"].items():
        states = "; ".join(f"{kind}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
                           for kind, counts in s["targets"]["slotkeeper"]["cache_states"].items())
        lines.append(f"slotkeeper's cache states with {slots} slot(s): {states}.")
    return [*lines, ""]


def scale(r: dict[str, Any]) -> list[str]:
    s = r["summary"]
    ms = "ms p50 / p99"
    rows = [
        ("commit (fsync, checksum, rename, index rows), during the fill", ms,
         f"{_fmt(s['commit_ms']['median'], 2)} / {_fmt(s['commit_ms']['p99'], 2)}"),
        ("`checked_snapshot` (own snapshot: row, size, xxh3 of the file)", ms,
         f"{_fmt(s['checked_snapshot_ms']['median'], 3)} / {_fmt(s['checked_snapshot_ms']['p99'], 3)}"),
    ]
    for name, t in s["best_prefix_ms"].items():
        label = name if "min_messages" in name else f"{name}, min_messages {t['min_messages']}"
        rows.append((f"`best_prefix`: {label} ({t['found']}/{t['n']} found)", ms,
                     f"{_fmt(t['median'], 3)} / {_fmt(t['p99'], 3)}"))
    rows += [
        ("open the index (schema check)", "ms", _fmt(s["open_ms"], 2)),
        ("`reconcile()` (scan the slot dir, drop dangling rows)", "ms", _fmt(s["reconcile_ms"], 1)),
        ("`list()` all kinds", "ms median", _fmt(s["list_all_ms"]["median"], 1)),
        ("`usage()`", "ms median", _fmt(s["usage_ms"]["median"], 2)),
        ("`enforce_budget`, nothing to evict", "ms median", _fmt(s["enforce_budget_nothing_ms"]["median"], 1)),
        (f"`enforce_budget`, about 1% to evict ({s['enforce_budget_1pct_evicted']} snapshots)", "ms",
         _fmt(s["enforce_budget_1pct_ms"], 1)),
        ("index size on disk (SQLite file and its WAL)", "MiB", f"{s['index_bytes'] / 2**20:.1f}"),
    ]
    rows += [(f"slotkeeper start-up until /health is 200: {name}", "ms median", _fmt(t["median"], 0))
             for name, t in s["startup_ms"].items()]
    return [
        "## scale: the index and the planner at many snapshots",
        "",
        f"{s['snapshots']:,} committed snapshots ({s['system_snapshots']} of them system snapshots, the rest "
        f"conversations on those prompts with Zipf popularity, 10% forks), {s['chain_links']:,} chain links, files "
        f"of 2-8 KiB written as the backend writes them and committed through `SnapshotStore.commit` "
        f"({_fmt(s['fill_seconds'], 1)} s in all). `best_prefix` is asked as the planner asks on a cold slot "
        "(`min_messages` 2: more than the system message, which the system snapshot covers), and once without "
        f"that floor. {_model(r)}",
        "",
        "| operation | unit | time |",
        "|---|---|---:|",
        *(f"| {name} | {unit} | {value} |" for name, unit, value in rows),
        "",
    ]


def day(r: dict[str, Any]) -> list[str]:
    tr, probe, s = r["traffic"], r["state_probe"], r["summary"]["targets"]
    counts = ", ".join(f"{kind} {n}" for kind, n in tr["requests"].items())
    skipped = "".join(f" Skipped: {name} ({why})." for name, why in r.get("skipped_targets", {}).items())
    lines = [
        "## day: a replayed day of mixed traffic, with a restart halfway",
        "",
        f"One request list ({sum(tr['requests'].values())} requests in {tr['steps']} steps: {counts}) from "
        f"{len(tr['conversations'])} conversations, sent to each target in turn (order: {', '.join(r['order'])}): "
        "OpenWebUI-like chats without chat ids on one shared system prompt (a new chat's title task sent from a "
        "thread 30 ms before its first turn; tags and follow-up tasks now and then), two coding agents and a "
        "subagent without session ids on one shared agent prompt, and a Claude-Code-shaped client; its route: "
        f"{tr['claude_code_route']}. Every target is `--parallel 1`, stopped and started again after step "
        f"{tr['restart_after_step']} (slotkeeper's cache dir kept, its RAM dir emptied). *small-ram* is llama-server "
        f"with `--cache-ram {probe['small_ram_mib']}`: about {probe['small_ram_states']} of the conversations' "
        f"states at the measured {probe['bytes_per_token']:,.0f} bytes per token (a saved slot of "
        f"{probe['tokens']} tokens); *default* is `--cache-ram {probe['default_cache_ram_mib']}`, llama-server's "
        "default. *Shared* is, summed over requests, the longest token prefix each prompt shares with any earlier "
        "prompt (the backend's own template and tokenizer); *reused* is prompt tokens minus what the backend "
        "prefilled (its `/metrics`, warm-ups included, summed across the restart); *efficiency* = reused / shared. "
        f"TTFT of the non-streamed tasks is their whole response time. {_model(r)}{skipped}"
        + (" *slotkeeper per user* keeps users apart (docs/domains.md): every conversation of the day is a user "
           "of its own behind one key (OpenWebUI's forwarded `X-OpenWebUI-User-Id`), so nothing of one "
           "conversation serves another: the most keeping users apart can cost." if "slotkeeper per user" in s
           else ""),
        "",
        "*Resumed* is every conversation's turns after its first (chats, agents, the subagent, the Claude Code "
        "client; not the tasks): the turns a cache is for.",
        "",
        "| target | efficiency | prefilled | reused | shared | wall s | errors | resumed p50/p95 ms "
        "| chat p50/p95 | title p50/p95 | agent p50/p95 | subagent p50/p95 | claude-code p50/p95 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def pp(t: dict[str, Any], kind: str) -> str:
        x = t["ttft_ms"][kind] if kind != "resumed" else t.get("resumed_ttft_ms", {"n": 0})
        return f"{_fmt(x['p50'], 0)} / {_fmt(x['p95'], 0)}" if x["n"] else ""

    for target, t in s.items():
        eff = f"{t['efficiency'] * 100:.1f}%" if t["efficiency"] is not None else ""
        lines.append(f"| {target} | {eff} | {t['prefilled']:,} | {t['reused']:,} | {t['shared_prefix_tokens']:,} "
                     f"| {_fmt(t['wall_seconds'])} | {t['errors']} | {pp(t, 'resumed')} | {pp(t, 'chat')} "
                     f"| {pp(t, 'title')} "
                     f"| {pp(t, 'agent')} | {pp(t, 'subagent')} | {pp(t, 'claude-code')} |")
    kinds = sorted({k for t in s.values() for k in t["by_step_kind"]})
    lines += ["", "Prefilled tokens by kind of step (a title task and the first turn it comes with are one step):", "",
              "| target | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
    first = next(iter(s.values()))["by_step_kind"]
    least = [f"{first[k]['prompt_tokens'] - first[k]['shared_prefix_tokens']:,}" if k in first else "" for k in kinds]
    lines.append("| *least possible: prompt - shared* | " + " | ".join(least) + " |")
    for target, t in s.items():
        lines.append(f"| {target} | " + " | ".join(f"{t['by_step_kind'][k]['prefilled']:,}"
                                                  if k in t["by_step_kind"] else "" for k in kinds) + " |")
    lines += day_openwebui.report_lines(r)
    lines += [f"\n{note}" for note in r.get("notes", [])]
    return [*lines, ""]


def title(r: dict[str, Any]) -> list[str]:
    lines = [f"## title: a new chat's title task sent {_fmt(r['title_lead_ms'], 0)} ms before the chat, one slot", "",
             f"{r['pairs']} new chats per target with the title task and {r['pairs']} without, alternating; the chat's "
             f"first message pastes a document of about {r['document_tokens']} tokens, the title task runs "
             f"{r['title_tokens']} tokens. TTFT = the chat's time to first streamed token. *Title first* = chats "
             "whose title task was done before the chat's first token (it took the slot first).", "",
             "| target | TTFT without title (median ms) | TTFT with title (median ms) | with / without | title first | "
             "title ms (median) |", "|---|---:|---:|---:|---:|---:|"]
    for name in r["targets"]:
        s = r["summary"][name]
        lines.append(f"| {name} | {_fmt(s['ttft_without_title']['median'])} | {_fmt(s['ttft_with_title']['median'])} "
                     f"| {s['ratio_of_medians']:.2f}x | {s['title_ran_first']} of {s['pairs']} | "
                     f"{_fmt(s['title_ms_median'])} |")
    return [*lines, "", _model(r), ""]


def beyond(r: dict[str, Any]) -> list[str]:
    sh, s = r["shape"], r["summary"]
    probe = sh["state_probe"]
    lines = [
        "## beyond: more conversations than the RAM cache holds",
        "",
        f"{sh['conversations']} conversations of {sh['context_tokens']} tokens round-robin on one slot, "
        f"{r['config']['rounds']} resumed turns each (history + one new user message). *small-ram* is llama-server "
        f"with `--cache-ram {sh['small_ram_mib']}`: {sh['small_ram_states']} of the conversations' states at the "
        f"measured {probe['bytes_per_token']:,.0f} bytes per token (a saved slot of {probe['tokens']} tokens); "
        f"*default* is `--cache-ram {sh['default_cache_ram_mib']}`, which holds them all here; slotkeeper runs in "
        "front of a `--cache-ram 0` llama-server with its RAM dir. Every resumed turn goes to each target in "
        f"rotating order. TTFT = time to the first streamed content chunk. {_model(r)}",
        "",
        "| target | TTFT median ms | TTFT p99 ms | prefilled (median) | reused (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for target, t in s["targets"].items():
        lines.append(f"| {target} | {_fmt(t['ttft_ms']['median'])} | {_fmt(t['ttft_ms']['p99'])} "
                     f"| {t['prompt_n_median']:g} | {t['cache_n_median']:g} |")
    a, b = s["ratios"]["small_ram_over_slotkeeper"], s["ratios"]["default_over_slotkeeper"]
    lines += ["", f"small-ram / slotkeeper: {a['of_medians']:.2f}x of medians, {a['median_per_turn']:.2f}x per-turn "
              f"median; default / slotkeeper: {b['of_medians']:.2f}x, {b['median_per_turn']:.2f}x. slotkeeper's "
              f"turns: {', '.join(f'{n} {c}' for c, n in s['targets']['slotkeeper']['cache_states'].items())}.", ""]
    return lines


def first(r: dict[str, Any]) -> list[str]:
    s = r["summary"]
    t, ratio = s["targets"], s["slotkeeper_over_llama_server"]
    keeper = t["slotkeeper"]
    cut = keeper.get("cut_ms")
    lines = [
        "## first: the first turn on a new system prompt, through slotkeeper and straight to its llama-server",
        "",
        f"{r['pairs']} pairs of first turns, each on a system prompt of about {r['config']['system_tokens']} tokens "
        "never sent before, one straight to a `--cache-ram 0` llama-server and one through the slotkeeper in front "
        "of that same process (which runs the turn in one pass, and cuts the idle slot back to the system part "
        f"afterwards), alternating which goes first, 2 s apart. TTFT = time to the first streamed content chunk. "
        f"{_model(r)}",
        "",
        "| target | TTFT median ms | min | max | prompt tokens (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for target, x in t.items():
        lines.append(f"| {target} | {_fmt(x['ttft_ms']['median'])} | {_fmt(x['ttft_ms']['min'])} "
                     f"| {_fmt(x['ttft_ms']['max'])} | {x['prompt_n_median']:g} |")
    lines += ["", f"slotkeeper / llama-server: {ratio['of_medians']:.3f}x of medians, {ratio['median_per_pair']:.3f}x "
              "per-pair median. slotkeeper's cuts after the turns: "
              + (f"{_fmt(cut['median'], 0)} ms median" if cut else "none logged")
              + f"; its turns: {', '.join(f'{n} {c}' for c, n in keeper['cache_states'].items())}.", ""]
    return lines


def client(r: dict[str, Any]) -> list[str]:
    by_threads, cpus = r["summary"]["by_threads"], r["machine"]["cpus"]
    rounds = next(iter(by_threads.values()))["rounds"]
    lines = [
        "## client: slotkeeper's own upstream client against aiohttp's",
        "",
        f"{rounds} rounds of the `overhead` request (tiny prompt, {r['config']['overhead_answer_tokens']} streamed "
        "tokens, a hot session) to one llama-server: directly, through slotkeeper with its own client "
        "(`upstream/wire.py`), and through slotkeeper with aiohttp's client in its place "
        "(`bench/aiohttp_upstream.py`), the order rotating. Added = the target minus direct, per round; *aiohttp - "
        f"wire.py* is per round too. {_model(r)}",
        "",
        "| llama-server threads | target | TTFT median ms | added TTFT p50 ms | added total p50 ms "
        "| chunks/s / direct (per-round median) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for threads, s in by_threads.items():
        for target, t in s["targets"].items():
            added = s["over_direct"].get(target)
            cells = ["", "", ""] if added is None else [
                _fmt(added["added_ttft_ms"]["p50"], 2), _fmt(added["added_total_ms"]["p50"], 2),
                f"{added['chunks_per_s_ratio']:.3f}"]
            lines.append(f"| {threads} of {cpus} | {target} | {_fmt(t['ttft_ms']['median'])} | {' | '.join(cells)} |")
    lines += ["", "| llama-server threads | aiohttp - wire.py, TTFT p50 ms | total p50 ms "
              "| aiohttp / wire.py chunks/s (per-round median) |", "|---:|---:|---:|---:|"]
    for threads, s in by_threads.items():
        d = s["aiohttp_over_wire"]
        lines.append(f"| {threads} of {cpus} | {_fmt(d['ttft_ms_difference']['p50'], 2)} "
                     f"| {_fmt(d['total_ms_difference']['p50'], 2)} | {d['chunks_per_s_ratio']:.3f} |")
    return [*lines, ""]


def backends(r: dict[str, Any]) -> list[str]:
    tr, s = r["traffic"], r["summary"]
    lines = [
        "## backends: one model on one llama-server and on three, against round-robin",
        "",
        f"The day's traffic ({tr['requests']} requests of {tr['conversations']} conversations, no restart), every "
        "conversation from its own client thread at once, its turns in order. Each llama-server has one slot, and a "
        "target's servers share the machine's cores (`-t`), so on a small machine three backends cannot be faster "
        "than one: compare the two three-backend targets, which run on the same hardware. "
        "*slotkeeper, 3 backends* is one slotkeeper over three llama-servers of one model (three `[[backends]]` "
        "tables of one name: sessions stay on their owner, new ones spread within 1.25x the mean); *2 replicas* is "
        "two slotkeepers over the same three servers (two and one), sharing a session directory in Redis and a "
        "snapshot store, each request sent to a random replica; *round-robin* "
        "sends each request to the next of three plain llama-servers (`--cache-ram 8192`, their default), as a load "
        "balancer without session affinity does. *Efficiency* is as in `day`, over every backend's `/metrics`; "
        "*busiest* is the busiest backend's prompt tokens over the mean. "
        f"{_model(r)}",
        "",
        "| target | wall s | requests/s | errors | TTFT p50/p95 ms | resumed p50/p95 ms | efficiency | prefilled "
        "| busiest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for target, t in s.items():
        eff = f"{t['efficiency'] * 100:.1f}%" if t["efficiency"] is not None else ""
        busiest = f"{t['busiest_backend_vs_mean']:.2f}x" if t["backends"] > 1 and t["busiest_backend_vs_mean"] else ""
        lines.append(f"| {target} | {_fmt(t['wall_seconds'])} | {t['requests_per_second']:.2f} | {t['errors']} "
                     f"| {_fmt(t['ttft_ms']['p50'], 0)} / {_fmt(t['ttft_ms']['p95'], 0)} "
                     f"| {_fmt(t['resumed_ttft_ms']['p50'], 0)} / {_fmt(t['resumed_ttft_ms']['p95'], 0)} "
                     f"| {eff} | {t['prefilled']:,} | {busiest} |")
    return [*lines, ""]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def blocks(r: dict[str, Any]) -> list[str]:
    """bench/results/README.md's section for the `blocks` scenario."""
    s, shape = r["summary"], r["shape"]
    shared, long, ttft = s["shared_prompt"], s["long_conversation"], s["ttft"]
    cut = max(m.get("system_state_tokens", 0) for m in shared["modes"].values())
    system_note = f"; its system state, cut and saved by slotkeeper: {cut:,} tokens" if cut else ""
    lines = [
        "## blocks: the block store against whole files",
        "",
        "slotkeeper keeping saved states as KV blocks of B tokens, each stored once (`--block-tokens B`), against "
        "one whole file per state (`--block-tokens 0`, today), side by side: one slotkeeper and llama-server "
        "(`--cache-ram 0`) per mode, every turn sent to every mode in rotating order. Byte counts do not depend on "
        f"the machine; times do. {_model(r)}",
        "",
        f"**Shared system prompt.** {shared['conversations']} conversations on one system prompt "
        f"(`--system-tokens {shared['system_tokens']}`{system_note}), {shared['turns']} turns each, taking turns on "
        "one slot (idle saves at "
        "the default). Disk = every file in the slot dir afterwards (blocks, tails, whole files; not quarantine/ "
        "nor the index); distinct KV = KV bytes per token x the number of distinct token prefixes over all saved "
        "states' token lists (what storing each shared prefix once would take). The bar for blocks: disk / "
        "distinct KV <= 1.15x.",
        "",
        "| mode | states | distinct tokens | distinct KV MiB | disk MiB | blocks MiB | tails MiB | whole files MiB "
        "| disk / distinct KV | disk / today |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, m in shared["modes"].items():
        d = m["disk"]
        lines.append(f"| {mode} | {m['states']} | {m['distinct_tokens']:,} | {_mib(m['distinct_kv_bytes'])} "
                     f"| {_mib(d['total'])} | {_mib(d['blocks'])} | {_mib(d['tails'])} | {_mib(d['whole_files'])} "
                     f"| {m['disk_over_distinct_kv']:.3f}x | {m['disk_over_today']:.3f}x |")
    lines += [
        "",
        f"**One long conversation.** {long['turns']} turns of one conversation; after each turn's idle save was "
        "committed, the bytes of files new or changed in the slot dir (written), and once the shared tier's uploads "
        "settled, the bytes of objects new in the S3-compatible bucket (moto on loopback; uploaded). New KV = KV "
        "bytes of the tokens past the common prefix with the previous saved state; tail = the state's tail (its "
        "header and token list, and any KV no block holds). Totals over the resumed turns (the first writes the "
        "whole state in every mode). The bar for blocks (issue #41): written / new KV <= 1.2x.",
        "",
        "| mode | written per turn (median KiB) | written MiB | new KV MiB | new KV + tail MiB | written / new KV "
        "| written / (new KV + tail) | written / today | uploaded MiB | uploaded / (new KV + tail) "
        "| uploaded / today |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    attach = s.get("long_conversation_no_ram_dir", {}).get("modes", {})
    rows = [*long["modes"].items(), *((f"{mode}, no RAM dir", m) for mode, m in attach.items())]
    for mode, m in rows:
        t = m["later_totals"]
        lines.append(f"| {mode} | {m['written_per_turn_bytes']['median'] / 1024:,.0f} | {_mib(t['written_bytes'])} "
                     f"| {_mib(t['new_kv_bytes'])} | {_mib(t['new_kv_bytes'] + t['tail_bytes'])} "
                     f"| {m['written_over_new_kv']:.3f}x | {m['written_over_new_kv_plus_tail']:.3f}x "
                     f"| {m['written_over_today']:.3f}x | {_mib(t['uploaded_bytes'])} "
                     f"| {m['uploaded_over_new_kv_plus_tail']:.3f}x | {m['uploaded_over_today']:.3f}x |")
    if attach:
        lines += ["", "*No RAM dir*: slotkeeper in attach mode without `--ram-dir`, the backend's `--slot-save-path` "
                  "its slot dir. The backend writes each save's whole file there; the block store cuts it into "
                  "blocks and a tail and removes it. Its written bytes count that file (the saves' sizes, from "
                  "slotkeeper's /metrics) besides the blocks and tail. Whole files (today) write the same with "
                  "or without a RAM dir: one file per save."]
    lines += [
        "",
        f"**Time to first token of resumed turns** (blocks of {shape['ttft_blocks']} tokens). *switch*: "
        f"{ttft['switch']['sessions']} sessions of {ttft['switch']['tokens']} tokens taking turns on one slot, "
        f"{ttft['switch']['rounds']} resumed turns each, saved on the switch; *restart*: "
        f"{ttft['restart']['sessions']} sessions primed, every process stopped and started again (a RAM dir starts "
        "empty), the next turn restored from disk. With a RAM dir the backend restores a RAM copy when one is "
        "there (blocks: kept after the save); without, a state kept as blocks is assembled into the slot dir "
        "first. llama-server alone prefills the turn cold. Each timed turn starts half a second after the one "
        "before it, once that target's commit in the background is over, so that no turn runs beside another "
        "target's work.",
        "",
        "| workload | target | TTFT median ms | TTFT max ms | restore ms (median) | reused (cache_n) | cache |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for workload in ("switch", "restart"):
        for target, t in ttft[workload]["targets"].items():
            restore = f"{t['restore_ms']['median']:,.1f}" if "restore_ms" in t else ""
            states = ", ".join(f"{k} {v}" for k, v in t.get("cache_states", {}).items())
            lines.append(f"| {workload} | {target} | {t['ttft_ms']['median']:,.1f} | {t['ttft_ms']['max']:,.1f} "
                         f"| {restore} | {t['cache_n_median']:g} | {states} |")
    lines += ["", "| workload | blocks / today, RAM dir (of medians, per-turn median) "
              "| blocks / today, no RAM dir (of medians, per-turn median) | cold / blocks (RAM dir, no RAM dir) |",
              "|---|---|---|---|"]
    for workload in ("switch", "restart"):
        q = ttft[workload]["ratios"]
        ram, disk = q["blocks_over_today_ram"], q["blocks_over_today_disk"]
        cold_ram, cold_disk = q["cold_over_blocks_ram"]["of_medians"], q["cold_over_blocks_disk"]["of_medians"]
        lines.append(f"| {workload} | {ram['of_medians']:.2f}x, {ram['median_per_turn']:.2f}x "
                     f"| {disk['of_medians']:.2f}x, {disk['median_per_turn']:.2f}x "
                     f"| {cold_ram:.1f}x, {cold_disk:.1f}x |")
    lines += ["", "**Per block size** (parts above, one row per mode):", "",
              "| mode | disk MiB | disk / distinct KV | disk / today | written / (new KV + tail) | written / today "
              "| uploaded / today |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, m in s["by_block_tokens"].items():
        lines.append(f"| {mode} | {_mib(m['disk_bytes'])} | {m['disk_over_distinct_kv']:.3f}x "
                     f"| {m['disk_over_today']:.3f}x | {m['written_over_new_kv_plus_tail']:.3f}x "
                     f"| {m['written_over_today']:.3f}x | {m['uploaded_over_today']:.3f}x |")
    return [*lines, ""]


def swap(r: dict[str, Any]) -> list[str]:
    """bench/results/README.md's section for the `swap` scenario."""
    s, c = r["summary"], r["config"]
    a, k = s["targets"]["router alone"], s["targets"]["slotkeeper"]
    q = s["ratios"]
    return [
        "## swap: models taking turns behind a llama-server router",
        "",
        "Two models behind a router with `--models-max 1`, through slotkeeper (which launches its own) and to a "
        f"router alone, taking turns; {c['rounds']} rounds of: a conversation of about {c['tokens'][0]} words on A "
        f"(A not loaded: its first turn), a turn on B (which unloads A), A's return turn. {_model(r)}",
        "",
        "| target | A's first turn, TTFT median ms | A's return, TTFT median ms | return: prompt_n | return: cache_n |",
        "|---|---:|---:|---:|---:|",
        f"| router alone | {_fmt(a['first_ttft_ms']['median'], 0)} | {_fmt(a['return_ttft_ms']['median'], 0)} "
        f"| {a['return_prompt_n_median']:g} | {a['return_cache_n_median']:g} |",
        f"| slotkeeper | {_fmt(k['first_ttft_ms']['median'], 0)} | {_fmt(k['return_ttft_ms']['median'], 0)} "
        f"| {k['return_prompt_n_median']:g} | {k['return_cache_n_median']:g} |",
        "",
        f"Router alone / slotkeeper on A's return: **{q['router_alone_over_slotkeeper_return']:.1f}x**. The router's "
        f"load of A {_fmt(s['router_load_ms'], 0)} ms plus slotkeeper's restore {_fmt(s['slotkeeper_restore_ms'], 0)} "
        f"ms: slotkeeper's return is {q['return_over_load_plus_restore']:.2f}x that, "
        f"{q['return_but_new_tokens_over_load_plus_restore']:.2f}x without its new message's prefill "
        f"({_fmt(s['slotkeeper_return_new_tokens_prompt_ms'], 0)} ms). First turn on a model not loaded, slotkeeper / "
        f"router alone: {q['first_turn_slotkeeper_over_alone']:.2f}x.",
        "",
    ]


def domains(r: dict[str, Any]) -> list[str]:
    """bench/results/README.md's section for the `domains` scenario."""
    s, c = r["summary"], r["config"]
    q = s["per_user_over_one_domain"]
    lines = [
        "## domains: what keeping users apart costs",
        "",
        f"{r['users']} OpenWebUI users behind one key, {r['chats_per_user']} chat(s) each of {r['turns']} turns on one "
        f"shared system prompt (about {c['system_tokens']:,} tokens) and a question of their own, interleaved on one "
        "slot; then a new user sends the first user's first request word for word (the probe: the side channel). "
        f"{_model(r)}",
        "",
        "| target | prompt tokens | reused | prefilled | TTFT p50 ms | first turns, TTFT p50 ms | probe TTFT ms "
        "| probe / cold prefill | probe cache_n | states kept | of them system | bytes on disk |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in s["targets"].items():
        kept = t.get("kept")
        kept_cells = (f"{kept['states']} | {kept['system_states']} | {kept['stored_bytes']:,}" if kept
                      else "- | - | -")
        lines.append(f"| {name} | {t['prompt_tokens']:,} | {t['reused_tokens']:,} | {t['prefilled_tokens']:,} "
                     f"| {_fmt(t['ttft_ms_p50'], 0)} | {_fmt(t['first_turn_ttft_ms_p50'], 0)} "
                     f"| {_fmt(t['probe']['ttft_ms'], 0)} | {t['probe']['over_cold']:.2f} | {t['probe']['cache_n']:,} "
                     f"| {kept_cells} |")
    lines += ["", f"One domain per user against one domain: {q['prefilled']:.2f}x the tokens prefilled, "
              f"{q['first_turn_ttft']:.2f}x the first turns' TTFT, {q['stored_bytes']:.2f}x the bytes on disk; "
              f"the probe (another user's prompt) takes {q['probe_ttft']:.1f}x as long: it is no longer answered "
              "from the other user's state.", ""]
    return lines


def turns(r: dict[str, Any]) -> list[str]:
    """bench/results/README.md's section for the `turns` scenario."""
    kinds = r["summary"]["kinds"]
    lines = [
        "## turns: where each millisecond of a turn goes",
        "",
        f"Each kind of turn, {r['rounds']} rounds of new text each (conversations of about {r['tokens']:,} tokens), "
        "sent alike to llama-server alone (`--cache-ram 0`, one slot) and to slotkeeper in front of another (RAM dir, "
        "default idle saves), the two taking turns going first. *Added*: slotkeeper's time to first token (a side "
        "task's whole time) minus llama-server's, median of the rounds. Of slotkeeper's: the time until its lease "
        "(the queue, the save of the slot's occupant, the decision, the restore), and *other*: the rest beside the "
        "backend's own prompt time (the proxy, and the backend's request handling), next to llama-server's. A "
        "restore's *added over hot* is its time to first token minus that of the same next turn in a slot that holds "
        "the conversation: llama-server alone's, and slotkeeper's own (the same backend process, whose speed does "
        "not differ, and the proxy in both); its *floor* the time to read the restored bytes from tmpfs on this "
        "machine, and *restore call* the backend's restore request alone. "
        f"{_model(r)}",
        "",
        "| kind | llama-server ms | slotkeeper ms | added ms | slotkeeper cache | decide ms | save ms | restore ms "
        "| lease ms | other ms (alone / slotkeeper) | prompt_n (alone / slotkeeper) | restored MiB | floor ms "
        "| added over hot ms (alone / own) | over floor (alone / own) | restore call over floor |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, k in kinds.items():
        restored = f"{k['restored_bytes'] / 2**20:.1f}" if "restored_bytes" in k else "-"
        floor = _fmt(k["read_floor_ms"], 2) if "read_floor_ms" in k else "-"
        over_hot = _fmt(k["added_over_hot_ms"], 1) if "added_over_hot_ms" in k else "-"
        if "added_over_own_hot_ms" in k:
            over_hot += f" / {_fmt(k['added_over_own_hot_ms'], 1)}"
        over_floor = " / ".join(f"{k[name]:.1f}x" for name in ("added_over_floor", "own_added_over_floor")
                                if k.get(name) is not None) or "-"
        call = f"{k['restore_call_over_floor']:.1f}x" if k.get("restore_call_over_floor") is not None else "-"
        lines.append(
            f"| {kind} | {_fmt(k['llama_server_ttft_ms'], 1)} | {_fmt(k['slotkeeper_ttft_ms'], 1)} "
            f"| {k['added_ms']:+.1f} | {', '.join(k['slotkeeper_cache'])} | {_fmt(k['decide_ms'], 1)} "
            f"| {_fmt(k['save_ms'], 1)} | {_fmt(k['restore_ms'], 1)} | {_fmt(k['lease_ms'], 1)} "
            f"| {_fmt(k['llama_server_other_ms'], 1)} / {_fmt(k['slotkeeper_other_ms'], 1)} "
            f"| {k['llama_server_prompt_n']:g} / {k['slotkeeper_prompt_n']:g} | {restored} | {floor} | {over_hot} "
            f"| {over_floor} | {call} |")
    return [*lines, ""]


def days(r: dict[str, Any]) -> list[str]:
    """bench/results/README.md's section for the `days` scenario."""
    rounds = (f"each figure the median of {r['rounds']} rounds, the order reversed every other round" if r["rounds"] > 1
              else "one round")
    lines = [
        "## days: the two judged days, replayed live",
        "",
        "Each target on its own llama-server (one slot), every client sending back the answers its target generated. "
        "`ids`: OpenWebUI with chat ids, coding agents with session ids, a Claude-Code-shaped client; `default`: "
        "OpenWebUI's default settings (no ids, no system prompt, a pasted document, a reasoning chat whose answers "
        "come back without their reasoning) and coding agents without ids. *Reuse*: tokens not prefilled over the "
        "tokens each prompt shares with an earlier one the same target was sent. *Main TTFT*: the chats' and "
        "agents' times to first token, summed. Reuse above 100%: a state holds the answer its model generated, which "
        "the next prompt shares too, and S counts what prompts share. Each target on fresh processes, one after "
        f"another; {rounds}. {_model(r)}",
        "",
        "| day | target | reuse | prefilled | wall s | side tasks s | main TTFT s | main TTFT p50 ms | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for day, d in r["days"].items():
        for target, s in d["summary"].items():
            lines.append(
                f"| {day} | {target} | {s['reuse']:.1%} | {s['prefilled']:,.0f} | {s['wall_s']:.2f} "
                f"| {s['side_tasks_s']:.2f} | {s['main_ttft_s']:.2f} | {_fmt(s['main_ttft_p50_ms'], 0)} "
                f"| {s['errors']} |")
    return [*lines, ""]
