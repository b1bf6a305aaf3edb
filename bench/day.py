"""Scenario `day`: a replayed day of mixed traffic on one llama-server slot (`--parallel 1`), with a restart halfway.

The traffic is one request list (bench/day_traffic.py), generated deterministically and sent unchanged to every target:

- OpenWebUI-like chats (streamed /v1/chat/completions) without chat ids, on one shared system prompt, as OpenWebUI
  sends them by default. A new chat's title task (non-streamed, one `### Task:` user message quoting the chat's
  first message) is sent from a thread about 30 ms before the chat's first turn; after a reply, tags and follow-up
  tasks now and then.
- Two coding agents without session ids on one shared agent system prompt, each history growing by a tool call and
  its result per turn, taking turns; a subagent (same system prompt, its own first user message) runs a few turns
  after the first agent's third. llama-server refuses a grammar next to `tools`, and every request carries the
  grammar, so these agents describe their tools in the system text (the generated model's ChatML template renders
  no `tools` field anyway).
- A Claude-Code-shaped client: streamed Anthropic /v1/messages with `metadata.user_id`, tools and reminder blocks.
  Every target gets it on /v1/messages, llama-server's own route for the direct ones.
- OpenWebUI under its default settings (bench/day_openwebui.py): two chats without chat id or system prompt, one
  opening with a pasted document, with their title, tags and follow-up tasks, spread over the day.

Eight conversations in all, more than the small RAM cache target holds. Halfway through, the target is stopped
and started again (slotkeeper too, its cache dir kept and its RAM dir emptied, so it restores from disk).

Reuse efficiency: each request's prompt is rendered (/apply-template, the Anthropic ones as their equivalent chat
messages) and tokenized (/tokenize) once on a scratch llama-server; S_i is the longest token prefix it shares with
any earlier request's prompt. reused = prompt tokens - what the backend prefilled (its /metrics counter, read around
every step and before each stop, so slotkeeper's warm-ups count), and efficiency = sum(reused) / sum(S)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import day_openwebui
from bench.common import BenchConfig, machine, make_model, percentile, prime, processes, state_size
from bench.day_traffic import Request, Step, shape, tokenize, traffic
from bench.messages import PrefillCounters, prefill_counters
from slotkeeper.upstream.launcher import free_port
from tests.support import Backend, Slotkeeper, wait_healthy

TARGETS = ("llama-server cram0", "llama-server default", "llama-server small-ram", "slotkeeper", "slotkeeper per user",
           "hearth-llm")
# `slotkeeper per user`: users kept apart (docs/domains.md), as behind a shared OpenWebUI with forwarded user headers,
# each conversation of the day its own user (the most keeping apart can cost: nothing of one conversation serves
# another). Left out of the CI size.
PER_USER_KEY = "bench-day-key-0123456789"
PER_USER_HEADER = "X-OpenWebUI-User-Id"
KINDS = ("chat", "title", "tags", "follow_ups", "agent", "subagent", "claude-code")
# llama-server's own default --cache-ram (MiB); the Backend helper always passes the option, so it is given.
DEFAULT_CACHE_RAM = 8192
# The RAM cache of the small-ram target holds about this many of the day's conversation states.
SMALL_RAM_STATES = 2
HEARTH_ENV = "SLOTKEEPER_BENCH_HEARTH"
# A comma-separated subset of TARGETS to run (all when unset), for tracing one target's turns.
TARGETS_ENV = "SLOTKEEPER_BENCH_DAY_TARGETS"
HEARTH_DEFAULT = Path("/tmp/hearth-venv/bin/hearth")
TITLE_LEAD_S = 0.03
TASK_KINDS = ("title", "tags", "follow_ups")


@dataclass
class Hearth:
    """hearth-llm's proxy (`hearth serve --upstream`) in a child process, from its own venv."""

    binary: Path
    upstream: Backend
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Hearth:
        argv = [str(self.binary), "serve", "--upstream", self.upstream.url, "--port", str(self.port),
                "--cache-dir", str(self.upstream.slot_dir)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(self.url, self.process, 60)
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def hearth_binary() -> Path | None:
    path = Path(os.environ.get(HEARTH_ENV, str(HEARTH_DEFAULT)))
    return path if path.is_file() and os.access(path, os.X_OK) else None


@dataclass
class Sent:
    status: int
    ttft_ms: float
    total_ms: float
    reported_prompt: int  # prompt tokens the response reports (evaluated + from cache), -1 if none
    error: str = ""
    text: str = ""  # the answer's text, which a client that sends its answers back puts in the next turn


def send(client: httpx.Client, url: str, r: Request, per_user: bool = False) -> Sent:
    try:
        return _send(client, url, r, per_user)
    except httpx.RemoteProtocolError:  # a pooled keep-alive connection the server had closed: once more
        return _send(client, url, r, per_user)


def user_headers(r: Request) -> dict[str, str]:
    """What a front end that keeps users apart sends with `r`: its key, and the request's user (its conversation)."""
    return {"Authorization": f"Bearer {PER_USER_KEY}",
            PER_USER_HEADER: "".join(c if c.isalnum() or c in "-_." else "_" for c in r.conversation)}


def _send(client: httpx.Client, url: str, r: Request, per_user: bool = False) -> Sent:
    path = "/v1/messages" if r.api == "messages" else "/v1/chat/completions"
    headers = {**r.headers, **(user_headers(r) if per_user else {})}
    t0 = time.perf_counter()
    if not r.body.get("stream"):
        response = client.post(f"{url}{path}", json=r.body, headers=headers)
        total = (time.perf_counter() - t0) * 1000
        if response.status_code != 200:
            return Sent(response.status_code, total, total, -1, response.text[:300])
        data = response.json()
        t = data.get("timings") or {}
        text = str((data.get("choices") or [{}])[0].get("message", {}).get("content") or "")
        return Sent(200, total, total, int(t.get("prompt_n", -1)) + int(t.get("cache_n", 0)), text=text)
    first: float | None = None
    reported = -1
    parts: list[str] = []
    with client.stream("POST", f"{url}{path}", json=r.body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            total = (time.perf_counter() - t0) * 1000
            return Sent(response.status_code, total, total, -1, response.text[:300])
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if r.api == "messages":
                if event.get("type") == "content_block_delta":
                    first = first or time.perf_counter()
                    parts.append(str(event.get("delta", {}).get("text") or ""))
                usage = event.get("usage") or (event.get("message") or {}).get("usage") or {}
                n = int(usage.get("input_tokens", 0)) + int(usage.get("cache_read_input_tokens", 0))
                if n > 0:
                    reported = n
                continue
            if "timings" in event:
                reported = int(event["timings"].get("prompt_n", -1)) + int(event["timings"].get("cache_n", 0))
            content = "".join(str(c.get("delta", {}).get("content") or "") for c in event.get("choices", []))
            if content:
                first = first or time.perf_counter()
                parts.append(content)
    end = time.perf_counter()
    return Sent(200, ((first or end) - t0) * 1000, (end - t0) * 1000, reported, text="".join(parts))


class Target:
    """One target's processes: the llama-server whose counters are read, and what the client talks to."""

    def __init__(self, name: str, backend: Backend, front: Slotkeeper | Hearth | None) -> None:
        self.name = name
        self.backend = backend
        self.front = front

    @property
    def url(self) -> str:
        return self.front.url if self.front is not None else self.backend.url

    def counters(self, client: httpx.Client) -> PrefillCounters:
        return prefill_counters(client, self.backend.url)

    def stop(self) -> None:
        if self.front is not None:
            self.front.stop()  # first: slotkeeper saves its changed slot on SIGTERM
        self.backend.stop()

    def start(self, client: httpx.Client) -> PrefillCounters:
        """Start (again): the backend, primed, its counters read, then the proxy in front of it."""
        if not self.backend.alive():
            if isinstance(self.front, Slotkeeper) and self.front.disk_slot_dir is not None:
                # The RAM dir starts empty, as after a reboot: slotkeeper restores from its slot dir on disk.
                for child in self.backend.slot_dir.iterdir():
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            self.backend.start()
        prime(client, self.backend.url)
        base = self.counters(client)
        if self.front is not None and (self.front.process is None or self.front.process.poll() is not None):
            self.front.start()
        return base


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    model = make_model(root, config.model_size)
    steps = traffic(config)
    requests = [r for step in steps for r in step]
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        scratch = procs.backend("day-scratch", 0, 32768, extra_args=("--metrics",))
        tokenize(client, scratch.url, steps)
        longest = max(requests, key=lambda r: len(r.tokens))
        probe = state_size(client, scratch.url, longest.render)
        scratch.stop()
    finals: dict[str, int] = {}
    for r in requests:
        if r.kind not in TASK_KINDS:
            finals[r.conversation] = len(r.tokens)
    state_mib = [n * probe["bytes_per_token"] / 2**20 for n in finals.values()]
    small_ram = max(1, math.ceil(SMALL_RAM_STATES * sum(state_mib) / len(state_mib)))
    ctx = max(len(r.tokens) for r in requests) + 256
    # hearth-llm is another project's proxy, installed by hand: left out of the CI size.
    hearth = None if config.small else hearth_binary()
    chosen = [t.strip() for t in os.environ.get(TARGETS_ENV, "").split(",") if t.strip()] or list(TARGETS)
    targets = [t for t in TARGETS if (t != "hearth-llm" or hearth is not None)
               and (t != "slotkeeper per user" or not config.small) and t in chosen]
    half = len(steps) // 2
    samples: list[dict[str, Any]] = []
    totals: dict[str, dict[str, Any]] = {}
    for name in targets:
        rows, total = run_target(config, root / name.replace(" ", "-"), model, name, steps, half, ctx, small_ram,
                                 hearth)
        samples += rows
        totals[name] = total
    summary = summarize(requests, samples, totals, targets)
    skipped = {} if hearth is not None else {"hearth-llm": "left out of the CI size" if config.small else
                                             f"not installed ({HEARTH_ENV} or {HEARTH_DEFAULT})"}
    notes = [] if hearth is None else [
        "hearth-llm keys a snapshot on the request's messages plus the answer it generated; this replay sends the "
        "same fixed assistant text to every target, not what the model answered, so a later turn never matches a "
        "hearth snapshot (a real client that sends the answers back would)."]
    return {
        "scenario": "day", "config": config.as_json(), "machine": machine(), "targets": targets,
        "skipped_targets": skipped, "order": targets, "notes": notes,
        "traffic": {
            "shape": {**shape(config).__dict__, "answer_tokens": list(shape(config).answer_tokens)},
            "steps": len(steps), "restart_after_step": half,
            "requests": {kind: sum(1 for r in requests if r.kind == kind) for kind in KINDS},
            "conversations": sorted(finals), "final_prompt_tokens": finals,
            "prompt_tokens": sum(len(r.tokens) for r in requests), "shared_prefix_tokens": sum(r.shared for r in
                                                                                                requests),
            "claude_code_route": "/v1/messages on every target (llama-server's own for the direct ones)",
        },
        "state_probe": {**probe, "conversation_state_mib": {k: round(v, 2) for k, v in zip(finals, state_mib,
                                                                                            strict=True)},
                        "small_ram_mib": small_ram, "small_ram_states": SMALL_RAM_STATES,
                        "default_cache_ram_mib": DEFAULT_CACHE_RAM, "ctx_per_slot": ctx},
        "samples": samples, "summary": summary,
    }


def run_target(config: BenchConfig, root: Path, model: Path, name: str, steps: list[Step], half: int, ctx: int,
               small_ram: int, hearth: Path | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    metrics = ("--metrics",)
    rows: list[dict[str, Any]] = []
    with processes(root, model) as procs:
        client = httpx.Client(timeout=600)
        procs.stack.callback(lambda: client.close())
        label = name.replace(" ", "-")
        front: Slotkeeper | Hearth | None = None
        if name.startswith("slotkeeper"):
            backend = procs.backend(f"{label}-behind", 0, ctx, extra_args=metrics, ram_dir=True)
            # slotkeeper's own default idle save (the test helper turns it off)
            extra: tuple[str, ...] = ("--save-idle-seconds", "2")
            if name == "slotkeeper per user":
                keys = root / "keys.toml"
                keys.parent.mkdir(parents=True, exist_ok=True)
                keys.write_text(f'user_header = "{PER_USER_HEADER}"\n[api_keys]\nfront = "{PER_USER_KEY}"\n')
                extra += ("--config", str(keys))
            front = Slotkeeper(root / label / "cache", root / f"{label}.log", backend, extra,
                               disk_slot_dir=root / label / "slots")
        elif name == "hearth-llm":
            assert hearth is not None
            backend = procs.backend(f"{label}-behind", 0, ctx, extra_args=metrics)
            front = Hearth(hearth, backend, root / f"{label}.log")
        else:
            cache_ram = {"llama-server cram0": 0, "llama-server default": DEFAULT_CACHE_RAM,
                         "llama-server small-ram": small_ram}[name]
            backend = procs.backend(label, cache_ram, ctx, extra_args=metrics)
        if front is not None:
            procs.stack.callback(front.stop)
        target = Target(name, backend, front)
        base = target.start(client)
        done = PrefillCounters(0, 0, 0.0)  # counted before the restart (the counters start again at 0)
        wall = 0.0
        restart_s = 0.0
        for index, step in enumerate(steps):
            if index == half:
                done = _plus(done, target.counters(client) - base)
                t0 = time.monotonic()
                target.stop()
                client.close()
                client = httpx.Client(timeout=600)
                base = target.start(client)
                restart_s = time.monotonic() - t0
            counted = target.counters(client)
            t0 = time.perf_counter()
            results = run_step(client, target.url, step, per_user=name == "slotkeeper per user")
            wall += time.perf_counter() - t0
            cost = target.counters(client) - counted
            for r, sent in zip(step, results, strict=True):
                rows.append({"target": name, "step": index, "kind": r.kind, "conversation": r.conversation,
                             "status": sent.status, "ttft_ms": sent.ttft_ms, "total_ms": sent.total_ms,
                             "prompt_tokens": len(r.tokens), "shared_prefix": r.shared,
                             "reported_prompt_tokens": sent.reported_prompt, "step_prefilled": cost.prefilled,
                             "step_kinds": "+".join(x.kind for x in step), "after_restart": index >= half,
                             **({"error": sent.error} if sent.error else {})})
        prefilled = _plus(done, target.counters(client) - base)
        client.close()
    return rows, {"prefilled": prefilled.prefilled, "cached": prefilled.reused,
                  "prompt_seconds": prefilled.seconds, "wall_seconds": wall, "restart_seconds": restart_s}


def _plus(a: PrefillCounters, b: PrefillCounters) -> PrefillCounters:
    return PrefillCounters(a.prefilled + b.prefilled, a.reused + b.reused, a.seconds + b.seconds)


def run_step(client: httpx.Client, url: str, step: Step, per_user: bool = False) -> list[Sent]:
    if len(step) == 1:
        return [send(client, url, step[0], per_user)]
    # a new chat: its title task from a thread, the chat's first turn 30 ms later
    out: dict[int, Sent] = {}

    def worker() -> None:
        out[0] = send(client, url, step[0], per_user)

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(TITLE_LEAD_S)
    out[1] = send(client, url, step[1], per_user)
    thread.join()
    return [out[0], out[1]]


def ttft_stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95)} if values else {"n": 0}


def summarize(requests: list[Request], samples: list[dict[str, Any]], totals: dict[str, dict[str, Any]],
              targets: list[str]) -> dict[str, Any]:
    prompt = sum(len(r.tokens) for r in requests)
    shared = sum(r.shared for r in requests)
    out: dict[str, Any] = {}
    for name in targets:
        mine = [s for s in samples if s["target"] == name]
        t = totals[name]
        reused = prompt - t["prefilled"]
        by_kind: dict[str, dict[str, Any]] = {}
        for kinds in sorted({s["step_kinds"] for s in mine}):
            rows = [s for s in mine if s["step_kinds"] == kinds]
            steps = {s["step"]: s["step_prefilled"] for s in rows}
            step_prompt = sum(s["prompt_tokens"] for s in rows)
            step_shared = sum(s["shared_prefix"] for s in rows)
            step_prefilled = sum(steps.values())
            by_kind[kinds] = {"steps": len(steps), "prompt_tokens": step_prompt, "shared_prefix_tokens": step_shared,
                              "prefilled": step_prefilled,
                              "efficiency": (step_prompt - step_prefilled) / step_shared if step_shared else None}
        check = [s for s in mine if s["reported_prompt_tokens"] >= 0]
        # A resumed turn: a conversation's request after its first one (the tasks are not conversations).
        seen: set[str] = set()
        resumed: list[float] = []
        for s in mine:
            if s["kind"] in TASK_KINDS:
                continue
            if s["conversation"] in seen and s["status"] == 200:
                resumed.append(s["ttft_ms"])
            seen.add(s["conversation"])
        out[name] = {
            "requests": len(mine),
            "errors": sum(1 for s in mine if s["status"] != 200),
            "prompt_tokens": prompt, "shared_prefix_tokens": shared,
            "prefilled": t["prefilled"], "reused": reused,
            "efficiency": reused / shared if shared else None,
            "prompt_seconds": t["prompt_seconds"], "wall_seconds": t["wall_seconds"],
            "restart_seconds": t["restart_seconds"],
            "ttft_ms": {kind: ttft_stats([s["ttft_ms"] for s in mine if s["kind"] == kind and s["status"] == 200])
                        for kind in KINDS},
            "resumed_ttft_ms": ttft_stats(resumed),
            "by_step_kind": by_kind,
            "prompt_check": {"reported": len(check),
                             "mismatched": sum(1 for s in check if s["reported_prompt_tokens"] != s["prompt_tokens"])},
            **day_openwebui.summary(mine),
        }
    return {"targets": out}
