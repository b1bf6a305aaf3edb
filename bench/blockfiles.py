"""What the `blocks` scenario measures in a slot dir and a bucket: the files a state is kept in and their bytes, the
tokens of saved states and how many are distinct, the KV bytes per token, and the waits for saves and uploads to
settle. Helpers of bench/blocks.py."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from slotkeeper.cache.blockstore import BLOCKS_DIR, TAIL_SUFFIX, BlockStore
from slotkeeper.cache.slotformat import parse_layout
from slotkeeper.cache.store import QUARANTINE_DIR
from slotkeeper.cache.tokens import read_tokens
from tests.support import ObjectStoreServer, Slotkeeper


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


_SAVE_BYTES = re.compile(r"^slotkeeper_save_bytes_sum(?:\{[^}]*\})? (\S+)$", re.M)


def backend_save_bytes(client: httpx.Client, url: str) -> int:
    """The bytes of every file the backend wrote for a committed save (slotkeeper's save-size histogram's sum), from
    /metrics."""
    return int(sum(float(v) for v in _SAVE_BYTES.findall(client.get(f"{url}/metrics").text)))


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
