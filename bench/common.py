"""Shared pieces of the benchmark runner: configuration, process lifetimes, one timed streamed chat request, and
summary statistics."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from tests.support import Backend, Slotkeeper, llama_server_binary

MODEL_SPECS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "medium": TinyModelSpec(n_embd=1024, n_layer=8, n_head=16, n_head_kv=8, n_ff=2816),
    # The tiny recurrent and hybrid models (docs/architectures.md), for the scenarios whose state handling differs
    # there (`first`: the system part's warm-up on a model that rolls back only to checkpoints).
    "mamba": TinyModelSpec(arch="mamba"),
    "jamba": TinyModelSpec(arch="jamba"),
}


@dataclass(frozen=True)
class BenchConfig:
    """Everything a scenario needs to know; stored verbatim in each result file."""

    model_size: str = "tiny"
    sessions: int = 4
    tokens: tuple[int, ...] = (2000,)
    rounds: int = 3
    answer_tokens: int = 8
    overhead_requests: int = 40
    overhead_answer_tokens: int = 200
    small: bool = False
    # system: new conversations on one shared system prompt (with tools) of about this many tokens
    system_conversations: int = 6
    system_tokens: int = 4000
    # agent: coding-agent turns and chat turns interleaved, on each of these slot counts
    agent_turns: int = 8
    chat_turns: int = 4
    agent_slots: tuple[int, ...] = (1,)
    # scale: snapshots in the index
    scale_snapshots: int = 10_000
    threads: int = 2
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["tokens"] = list(self.tokens)
        data["agent_slots"] = list(self.agent_slots)
        return data


# Random weights mostly pick byte tokens that are not valid UTF-8 on their own, and llama-server streams nothing for
# them; this grammar keeps every generated token a plain letter, so each one arrives as its own content chunk and the
# first one marks the time to first token. Every target is sent the same grammar.
GRAMMAR = "root ::= [a-z ]+"
# Where the RAM dirs of slotkeeper's backends go, as slotkeeper's own default does.
SHM = "/dev/shm"


@dataclass
class StreamResult:
    """One streamed chat completion as the client saw it."""

    ttft_ms: float
    total_ms: float
    content_chunks: int
    prompt_n: int
    cache_n: int
    predicted_n: int
    cache_header: str | None
    # What the backend says it spent evaluating the prompt (timings.prompt_ms; -1 when it sent no timings).
    prompt_ms: float = -1.0

    @property
    def chunks_per_second(self) -> float:
        span = (self.total_ms - self.ttft_ms) / 1000
        return (self.content_chunks - 1) / span if span > 0 and self.content_chunks > 1 else 0.0


def stream_chat(client: httpx.Client, url: str, messages: list[dict[str, str]], session: str,
                max_tokens: int, header: str = "X-Session-Id", model: str | None = None,
                extra: dict[str, Any] | None = None) -> StreamResult:
    """One timed request, the session id in `header` (and `model` in the body, when given); retried once if a
    pooled keep-alive connection turns out to be closed by the server before it answered (the request was then
    never processed). `extra`: more body fields."""
    try:
        return _stream_chat(client, url, messages, session, max_tokens, header, model, extra)
    except httpx.RemoteProtocolError:
        return _stream_chat(client, url, messages, session, max_tokens, header, model, extra)


def _stream_chat(client: httpx.Client, url: str, messages: list[dict[str, str]], session: str,
                 max_tokens: int, header: str, model: str | None = None,
                 extra: dict[str, Any] | None = None) -> StreamResult:
    """POST a streamed /v1/chat/completions and time the first content chunk and the end of the stream."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                            "temperature": 0, "stream_options": {"include_usage": True}, "grammar": GRAMMAR}
    if model is not None:
        body["model"] = model
    body.update(extra or {})
    timings: dict[str, Any] = {}
    chunks = 0
    ttft: float | None = None
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                       headers={header: session}) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
        header = response.headers.get("x-slotkeeper-cache")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "timings" in chunk:
                timings = chunk["timings"]
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter()
    end = time.perf_counter()
    return StreamResult(
        ttft_ms=((ttft if ttft is not None else end) - t0) * 1000, total_ms=(end - t0) * 1000,
        content_chunks=chunks, prompt_n=int(timings.get("prompt_n", -1)), cache_n=int(timings.get("cache_n", -1)),
        predicted_n=int(timings.get("predicted_n", -1)), cache_header=header,
        prompt_ms=float(timings.get("prompt_ms", -1.0)),
    )


def prime(client: httpx.Client, backend_url: str) -> None:
    """One tiny request straight to a freshly started llama-server, so that costs paid once per process (faulting
    the model's pages in, first graph allocations) do not land on the first measured request."""
    response = client.post(f"{backend_url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0})
    response.raise_for_status()


def make_model(root: Path, size: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{size}.gguf"
    if not path.exists():
        write_tiny_model(path, MODEL_SPECS[size])
    return path


class Processes:
    """Backends and slotkeepers started for one scenario, all stopped when its `with` block ends."""

    def __init__(self, root: Path, model: Path, stack: ExitStack) -> None:
        self.root = root
        self.model = model
        self.stack = stack
        self._ram_dirs: set[Path] = set()

    def backend(self, name: str, cache_ram: int, ctx_per_slot: int, parallel: int = 1,
                extra_args: tuple[str, ...] = (), ram_dir: bool = False) -> Backend:
        """A llama-server; with `ram_dir`, one set up as slotkeeper sets up the server it starts itself: its
        --slot-save-path is a fresh directory on tmpfs (removed when the scenario ends), which the slotkeeper put
        in front of it takes as its RAM dir (cache/ramdir.py)."""
        slot_dir = self.root / name / "slots"
        if ram_dir:
            slot_dir = Path(tempfile.mkdtemp(prefix=f"slotkeeper-bench-{name}-", dir=SHM))
            self.stack.callback(shutil.rmtree, slot_dir, True)
            self._ram_dirs.add(slot_dir)
        backend = Backend("binary", self.model, slot_dir, self.root / f"{name}.log",
                          parallel=parallel, ctx_per_slot=ctx_per_slot, cache_ram=cache_ram, extra_args=extra_args)
        self.stack.callback(backend.stop)
        (self.root / name).mkdir(parents=True, exist_ok=True)
        return backend.start()

    def slotkeeper(self, name: str, backend: Backend, *extra_args: str, module: str = "slotkeeper.cli") -> Slotkeeper:
        """slotkeeper in front of `backend` (run as `python -m module`); its snapshots are kept in <name>/slots when
        the backend saves into a RAM dir, else in the backend's own slot dir."""
        disk = self.root / name / "slots" if backend.slot_dir in self._ram_dirs else None
        keeper = Slotkeeper(self.root / name / "cache", self.root / f"{name}.log", backend, extra_args,
                            disk_slot_dir=disk, module=module)
        self.stack.callback(keeper.stop)
        return keeper.start()


@contextmanager
def processes(root: Path, model: Path) -> Iterator[Processes]:
    with ExitStack() as stack:
        yield Processes(root, model, stack)


def keeper_record(client: httpx.Client, keeper_url: str, session: str, since: float,
                  timeout: float = 5.0) -> dict[str, Any]:
    """slotkeeper's own record of the newest request of `session` that started after `since` (a time.time()); the
    record is written just after the response ends, so it is polled for."""
    deadline = time.monotonic() + timeout
    while True:
        rows = client.get(f"{keeper_url}/api/requests/recent", params={"limit": 5}).json()["requests"]
        for row in rows:
            if row["session"] == session and row["time"] >= since:
                found: dict[str, Any] = row
                return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"slotkeeper has no record of the request of {session!r}")
        time.sleep(0.02)


def state_size(client: httpx.Client, backend_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A slot state's size per token, measured: prefill `body` (a chat request) into slot 0 and save the slot."""
    client.post(f"{backend_url}/v1/chat/completions",
                json={**body, "max_tokens": 1, "temperature": 0}).raise_for_status()
    saved = client.post(f"{backend_url}/slots/0?action=save", json={"filename": "probe.bin"})
    saved.raise_for_status()
    data = saved.json()
    return {"tokens": int(data["n_saved"]), "bytes": int(data["n_written"]),
            "bytes_per_token": int(data["n_written"]) / int(data["n_saved"])}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def describe(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": statistics.median(values), "mean": statistics.fmean(values),
            "min": min(values), "max": max(values), "p99": percentile(values, 99)}


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else float("inf")


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_at_start": [round(x, 2) for x in load], "llama_server": str(llama_server_binary())}


def write_result(out: Path, scenario: str, result: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{scenario}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
