"""Scenario `blocks`: the block store (`--block-tokens B`, cache/blockstore.py) against whole files (`--block-tokens
0`, "today"), side by side in one run, each mode a slotkeeper of its own over a `--cache-ram 0` llama-server of its
own, every turn sent to every mode in rotating order.

1. Shared system prompt: N conversations on one long system prompt, T turns each (taking turns on one slot, idle
   saves at slotkeeper's default). Afterwards: the bytes on disk in each mode's slot dir (blocks, tails, whole files;
   not quarantine/ nor the index) against the KV bytes of the distinct tokens of all saved states (distinct: the
   number of distinct token prefixes over every saved state's token list).
2. One long conversation: for each saved turn, the bytes written to the persistent slot dir (files new or changed
   once the turn's save was committed) against the KV of the tokens new since the previous saved state (beyond their
   common prefix) plus the tail; and the bytes of the objects new in an S3-compatible bucket (moto's server on
   loopback, `--shared-store`) once the shared tier's uploads settled, listed before and after the turn.
3. TTFT of resumed turns, blocks vs today, with and without a RAM dir: a `switch` workload (sessions taking turns on
   one slot, every turn a restore) and a `restart` one (both processes stopped and started again, the next turn
   restored from disk), beside llama-server alone (`--cache-ram 0`, a cold prefill).
4. Parts 1 and 2 run for every block size in BLOCK_SIZES (`--small`: 64 only, the default).

Parts 1 and 2 run with a RAM dir (as slotkeeper sets itself up in launch mode): the backend writes its save into
tmpfs and only what the store keeps reaches the slot dir. Part 2 runs once more for blocks of ATTACH_BLOCKS tokens
without a RAM dir (attach mode without `--ram-dir`): the backend writes each save's whole file into the slot dir,
where the block store cuts it and removes it, so what is written there is that file (from slotkeeper's
/metrics: the saves' sizes) and the blocks and tail."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.blockfiles import (
    backend_save_bytes,
    bucket_listing,
    common_prefix,
    current,
    disk_usage,
    distinct_tokens,
    kv_bytes_per_token,
    saved_rows,
    slot_dir_of,
    slot_files,
    state_tokens,
    upload_counter,
    uploaded,
    wait_idle,
    wait_saved,
    wait_uploads,
    written,
)
from bench.common import (
    BenchConfig,
    Processes,
    describe,
    keeper_record,
    machine,
    make_model,
    prime,
    processes,
    ratio,
    stream_chat,
)
from bench.switch import DEFAULT_SAVE_IDLE_SECONDS, next_turn, opening
from tests.support import ObjectStoreServer, Slotkeeper, words

TODAY = 0
COLD = "llama-server cram0"
# Parts 1 and 2: each mode's RAM dir holds copies of recent states up to this (slotkeeper's default is a quarter of
# the memory per slotkeeper; several run here at once). What reaches the slot dir does not depend on it.
RAM_BUDGET = "2G"
# Before each timed turn of part 3: the pause that lets the previous target's background work (the commit of the
# state its turn switched out, 30-130 ms here) end, so that no target's turn runs beside another target's commit.
# Without it, the rotation's fixed order gave each target nearly always the same predecessor: llama-server alone (no
# commit) went before "today, RAM dir", and "today, RAM dir" before "blocks 64, RAM dir". On 2026-12-06, blocks over
# today with a RAM dir, switch: 1.14x without the pause; 0.93x with the two alone, taking turns; 1.06x with it.
SETTLE_SECONDS = 0.5
BUCKET_PREFIX = "bench"
# Part 2 without a RAM dir: the block size it is run for.
ATTACH_BLOCKS = 64


@dataclass(frozen=True)
class Shape:
    conversations: int  # part 1: conversations on the shared system prompt
    turns: int  # part 1: turns of each
    own_tokens: int  # part 1: each conversation's own first message
    long_turns: int  # part 2: turns of the long conversation
    long_opening: int  # part 2: tokens of its first message
    block_sizes: tuple[int, ...]  # parts 1 and 2
    ttft_blocks: int  # part 3: the block size compared with today


FULL = Shape(conversations=20, turns=6, own_tokens=150, long_turns=30, long_opening=1000, block_sizes=(64, 128, 256),
             ttft_blocks=64)
SMALL = Shape(conversations=4, turns=2, own_tokens=60, long_turns=6, long_opening=300, block_sizes=(64,),
              ttft_blocks=64)


def mode_name(block_tokens: int) -> str:
    return "today" if block_tokens == TODAY else f"blocks {block_tokens}"


def counts(values: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    for value in values:
        found[value] = found.get(value, 0) + 1
    return dict(sorted(found.items()))


def rotated(items: list[Any], k: int) -> list[Any]:
    return [items[(k + i) % len(items)] for i in range(len(items))]


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    model = make_model(root, config.model_size)
    shape = SMALL if config.small else FULL
    # The shared tier's client reads its credentials from the environment; moto takes any.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    modes = [TODAY, *shape.block_sizes]
    samples: list[dict[str, Any]] = []
    timings: dict[str, float] = {}
    started = time.monotonic()
    shared = shared_prompt(config, shape, modes, model, root / "shared", samples)
    timings["shared_prompt_s"] = time.monotonic() - started
    started = time.monotonic()
    long = long_conversation(config, shape, modes, model, root / "long", samples)
    timings["long_conversation_s"] = time.monotonic() - started
    started = time.monotonic()
    attach = long_conversation(config, shape, [ATTACH_BLOCKS], model, root / "long-no-ram-dir", samples,
                               ram_dir=False)
    over_today(attach, long["modes"][mode_name(TODAY)]["later_totals"])
    timings["long_conversation_no_ram_dir_s"] = time.monotonic() - started
    started = time.monotonic()
    switching, restarting = ttft_parts(config, shape, model, root / "ttft", samples)
    timings["ttft_s"] = time.monotonic() - started
    return {"scenario": "blocks", "config": config.as_json(), "machine": machine(), "shape": asdict(shape),
            "modes": [mode_name(b) for b in modes], "ram_budget": RAM_BUDGET, "part_seconds": timings,
            "samples": samples,
            "summary": {"shared_prompt": shared, "long_conversation": long, "long_conversation_no_ram_dir": attach,
                        "ttft": {"switch": switching, "restart": restarting},
                        "by_block_tokens": by_block_tokens(shape, shared, long)}}


# -- measuring a slot dir ----------------------------------------------------------------------------------------------


def start_modes(procs: Processes, modes: list[int], ctx: int, label: str, *extra: str,
                ram_dir: bool = True) -> dict[int, Slotkeeper]:
    keepers = {}
    with httpx.Client(timeout=120) as client:
        for b in modes:
            name = f"{label}-{b}"
            backend = procs.backend(f"{name}-behind", cache_ram=0, ctx_per_slot=ctx, ram_dir=ram_dir)
            prime(client, backend.url)
            keepers[b] = procs.slotkeeper(name, backend, "--block-tokens", str(b), "--ram-budget", RAM_BUDGET, *extra)
    return keepers


def shared_prompt(config: BenchConfig, shape: Shape, modes: list[int], model: Path, root: Path,
                  samples: list[dict[str, Any]]) -> dict[str, Any]:
    ctx = config.system_tokens + shape.own_tokens + shape.turns * 120 + 1024
    system = f"You are a coding agent working in a repository. {words(config.system_tokens, 101)}"
    chats = {f"conv-{c}": [{"role": "system", "content": system},
                           {"role": "user", "content": words(shape.own_tokens, 1000 + c)}]
             for c in range(shape.conversations)}
    out: dict[str, Any] = {"conversations": shape.conversations, "turns": shape.turns,
                           "system_tokens": config.system_tokens, "modes": {}}
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        keepers = start_modes(procs, modes, ctx, "shared", "--save-idle-seconds", DEFAULT_SAVE_IDLE_SECONDS)
        k = 0
        for turn in range(shape.turns):
            for c, session in enumerate(list(chats)):
                if turn:
                    chats[session] = next_turn(chats[session], 50_000 + 100 * turn + c)
                for b in rotated(modes, k):
                    r = stream_chat(client, keepers[b].url, chats[session], session, config.answer_tokens)
                    samples.append({"part": "shared", "mode": mode_name(b), "conversation": c, "turn": turn,
                                    "ttft_ms": r.ttft_ms, "prompt_n": r.prompt_n, "cache_n": r.cache_n,
                                    "cache": r.cache_header})
                k += 1
        for b in modes:
            keeper = keepers[b]
            wait_idle(client, keeper.url)
            slot_dir = slot_dir_of(keeper)
            rows = saved_rows(client, keeper.url)
            usage = disk_usage(slot_files(slot_dir))
            lists = [state_tokens(slot_dir, row) for row in rows]
            kv = kv_bytes_per_token(slot_dir, rows[0], b, root / "assembled")
            distinct = distinct_tokens(lists)
            out["modes"][mode_name(b)] = {
                "block_tokens": b, "states": len(rows),
                "kinds": counts(r["kind"] for r in rows), "stored_as": counts(r["stored_as"] for r in rows),
                "state_tokens": sum(int(t.size) for t in lists), "state_bytes": sum(r["bytes"] for r in rows),
                # The system part slotkeeper cut and saved on its own (how many tokens the shared prompt is).
                "system_state_tokens": max((r["tokens"] for r in rows if r["kind"] == "system"), default=0),
                "distinct_tokens": distinct, "kv_bytes_per_token": kv, "distinct_kv_bytes": distinct * kv,
                "disk": usage, "disk_over_distinct_kv": ratio(usage["total"], distinct * kv),
            }
    today = out["modes"][mode_name(TODAY)]["disk"]["total"]
    for entry in out["modes"].values():
        entry["disk_over_today"] = ratio(entry["disk"]["total"], today)
    return out


# -- part 2: one long conversation, bytes written and uploaded per saved turn ------------------------------------------


def long_conversation(config: BenchConfig, shape: Shape, modes: list[int], model: Path, root: Path,
                      samples: list[dict[str, Any]], ram_dir: bool = True) -> dict[str, Any]:
    """Part 2. Without a RAM dir (`ram_dir` False), a turn's written bytes also count the whole file the backend
    wrote into the slot dir for the save, which the block store cut and removed."""
    ctx = shape.long_opening + shape.long_turns * 120 + 1024
    store = ObjectStoreServer(root / "s3.log")
    root.mkdir(parents=True, exist_ok=True)
    rows_out: dict[int, list[dict[str, Any]]] = {b: [] for b in modes}
    session = "long"
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        store.start()
        procs.stack.callback(store.stop)
        keepers: dict[int, Slotkeeper] = {}
        for b in modes:
            prefix = f"{BUCKET_PREFIX}-{b}"
            keepers.update(start_modes(procs, [b], ctx, "long", "--save-idle-seconds", DEFAULT_SAVE_IDLE_SECONDS,
                                       "--shared-store", f"s3://{store.bucket}/{prefix}", "--shared-endpoint",
                                       store.url, ram_dir=ram_dir))
        messages = opening(session, shape.long_opening, 4242)
        previous: dict[int, np.ndarray] = {b: np.empty(0, dtype=np.int32) for b in modes}
        for turn in range(1, shape.long_turns + 1):
            if turn > 1:
                messages = next_turn(messages, 60_000 + 100 * turn)
            before: dict[int, tuple[int, dict[str, tuple[int, int, int]], float | None,
                                    dict[str, tuple[int, str]]]] = {}
            backend_before = {} if ram_dir else {b: backend_save_bytes(client, keepers[b].url) for b in modes}
            for b in modes:
                prefix = f"{BUCKET_PREFIX}-{b}/"
                before[b] = (current(client, keepers[b].url)["saves"], slot_files(slot_dir_of(keepers[b])),
                             upload_counter(client, keepers[b].url), bucket_listing(store, prefix))
            results = {}
            for b in rotated(modes, turn):
                results[b] = stream_chat(client, keepers[b].url, messages, session, config.answer_tokens)
            for b in modes:  # the idle saves of every mode run meanwhile
                wait_saved(client, keepers[b].url, before[b][0])
            listings = wait_uploads(client, {b: (keepers[b].url, f"{BUCKET_PREFIX}-{b}/", before[b][2], before[b][3])
                                             for b in modes}, store)
            for b in modes:
                keeper, (_, files, _, listing) = keepers[b], before[b]
                after_listing = listings[b]
                slot_dir = slot_dir_of(keeper)
                after_files = slot_files(slot_dir)
                rows = [r for r in saved_rows(client, keeper.url) if r["session"] == session]
                if not rows:
                    raise RuntimeError(f"{mode_name(b)}: no saved state of {session} after turn {turn}")
                row = rows[0]
                tokens = state_tokens(slot_dir, row)
                shared_n = common_prefix(previous[b], tokens)
                previous[b] = tokens
                wrote = written(files, after_files)
                if not ram_dir:  # the backend's own file, cut into blocks and removed before the listing
                    wrote["backend_file"] = backend_save_bytes(client, keeper.url) - backend_before[b]
                    wrote["total"] += wrote["backend_file"]
                sample = {"part": "long" if ram_dir else "long, no RAM dir", "mode": mode_name(b), "turn": turn,
                          "ttft_ms": results[b].ttft_ms, "prompt_n": results[b].prompt_n,
                          "cache_n": results[b].cache_n, "tokens": int(tokens.size),
                          "new_tokens": int(tokens.size) - shared_n, "state_bytes": row["bytes"],
                          "stored_as": row["stored_as"], "tail_bytes": row["tail_bytes"], "written": wrote,
                          "uploaded": uploaded(listing, after_listing)}
                rows_out[b].append(sample)
                samples.append(sample)
        kv = {b: kv_bytes_per_token(slot_dir_of(keepers[b]), saved_rows(client, keepers[b].url)[0], b,
                                    root / "assembled") for b in modes}
    return summarize_long(modes, rows_out, kv)


def summarize_long(modes: list[int], rows: dict[int, list[dict[str, Any]]], kv: dict[int, int]) -> dict[str, Any]:
    out: dict[str, Any] = {"turns": len(rows[modes[0]]), "modes": {}}
    for b in modes:
        per_turn = []
        for r in rows[b]:
            new_kv = r["new_tokens"] * kv[b]
            reference = new_kv + r["tail_bytes"]
            per_turn.append({"turn": r["turn"], "tokens": r["tokens"], "new_tokens": r["new_tokens"],
                             "new_kv_bytes": new_kv, "tail_bytes": r["tail_bytes"],
                             "written_bytes": r["written"]["total"], "written_block_bytes": r["written"]["blocks"],
                             "uploaded_bytes": r["uploaded"]["bytes"], "uploaded_objects": r["uploaded"]["objects"],
                             "state_bytes": r["state_bytes"],
                             "written_over_new_kv_plus_tail": ratio(r["written"]["total"], reference),
                             "uploaded_over_new_kv_plus_tail": ratio(r["uploaded"]["bytes"], reference)})
        # The first turn writes the whole state in every mode; the ratios of the resumed turns are the ones to read.
        later = per_turn[1:] or per_turn
        total = {key: sum(t[key] for t in later) for key in ("new_kv_bytes", "tail_bytes", "written_bytes",
                                                             "uploaded_bytes", "state_bytes", "new_tokens")}
        reference = total["new_kv_bytes"] + total["tail_bytes"]
        out["modes"][mode_name(b)] = {
            "block_tokens": b, "kv_bytes_per_token": kv[b], "per_turn": per_turn,
            "later_turns": len(later), "later_totals": total,
            "written_over_new_kv_plus_tail": ratio(total["written_bytes"], reference),
            "written_over_new_kv": ratio(total["written_bytes"], total["new_kv_bytes"]),
            "uploaded_over_new_kv_plus_tail": ratio(total["uploaded_bytes"], reference),
            "written_median_per_turn": statistics.median(t["written_over_new_kv_plus_tail"] for t in later),
            "written_per_turn_bytes": describe([float(t["written_bytes"]) for t in later]),
            "uploaded_per_turn_bytes": describe([float(t["uploaded_bytes"]) for t in later]),
        }
    if TODAY in modes:
        over_today(out, out["modes"][mode_name(TODAY)]["later_totals"])
    return out


def over_today(long: dict[str, Any], today: dict[str, Any]) -> None:
    """Each mode's written and uploaded bytes against whole files' (`today`: their later turns' totals)."""
    for entry in long["modes"].values():
        entry["written_over_today"] = ratio(entry["later_totals"]["written_bytes"], today["written_bytes"])
        entry["uploaded_over_today"] = ratio(entry["later_totals"]["uploaded_bytes"], today["uploaded_bytes"])


# -- part 3: TTFT of resumed turns -------------------------------------------------------------------------------------


def ttft_targets(shape: Shape) -> list[tuple[str, int, bool]]:
    """(name, block tokens, RAM dir) of every slotkeeper target."""
    return [(f"slotkeeper {mode_name(b)}{', RAM dir' if ram else ', no RAM dir'}", b, ram)
            for ram in (True, False) for b in (TODAY, shape.ttft_blocks)]


def _ttft_summary(samples: list[dict[str, Any]], shape: Shape, key: str) -> dict[str, Any]:
    names = [COLD, *(n for n, _, _ in ttft_targets(shape))]
    targets: dict[str, Any] = {}
    for name in names:
        mine = [s for s in samples if s["target"] == name]
        entry: dict[str, Any] = {"ttft_ms": describe([s["ttft_ms"] for s in mine]),
                                 "prompt_n_median": statistics.median(s["prompt_n"] for s in mine),
                                 "cache_n_median": statistics.median(s["cache_n"] for s in mine)}
        if name != COLD:
            entry["restore_ms"] = describe([s["restore_ms"] for s in mine])
            entry["cache_states"] = {c: sum(1 for s in mine if s["cache"] == c) for c in sorted({s["cache"]
                                                                                                 for s in mine})}
        targets[name] = entry
    by_turn: dict[Any, dict[str, float]] = {}
    for s in samples:
        by_turn.setdefault(s[key], {})[s["target"]] = s["ttft_ms"]
    ratios = {}
    for ram in (True, False):
        suffix = ", RAM dir" if ram else ", no RAM dir"
        blocks = f"slotkeeper {mode_name(shape.ttft_blocks)}{suffix}"
        today = f"slotkeeper {mode_name(TODAY)}{suffix}"
        ratios["blocks_over_today" + ("_ram" if ram else "_disk")] = {
            "of_medians": ratio(targets[blocks]["ttft_ms"]["median"], targets[today]["ttft_ms"]["median"]),
            "median_per_turn": statistics.median(ratio(t[blocks], t[today]) for t in by_turn.values()),
            "restore_ms_of_medians": ratio(targets[blocks]["restore_ms"]["median"],
                                           targets[today]["restore_ms"]["median"]),
        }
        ratios["cold_over_blocks" + ("_ram" if ram else "_disk")] = {
            "of_medians": ratio(targets[COLD]["ttft_ms"]["median"], targets[blocks]["ttft_ms"]["median"])}
    return {"targets": targets, "ratios": ratios}


def _ttft_sample(client: httpx.Client, url: str, keeper: bool, messages: list[dict[str, str]], session: str,
                config: BenchConfig) -> dict[str, Any]:
    """One timed turn, SETTLE_SECONDS after the turn before it."""
    time.sleep(SETTLE_SECONDS)
    since = time.time()
    r = stream_chat(client, url, messages, session, config.answer_tokens)
    sample: dict[str, Any] = {"ttft_ms": r.ttft_ms, "total_ms": r.total_ms, "prompt_n": r.prompt_n,
                              "cache_n": r.cache_n}
    if keeper:
        row = keeper_record(client, url, session, since)
        sample.update({"cache": row["cache"], "restored": row["restored"], "restore_ms": row["restore_ms"],
                       "save_ms": row["save_ms"]})
    return sample


def _start_targets(procs: Processes, shape: Shape, ctx: int) -> dict[str, str]:
    """llama-server alone and every slotkeeper target (each over a llama-server of its own); name -> URL. The same
    names get the same directories, so a second start finds what the first saved."""
    urls = {COLD: procs.backend("cold", cache_ram=0, ctx_per_slot=ctx).url}
    for name, b, ram in ttft_targets(shape):
        label = f"{'ram' if ram else 'disk'}-{b}"
        backend = procs.backend(f"{label}-behind", cache_ram=0, ctx_per_slot=ctx, ram_dir=ram)
        urls[name] = procs.slotkeeper(label, backend, "--block-tokens", str(b)).url
    return urls


def ttft_parts(config: BenchConfig, shape: Shape, model: Path, root: Path,
               samples: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`switch`'s workload: sessions round-robin on one slot, saving on the switch (no idle saves), every resumed turn
    a restore. Then `restart`'s: every llama-server and slotkeeper stopped and started again (a RAM dir starts
    empty), and each session's next turn restored from disk."""
    tokens = config.tokens[0]
    ctx = tokens + (config.rounds + 1) * 200 + 1024
    sessions = {f"w{tokens}-s{k}": opening(f"w{tokens}-s{k}", tokens, 3000 + k) for k in range(config.sessions)}
    switching: list[dict[str, Any]] = []
    restarting: list[dict[str, Any]] = []
    with httpx.Client(timeout=600) as client:
        with processes(root, model) as procs:
            urls = _start_targets(procs, shape, ctx)
            names = list(urls)
            for session, messages in sessions.items():
                for url in urls.values():
                    stream_chat(client, url, messages, session, config.answer_tokens)
            turn = 0
            for rnd in range(1, config.rounds + 1):
                for k, session in enumerate(list(sessions)):
                    sessions[session] = next_turn(sessions[session], 10_000 * rnd + 100 * k)
                    for name in rotated(names, turn):
                        sample = _ttft_sample(client, urls[name], name != COLD, sessions[session], session, config)
                        sample.update({"part": "ttft switch", "target": name, "round": rnd, "session": session,
                                       "turn": turn})
                        switching.append(sample)
                    turn += 1
        with processes(root, model) as procs:  # after the restart: the same slot and cache dirs, new processes
            urls = _start_targets(procs, shape, ctx)
            for k, session in enumerate(list(sessions)):
                sessions[session] = next_turn(sessions[session], 20_000 + k)
                for name in rotated(names, k):
                    sample = _ttft_sample(client, urls[name], name != COLD, sessions[session], session, config)
                    sample.update({"part": "ttft restart", "target": name, "session": session})
                    restarting.append(sample)
    samples.extend(switching + restarting)
    return ({"tokens": tokens, "sessions": config.sessions, "rounds": config.rounds,
             **_ttft_summary(switching, shape, "turn")},
            {"tokens": tokens, "sessions": config.sessions, **_ttft_summary(restarting, shape, "session")})


# -- part 4: per block size --------------------------------------------------------------------------------------------


def by_block_tokens(shape: Shape, shared: dict[str, Any], long: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for b in (TODAY, *shape.block_sizes):
        s, w = shared["modes"][mode_name(b)], long["modes"][mode_name(b)]
        out[mode_name(b)] = {
            "block_tokens": b, "disk_bytes": s["disk"]["total"], "disk_over_distinct_kv": s["disk_over_distinct_kv"],
            "disk_over_today": s["disk_over_today"],
            "written_bytes_later_turns": w["later_totals"]["written_bytes"],
            "written_over_new_kv_plus_tail": w["written_over_new_kv_plus_tail"],
            "written_over_today": w["written_over_today"],
            "uploaded_bytes_later_turns": w["later_totals"]["uploaded_bytes"],
            "uploaded_over_new_kv_plus_tail": w["uploaded_over_new_kv_plus_tail"],
            "uploaded_over_today": w["uploaded_over_today"],
        }
    return out


# -- the README section ---------------------------------------------------------------------------------------------
