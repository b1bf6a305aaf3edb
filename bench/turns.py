"""Scenario `turns`: where each millisecond of a turn goes, per kind of turn, slotkeeper against llama-server alone.

Each kind is a short sequence of requests (the setup) and one measured request, sent in the same order, with the
same text, to llama-server alone (`--cache-ram 0`, one slot) and to slotkeeper in front of another such llama-server
(its RAM dir on tmpfs, as slotkeeper sets up the server it starts, and its default idle saves); the two take turns
going first. Every round uses new text, so nothing of an earlier round is reused. The kinds:

- `cold`: a new conversation whose text nothing shares.
- `hot`: the next turn of the conversation the slot holds.
- `restore`: the next turn of a conversation another one took the slot from, after a pause in which slotkeeper
  saved that other one (idle save): on slotkeeper a restore; llama-server alone prefills it again.
- `switch`: the same, back to back: slotkeeper saves the other conversation first, then restores.
- `side`: an OpenWebUI title task right after its chat's turn.
- `side-next`: another chat's title task right after a title task (both begin with the same instructions).
- `new-system`: the first turn of a conversation on a long system prompt nothing has seen.

Per kind: the median time to first token (TTFT) of each target and of their difference per round; slotkeeper's own
record of the turn (planning, the save of the slot's occupant on the path, the restore); and beside each restore,
its physical floor: the time to read the restored state's bytes from tmpfs (where the RAM dir keeps them), measured
on this machine. A restore's added time is slotkeeper's TTFT minus llama-server alone's TTFT of the same request
in a slot that already holds the conversation (the `hot` kind of the same round), and again minus slotkeeper's own
`hot` turn of the round: the same backend process, whose speed then does not differ (separate llama-server processes
differ by up to about 15%), and slotkeeper's proxy in both.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    GRAMMAR,
    SHM,
    BenchConfig,
    machine,
    make_model,
    processes,
    state_size,
    stream_chat,
)
from tests.support import words

KINDS = ("cold", "hot", "restore", "switch", "side", "side-next", "new-system")
TARGETS = ("llama-server", "slotkeeper")
# Longer than slotkeeper's default --save-idle-seconds (2): the other conversation is on disk by then.
PAUSE_S = 2.5
TITLE = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n"
         "### Guidelines:\n- The title should clearly represent the main theme or subject of the conversation.\n"
         "- Use emojis that enhance understanding of the topic, but avoid quotation marks or special formatting.\n"
         "- Write the title in the chat's primary language; default to English if multilingual.\n"
         "- Prioritize accuracy over excessive creativity; keep it clear and simple.\n"
         "### Output:\nJSON format: { \"title\": \"your concise title here\" }\n")


@dataclass
class Turn:
    """One request: its messages and the session id it is sent with; a `task` is sent as OpenWebUI sends its
    tasks: not streamed (its time to first token is then its whole time)."""

    session: str
    messages: list[dict[str, str]]
    task: bool = False


@dataclass
class Case:
    kind: str
    setup: list[Turn]
    measured: Turn
    pause: float = 0.0


def conversation(tag: str, tokens: int, seed: int, system: str | None = None) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return [*head, {"role": "user", "content": f"({tag}) " + words(tokens, seed)}]


def follow(messages: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": words(30, seed)},
            {"role": "user", "content": words(60, seed + 1)}]


def task(template: str, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    history = "\n".join(f"{m['role'].upper()}: {m['content'][:1200]}" for m in messages if m["role"] != "system")
    return [{"role": "user", "content": f"{template}### Chat History:\n<chat_history>\n{history}\n</chat_history>"}]


def cases(round_: int, tokens: int) -> list[Case]:
    """This round's cases, every text new (seeded by the round and the case)."""
    base = 1000 * (round_ + 1)
    system = "You are a careful assistant for a coding team. " + words(tokens // 2, base + 7)
    x = conversation(f"x{round_}", tokens, base + 1, "You help with questions.")
    y = conversation(f"y{round_}", tokens, base + 2, "You help with questions.")
    r = conversation(f"r{round_}", tokens, base + 3, "You help with questions.")
    s = conversation(f"s{round_}", tokens, base + 4, "You help with questions.")
    t = conversation(f"t{round_}", tokens // 4, base + 5, "You help with questions.")
    t2 = conversation(f"u{round_}", tokens // 4, base + 8, "You help with questions.")
    t3 = conversation(f"v{round_}", tokens // 4, base + 9, "You help with questions.")
    return [
        Case("cold", [], Turn(f"cold-{round_}", conversation(f"c{round_}", tokens, base + 6))),
        Case("hot", [Turn(f"x-{round_}", x)], Turn(f"x-{round_}", follow(x, base + 11))),
        Case("restore", [Turn(f"r-{round_}", r), Turn(f"y-{round_}", y)], Turn(f"r-{round_}", follow(r, base + 21)),
             pause=PAUSE_S),
        Case("switch", [Turn(f"s-{round_}", s), Turn(f"y2-{round_}", follow(y, base + 31))],
             Turn(f"s-{round_}", follow(s, base + 32))),
        Case("side", [Turn(f"t-{round_}", t)], Turn(f"t-{round_}", task(TITLE, t), task=True)),
        Case("side-next", [Turn(f"t2-{round_}", t2), Turn(f"t2-{round_}", task(TITLE, t2), task=True)],
             Turn(f"t3-{round_}", task(TITLE, t3), task=True)),
        Case("new-system", [], Turn(f"sys-{round_}", conversation(f"n{round_}", 60, base + 51, system))),
    ]


def read_floor_ms(n_bytes: int, tries: int = 5) -> float:
    """The time to read `n_bytes` from tmpfs into memory on this machine: the least of a few reads of a file of that
    size in /dev/shm (or the temp dir)."""
    if n_bytes <= 0:
        return 0.0
    root = SHM if os.path.isdir(SHM) else None
    with tempfile.NamedTemporaryFile(dir=root, prefix="slotkeeper-bench-floor-") as handle:
        handle.write(os.urandom(n_bytes))
        handle.flush()
        buffer = bytearray(n_bytes)
        best = float("inf")
        for _ in range(tries):
            with open(handle.name, "rb", buffering=0) as reader:
                started = time.perf_counter()
                view = memoryview(buffer)
                while view:
                    got = reader.readinto(view)
                    if not got:
                        break
                    view = view[got:]
                best = min(best, (time.perf_counter() - started) * 1000)
    return best


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    model = make_model(root, config.model_size)
    tokens = 500 if config.small else config.tokens[0]
    rounds = 1 if config.small else max(config.rounds, 3)
    answer = config.answer_tokens
    samples: list[dict[str, Any]] = []
    # A connection per request, to both targets alike: a kept-alive one the server closed as idle would fail a
    # request it never saw.
    limits = httpx.Limits(max_keepalive_connections=0)
    with processes(root, model) as procs, httpx.Client(timeout=600, limits=limits) as client:
        ctx = 4 * tokens + 2048
        alone = procs.backend("turns-alone", 0, ctx)
        behind = procs.backend("turns-behind", 0, ctx, ram_dir=True)
        keeper = procs.slotkeeper("turns-slotkeeper", behind, "--save-idle-seconds", "2")
        probe = state_size(client, alone.url, {"messages": conversation("probe", tokens, 1)})
        client.post(f"{alone.url}/slots/0?action=erase").raise_for_status()
        urls: dict[str, str] = {"llama-server": alone.url, "slotkeeper": keeper.url}
        for round_ in range(rounds):
            order = TARGETS if round_ % 2 == 0 else TARGETS[::-1]
            for case in cases(round_, tokens):
                for target in order:
                    samples.append(_measure(client, target, urls[target], case, answer, round_,
                                            keeper.url if target == "slotkeeper" else None))
    return {"scenario": "turns", "config": config.as_json(), "machine": {**machine(), "loadavg_at_end": [
        round(x, 2) for x in os.getloadavg()]}, "tokens": tokens, "rounds": rounds, "state_probe": probe,
        "samples": samples, "summary": summarize(samples, probe["bytes_per_token"], read_floor_ms)}


def _measure(client: httpx.Client, target: str, url: str, case: Case, answer: int, round_: int,
             keeper: str | None) -> dict[str, Any]:
    for turn in case.setup:
        _send(client, url, turn, answer)
    if case.pause:
        time.sleep(case.pause)
    since = time.time()
    ttft, timings = _send(client, url, case.measured, answer)
    row: dict[str, Any] = {"target": target, "kind": case.kind, "round": round_, "ttft_ms": ttft,
                           "prompt_n": timings.get("prompt_n"), "cache_n": timings.get("cache_n"),
                           "prompt_ms": timings.get("prompt_ms")}
    if keeper is not None:
        record = _record(client, keeper, case.measured.session, since, row["prompt_n"])
        row.update({key: record.get(key) for key in ("cache", "why", "decide_ms", "save_ms", "restore_ms",
                                                     "restored", "lease_ms")})
    return row


def _send(client: httpx.Client, url: str, turn: Turn, answer: int) -> tuple[float, dict[str, Any]]:
    """One request: its time to first token (a task's whole time) and the backend's timings."""
    if not turn.task:
        result = stream_chat(client, url, turn.messages, turn.session, answer)
        return result.ttft_ms, {"prompt_n": result.prompt_n, "cache_n": result.cache_n, "prompt_ms": result.prompt_ms}
    started = time.perf_counter()
    response = client.post(f"{url}/v1/chat/completions", headers={"X-Session-Id": turn.session}, json={
        "messages": turn.messages, "max_tokens": answer, "stream": False, "temperature": 0, "grammar": GRAMMAR})
    response.raise_for_status()
    timings: dict[str, Any] = response.json().get("timings") or {}
    return (time.perf_counter() - started) * 1000, timings


def _record(client: httpx.Client, keeper: str, session: str, since: float, prompt_n: int | None,
            timeout: float = 5.0) -> dict[str, Any]:
    """slotkeeper's record of the measured request: the newest of its session since `since` with its prompt_n (the
    record of a setup request of the same session may be written after the measured one was sent)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = client.get(f"{keeper}/api/requests/recent", params={"limit": 10}).json()["requests"]
        for row in rows:
            if row["session"] == session and row["time"] >= since and row.get("prompt_n") == prompt_n:
                found: dict[str, Any] = row
                return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"slotkeeper has no record of the measured request of {session!r}")
        time.sleep(0.02)


def summarize(samples: list[dict[str, Any]], bytes_per_token: float,
              floor: Callable[[int], float]) -> dict[str, Any]:
    def of(target: str, kind: str) -> list[dict[str, Any]]:
        return [s for s in samples if s["target"] == target and s["kind"] == kind]

    kinds: dict[str, Any] = {}
    hot_alone = {s["round"]: s["ttft_ms"] for s in of("llama-server", "hot")}
    hot_own = {s["round"]: s["ttft_ms"] for s in of("slotkeeper", "hot")}
    for kind in KINDS:
        alone, keeper = of("llama-server", kind), of("slotkeeper", kind)
        if not alone or not keeper:
            continue
        by_round = {s["round"]: s for s in alone}
        added = [k["ttft_ms"] - by_round[k["round"]]["ttft_ms"] for k in keeper if k["round"] in by_round]
        row: dict[str, Any] = {
            "llama_server_ttft_ms": statistics.median(s["ttft_ms"] for s in alone),
            "slotkeeper_ttft_ms": statistics.median(s["ttft_ms"] for s in keeper),
            "added_ms": statistics.median(added),
            "llama_server_prompt_n": statistics.median(s["prompt_n"] for s in alone),
            "slotkeeper_prompt_n": statistics.median(s["prompt_n"] for s in keeper),
            "slotkeeper_cache": sorted({str(s.get("cache")) for s in keeper}),
        }
        for part in ("decide_ms", "save_ms", "restore_ms", "lease_ms"):
            row[part] = statistics.median(float(s.get(part) or 0.0) for s in keeper)
        # Besides the backend's prompt time: llama-server alone's own (its HTTP, the template, the first token's
        # decode), and slotkeeper's beyond its lease (the proxy: parsing, the dialect, the relay).
        row["llama_server_other_ms"] = statistics.median(s["ttft_ms"] - (s["prompt_ms"] or 0.0) for s in alone)
        row["slotkeeper_other_ms"] = statistics.median(
            s["ttft_ms"] - (s["prompt_ms"] or 0.0) - float(s.get("lease_ms") or 0.0) for s in keeper)
        row["prompt_ms_llama_server"] = statistics.median(s["prompt_ms"] or 0.0 for s in alone)
        row["prompt_ms_slotkeeper"] = statistics.median(s["prompt_ms"] or 0.0 for s in keeper)
        restored = [s for s in keeper if s.get("restored")]
        if restored:
            n_bytes = int(statistics.median(s["restored"] for s in restored) * bytes_per_token)
            row["restored_bytes"] = n_bytes
            row["read_floor_ms"] = floor(n_bytes)
            if kind in ("restore", "switch"):
                floor_ms = row["read_floor_ms"]
                for hot, added, ratio in ((hot_alone, "added_over_hot_ms", "added_over_floor"),
                                          (hot_own, "added_over_own_hot_ms", "own_added_over_floor")):
                    deltas = [s["ttft_ms"] - hot[s["round"]] for s in restored if s["round"] in hot]
                    if deltas:
                        row[added] = statistics.median(deltas)
                        row[ratio] = _times(row[added], floor_ms)
                # The backend's restore call alone (slotkeeper's `restore_ms`: the request and its answer).
                row["restore_call_over_floor"] = _times(row["restore_ms"], floor_ms)
        kinds[kind] = row
    return {"kinds": kinds}


def _times(ms: float, floor_ms: float) -> float | None:
    """`ms` as a multiple of the read floor (None when the floor is not positive)."""
    return ms / floor_ms if floor_ms > 0 else None
