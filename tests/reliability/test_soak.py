"""A bounded soak over loopback: many concurrent clients, streaming and not, some hanging up mid-stream, on two
slots. Promise: no 5xx from slotkeeper, memory that stays put, and every snapshot consistent at the end.

CI runs 40 clients for 20 s; SLOTKEEPER_SOAK_CLIENTS=200 SLOTKEEPER_SOAK_SECONDS=60 runs the full size.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import xxhash

from tests.support import Backend, Slotkeeper, saved_state_bytes, snapshot_tokens, words

pytestmark = pytest.mark.backend
CLIENTS = int(os.environ.get("SLOTKEEPER_SOAK_CLIENTS", "40"))
SECONDS = float(os.environ.get("SLOTKEEPER_SOAK_SECONDS", "20"))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_soak(tmp_path: Path, tiny_model: Path) -> None:
    backend = Backend("binary", tiny_model, tmp_path / "slots", tmp_path / "backend.log", parallel=2,
                      ctx_per_slot=8192, cache_ram=0).start()
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log", backend,
                        extra_args=("--max-queue", str(CLIENTS * 2), "--save-idle-seconds", "0.5")).start()
    statuses: Counter[str] = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + SECONDS
    try:
        with httpx.Client(base_url=keeper.url) as warm:  # load every code path once before measuring memory
            warm.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "warm"}],
                                                    "max_tokens": 2})
        assert keeper.process is not None
        rss_start = _rss_mib(keeper.process.pid)

        def client(n: int) -> None:
            rng = random.Random(n)
            session = f"soak{n:03d}"
            messages = [{"role": "system", "content": f"MARKER-{session}-END " + words(200, n)}]
            with httpx.Client(base_url=keeper.url, timeout=120) as c:
                while time.monotonic() < deadline:
                    messages.append({"role": "user", "content": words(20, rng.randrange(10_000))})
                    # A sliding window, as chat front-ends do: the system message (with the marker) and the last 8.
                    window = [messages[0], *messages[1:][-8:]]
                    body = {"messages": window, "max_tokens": 4, "session_id": session}
                    mode = rng.choice(["unary", "stream", "hangup"])
                    try:
                        if mode == "unary":
                            status = c.post("/v1/chat/completions", json=body).status_code
                        else:
                            with c.stream("POST", "/v1/chat/completions",
                                          json={**body, "stream": True}) as response:
                                status = response.status_code
                                for i, _ in enumerate(response.iter_raw()):
                                    if mode == "hangup" and i == 1:
                                        break
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    with lock:
                        statuses[f"{mode}:{status}"] += 1

        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SECONDS + 300)
        rss_end = _rss_mib(keeper.process.pid)
        print(f"soak: {CLIENTS} clients, {SECONDS:.0f} s, {sum(statuses.values())} requests {dict(statuses)}, "
              f"RSS {rss_start:.0f} -> {rss_end:.0f} MiB")
        assert statuses and all(key.endswith(":200") for key in statuses), statuses
        assert rss_end - rss_start < 100, (rss_start, rss_end)

        keeper.stop()
        rows = keeper.index_rows()
        assert rows
        with httpx.Client(base_url=backend.url, timeout=30) as direct:
            for row in rows:
                data = saved_state_bytes(backend.slot_dir, row)  # its file, or its blocks put back together
                assert len(data) == row["n_bytes"] and xxhash.xxh3_128_hexdigest(data) == row["checksum"]
                path = backend.slot_dir / (row["filename"] + (".tail" if row["tail_bytes"] else ""))
                text = direct.post("/detokenize", json={"tokens": snapshot_tokens(path)}).json()["content"]
                if row["session_id"].startswith("soak"):
                    assert set(re.findall(r"MARKER-(soak\d+)-END", text)) == {row["session_id"]}
        assert backend.alive()
    finally:
        keeper.stop()
        backend.stop()
