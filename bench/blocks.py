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
tmpfs and only what the store keeps reaches the slot dir. Without one, the backend's whole file is written into the
slot dir first in both modes, and the block store cuts it there (not measured here)."""

from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

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
from slotkeeper.cache.blockstore import BLOCKS_DIR, TAIL_SUFFIX, BlockStore
from slotkeeper.cache.slotformat import parse_layout
from slotkeeper.cache.store import QUARANTINE_DIR
from slotkeeper.cache.tokens import read_tokens
from tests.support import ObjectStoreServer, Slotkeeper, words

TODAY = 0
COLD = "llama-server cram0"
# Parts 1 and 2: each mode's RAM dir holds copies of recent states up to this (slotkeeper's default is a quarter of
# the memory per slotkeeper; several run here at once). What reaches the slot dir does not depend on it.
RAM_BUDGET = "2G"
BUCKET_PREFIX = "bench"


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
    switching, restarting = ttft_parts(config, shape, model, root / "ttft", samples)
    timings["ttft_s"] = time.monotonic() - started
    return {"scenario": "blocks", "config": config.as_json(), "machine": machine(), "shape": asdict(shape),
            "modes": [mode_name(b) for b in modes], "ram_budget": RAM_BUDGET, "part_seconds": timings,
            "samples": samples,
            "summary": {"shared_prompt": shared, "long_conversation": long,
                        "ttft": {"switch": switching, "restart": restarting},
                        "by_block_tokens": by_block_tokens(shape, shared, long)}}


# -- measuring a slot dir ----------------------------------------------------------------------------------------------


def slot_dir_of(keeper: Slotkeeper) -> Path:
    """Where slotkeeper keeps its snapshots (the backend's dir without a RAM dir)."""
    if keeper.disk_slot_dir is not None:
        return keeper.disk_slot_dir
    assert keeper.upstream is not None
    return Path(keeper.upstream.slot_dir)


def slot_files(slot_dir: Path) -> dict[str, tuple[int, int, int]]:
    """Every file slotkeeper keeps in the slot dir: relative path -> (size, mtime ns, inode). Left out: quarantine/,
    the index, and temporaries being written or assembled (dot names: gone once a write is over)."""
    out: dict[str, tuple[int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(slot_dir):
        rel = Path(dirpath).relative_to(slot_dir)
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames if d != QUARANTINE_DIR]
        for name in filenames:
            if name.startswith(".") or ".sqlite3" in name:
                continue
            try:
                st = os.stat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            out[str(rel / name)] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def disk_usage(files: dict[str, tuple[int, int, int]]) -> dict[str, int]:
    usage = {"blocks": 0, "block_files": 0, "tails": 0, "whole_files": 0, "other": 0}
    for path, (size, _, _) in files.items():
        if path.startswith(BLOCKS_DIR + "/"):
            usage["blocks"] += size
            usage["block_files"] += 1
        elif path.endswith(TAIL_SUFFIX):
            usage["tails"] += size
        elif path.endswith(".bin"):
            usage["whole_files"] += size
        else:
            usage["other"] += size
    usage["total"] = usage["blocks"] + usage["tails"] + usage["whole_files"] + usage["other"]
    return usage


def written(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]]) -> dict[str, int]:
    """Bytes of the files new or changed between two listings, by kind."""
    changed = {p: v for p, v in after.items() if before.get(p) != v}
    usage = disk_usage(changed)
    usage["files"] = len(changed)
    return usage


def state_path(slot_dir: Path, row: dict[str, Any]) -> Path:
    """The file a saved state's tokens are read from: its tail (which starts as its file did) or its whole file."""
    name: str = row["file"] + TAIL_SUFFIX if row["stored_as"] == "blocks" else row["file"]
    return slot_dir / name


def state_tokens(slot_dir: Path, row: dict[str, Any]) -> np.ndarray:
    tokens = read_tokens(state_path(slot_dir, row))
    if tokens is None:
        raise RuntimeError(f"the tokens of {row['file']} cannot be read")
    return tokens


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def distinct_tokens(lists: list[np.ndarray]) -> int:
    """The number of distinct token prefixes over all lists: sorted, each adds its length past the common prefix with
    the one before it."""
    ordered = sorted(lists, key=lambda t: tuple(t.tolist()))
    total, previous = 0, np.empty(0, dtype=np.int32)
    for tokens in ordered:
        total += int(tokens.size) - common_prefix(previous, tokens)
        previous = tokens
    return total


def kv_bytes_per_token(slot_dir: Path, row: dict[str, Any], block_tokens: int, scratch: Path) -> int:
    """Bytes of attention KV per token, from the layout of one saved state's whole file (assembled from its blocks
    when it is kept as blocks)."""
    path = slot_dir / row["file"]
    assembled = None
    if row["stored_as"] == "blocks":
        scratch.mkdir(parents=True, exist_ok=True)
        assembled = path = scratch / row["file"]
        BlockStore(slot_dir, block_tokens).assemble(row["file"], path)
    try:
        layout = parse_layout(path)
    finally:
        if assembled is not None:
            assembled.unlink(missing_ok=True)
    if layout is None:
        raise RuntimeError(f"{row['file']}: not a slot file whose layout is known")
    return sum(r.n_outer * r.cell_bytes for r in layout.regions)


# -- slotkeeper's state ------------------------------------------------------------------------------------------------


def current(client: httpx.Client, url: str) -> dict[str, Any]:
    """GET /api/sessions/current (answers once the commits under way are done)."""
    found: dict[str, Any] = client.get(f"{url}/api/sessions/current").json()
    return found


def saved_rows(client: httpx.Client, url: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = client.get(f"{url}/api/sessions", params={"kind": "all"}).json()["sessions"]
    return rows


def wait_saved(client: httpx.Client, url: str, saves_before: int, timeout: float = 120) -> dict[str, Any]:
    """Wait until slotkeeper committed a save after `saves_before` and no slot holds unsaved changes (the idle save of
    the turn that just ended); returns /api/sessions/current."""
    deadline = time.monotonic() + timeout
    while True:
        now = current(client, url)
        if now["saves"] > saves_before and not any(s["dirty"] or s["busy"] for s in now["slots"]):
            return current(client, url)  # once more: every commit started is done
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: no save committed after {timeout:.0f} s: {now}")
        time.sleep(0.1)


def wait_idle(client: httpx.Client, url: str, timeout: float = 120) -> None:
    """Wait until no slot holds unsaved changes and every commit is done."""
    deadline = time.monotonic() + timeout
    while any(s["dirty"] or s["busy"] for s in current(client, url)["slots"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: a slot stayed dirty for {timeout:.0f} s")
        time.sleep(0.1)
    current(client, url)


# -- the shared tier ---------------------------------------------------------------------------------------------------

_METRIC = re.compile(r"^slotkeeper_shared_(uploads|failed_uploads|refused_older_uploads)_total(?:\{[^}]*\})? (\S+)$",
                     re.M)


def upload_counter(client: httpx.Client, url: str) -> float | None:
    """Uploads the shared tier finished (done, failed or refused), from /metrics; None when it says nothing of them."""
    text = client.get(f"{url}/metrics").text
    found = _METRIC.findall(text)
    return sum(float(v) for _, v in found) if found else None


def bucket_listing(store: ObjectStoreServer, prefix: str) -> dict[str, tuple[int, str]]:
    """key -> (size, ETag) of every object under `prefix`."""
    s3 = store.client()
    out: dict[str, tuple[int, str]] = {}
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"Bucket": store.bucket, "Prefix": prefix}
        if token:
            kwargs["ContinuationToken"] = token
        listed = s3.list_objects_v2(**kwargs)
        for o in listed.get("Contents", []):
            out[o["Key"]] = (int(o["Size"]), str(o["ETag"]))
        if not listed.get("IsTruncated"):
            return out
        token = listed["NextContinuationToken"]


def wait_uploads(client: httpx.Client, waits: dict[int, tuple[str, str, float | None, dict[str, tuple[int, str]]]],
                 store: ObjectStoreServer, timeout: float = 180) -> dict[int, dict[str, tuple[int, str]]]:
    """Wait until every mode's shared-tier uploads of the turn settled (`waits`: mode -> slotkeeper URL, bucket
    prefix, upload counter and listing before the turn): its listing changed and then stayed the same for a moment,
    after its upload counter moved (when /metrics has one); returns each mode's listing. A mode whose listing never
    changes is given up on at the timeout (0 bytes uploaded)."""
    deadline = time.monotonic() + timeout
    listings = {b: bucket_listing(store, prefix) for b, (_, prefix, _, _) in waits.items()}
    since = dict.fromkeys(waits, time.monotonic())
    pending = set(waits)
    while pending and time.monotonic() < deadline:
        time.sleep(0.2)
        for b in sorted(pending):
            url, prefix, counter_before, before = waits[b]
            counter = upload_counter(client, url)
            moved = counter is not None and counter_before is not None and counter > counter_before
            counted = counter is not None and counter_before is not None
            again = bucket_listing(store, prefix)
            if again != listings[b]:
                listings[b], since[b] = again, time.monotonic()
                continue
            # The counter moves once an upload is over; without it, a longer quiet spell is taken for the end.
            quiet = 0.4 if counted else 1.5
            if (moved or not counted) and listings[b] != before and \
                    time.monotonic() - since[b] >= quiet:
                pending.discard(b)
    return listings


def uploaded(before: dict[str, tuple[int, str]], after: dict[str, tuple[int, str]]) -> dict[str, int]:
    new = {k: v for k, v in after.items() if before.get(k) != v}
    return {"bytes": sum(size for size, _ in new.values()), "objects": len(new),
            "removed_objects": sum(1 for k in before if k not in after)}


# -- part 1: conversations on one shared system prompt -----------------------------------------------------------------


def start_modes(procs: Processes, modes: list[int], ctx: int, label: str, *extra: str) -> dict[int, Slotkeeper]:
    keepers = {}
    with httpx.Client(timeout=120) as client:
        for b in modes:
            name = f"{label}-{b}"
            backend = procs.backend(f"{name}-behind", cache_ram=0, ctx_per_slot=ctx, ram_dir=True)
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
                      samples: list[dict[str, Any]]) -> dict[str, Any]:
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
                                       store.url))
        messages = opening(session, shape.long_opening, 4242)
        previous: dict[int, np.ndarray] = {b: np.empty(0, dtype=np.int32) for b in modes}
        for turn in range(1, shape.long_turns + 1):
            if turn > 1:
                messages = next_turn(messages, 60_000 + 100 * turn)
            before: dict[int, tuple[int, dict[str, tuple[int, int, int]], float | None,
                                    dict[str, tuple[int, str]]]] = {}
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
                sample = {"part": "long", "mode": mode_name(b), "turn": turn, "ttft_ms": results[b].ttft_ms,
                          "prompt_n": results[b].prompt_n, "cache_n": results[b].cache_n,
                          "tokens": int(tokens.size), "new_tokens": int(tokens.size) - shared_n,
                          "state_bytes": row["bytes"], "stored_as": row["stored_as"], "tail_bytes": row["tail_bytes"],
                          "written": written(files, after_files), "uploaded": uploaded(listing, after_listing)}
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
    today = out["modes"][mode_name(TODAY)]["later_totals"]
    for entry in out["modes"].values():
        entry["written_over_today"] = ratio(entry["later_totals"]["written_bytes"], today["written_bytes"])
        entry["uploaded_over_today"] = ratio(entry["later_totals"]["uploaded_bytes"], today["uploaded_bytes"])
    return out


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


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def section(r: dict[str, Any]) -> list[str]:
    """bench/results/README.md's section (report.py)."""
    from bench.sections import _model

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
        "header, token list and the KV past its last full block). Totals over the resumed turns (the first writes "
        "the whole state in every mode). The bar for blocks: written / (new KV + tail) <= 1.2x.",
        "",
        "| mode | written per turn (median KiB) | written MiB | new KV + tail MiB | written / (new KV + tail) "
        "| written / today | uploaded MiB | uploaded / (new KV + tail) | uploaded / today |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, m in long["modes"].items():
        t = m["later_totals"]
        lines.append(f"| {mode} | {m['written_per_turn_bytes']['median'] / 1024:,.0f} | {_mib(t['written_bytes'])} "
                     f"| {_mib(t['new_kv_bytes'] + t['tail_bytes'])} | {m['written_over_new_kv_plus_tail']:.3f}x "
                     f"| {m['written_over_today']:.3f}x | {_mib(t['uploaded_bytes'])} "
                     f"| {m['uploaded_over_new_kv_plus_tail']:.3f}x | {m['uploaded_over_today']:.3f}x |")
    lines += [
        "",
        f"**Time to first token of resumed turns** (blocks of {shape['ttft_blocks']} tokens). *switch*: "
        f"{ttft['switch']['sessions']} sessions of {ttft['switch']['tokens']} tokens taking turns on one slot, "
        f"{ttft['switch']['rounds']} resumed turns each, saved on the switch; *restart*: "
        f"{ttft['restart']['sessions']} sessions primed, every process stopped and started again (a RAM dir starts "
        "empty), the next turn restored from disk. With a RAM dir the backend restores a RAM copy when one is "
        "there (blocks: kept after the save); without, a state kept as blocks is assembled into the slot dir "
        "first. llama-server alone prefills the turn cold.",
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
