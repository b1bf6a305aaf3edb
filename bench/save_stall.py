"""How long a slot save on llama-server's main loop stalls another slot's token stream.

llama-server runs save/restore tasks on its one main loop, between decode steps, so while slot 0's state is written
to disk slot 1 generates nothing. This measures the gaps between streamed chunks of slot 1 with and without saves
of a large slot 0 and writes bench/results/save_stall.json. Usage: python -m bench.save_stall [--tokens 6000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from tests.support import Backend, words


def stream_gaps(url: str, n_tokens: int, during: threading.Event | None = None) -> list[float]:
    """Milliseconds between SSE chunks of one streamed generation on slot 1."""
    body = {"messages": [{"role": "user", "content": "stream"}], "max_tokens": n_tokens, "stream": True,
            "ignore_eos": True, "id_slot": 1, "temperature": 0}
    gaps: list[float] = []
    with httpx.Client(timeout=300) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        last = None
        for _ in r.iter_raw():
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1000)
            last = now
            if during is not None and len(gaps) == 20:
                during.set()
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=6000, help="size of the state saved from slot 0")
    parser.add_argument("--saves", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = root / "tiny.gguf"
        write_tiny_model(model, TinyModelSpec())
        backend = Backend("binary", model, root / "slots", root / "backend.log", parallel=2, ctx_per_slot=8192,
                          cache_ram=0).start()
        try:
            with httpx.Client(base_url=backend.url, timeout=300) as client:
                client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": words(
                    args.tokens, 1)}], "max_tokens": 1, "id_slot": 0})
                baseline = stream_gaps(backend.url, 400)
                started = threading.Event()
                save_ms: list[float] = []

                def saver() -> None:
                    started.wait(60)
                    for i in range(args.saves):
                        t0 = time.perf_counter()
                        result = client.post("/slots/0?action=save", json={"filename": f"s{i}.bin"}).json()
                        save_ms.append((time.perf_counter() - t0) * 1000)
                        assert result["n_saved"] > 0
                        time.sleep(0.05)

                thread = threading.Thread(target=saver)
                thread.start()
                during = stream_gaps(backend.url, 400, started)
                thread.join()
                saved_bytes = (root / "slots" / "s0.bin").stat().st_size
        finally:
            backend.stop()
    result = {
        "state_tokens": args.tokens,
        "state_bytes": saved_bytes,
        "saves": args.saves,
        "save_wall_ms_median": statistics.median(save_ms),
        "gap_ms_median_baseline": statistics.median(baseline),
        "gap_ms_max_baseline": max(baseline),
        "gap_ms_median_during_saves": statistics.median(during),
        "gap_ms_max_during_saves": max(during),
        "gap_ms_p99_during_saves": sorted(during)[int(len(during) * 0.99) - 1],
    }
    out = Path(__file__).parent / "results" / "save_stall.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
