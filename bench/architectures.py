"""What a restore gives per architecture and llama.cpp build: `python -m bench.architectures [--out DIR]`.

For each tiny model (dense llama, recurrent mamba, hybrid jamba and lfm2, sliding-window gemma3) on each backend
(the llama-server binary, b11434; the embedded xllamacpp server, b11549), through slotkeeper with `--parallel 1
--cache-ram 0`: a switch, an edited last message (a diverging prompt), a fork, a new chat on a known system prompt,
and a restart. Each row gives how the slot got its state, the backend's `cache_n`, and the tokens the request's
prompt shares exactly with the state it could have started from (both prompts rendered and tokenized by the
backend). Writes `<out>/architectures.json` and prints the table of docs/architectures.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx

from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from tests.support import Backend, Slotkeeper, words

ARCHS = ("llama", "mamba", "jamba", "lfm2", "gemma3")
KINDS = ("binary", "embedded")
SCENARIOS = ("switch", "edited", "fork", "system", "restart")


class _Run:
    def __init__(self, keeper: Slotkeeper, backend: Backend) -> None:
        self.keeper, self.backend = keeper, backend
        self.client = httpx.Client(base_url=keeper.url, timeout=300)
        self.direct = httpx.Client(base_url=backend.url, timeout=300)

    def chat(self, session: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        response = self.client.post("/v1/chat/completions", headers={"X-Session-Id": session}, json={
            "messages": messages, "max_tokens": 24, "temperature": 0})
        response.raise_for_status()
        t = response.json()["timings"]
        return {"cache": response.headers["x-slotkeeper-cache"], "cache_n": t["cache_n"], "prompt_n": t["prompt_n"]}

    def tokens(self, messages: list[dict[str, str]]) -> list[int]:
        prompt = self.direct.post("/apply-template", json={"messages": messages}).json()["prompt"]
        found: list[int] = self.direct.post("/tokenize", json={"content": prompt, "add_special": True,
                                                               "parse_special": True}).json()["tokens"]
        return found

    def shared(self, request: list[dict[str, str]], before: list[dict[str, str]]) -> int:
        a, b = self.tokens(request), self.tokens(before)
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n

    def close(self) -> None:
        self.client.close()
        self.direct.close()


def _conversation(system: str, seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": words(200, seed)}]


def _next(messages: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """The client's next turn: a short answer (not what was generated, as a reasoning model's client sends), a
    new question."""
    return [*messages, {"role": "assistant", "content": "yes no"}, {"role": "user", "content": words(30, seed)}]


def measure(arch: str, kind: str, root: Path) -> dict[str, Any]:
    model = root / f"{arch}.gguf"
    if not model.exists():
        write_tiny_model(model, TinyModelSpec(arch=arch))  # type: ignore[arg-type]
    work = root / f"{arch}-{kind}"
    backend = Backend(kind, model, work / "slots", work / "backend.log", cache_ram=0).start()
    keeper = Slotkeeper(work / "cache", work / "slotkeeper.log", backend).start()
    run = _Run(keeper, backend)
    rows: dict[str, Any] = {}
    try:
        system_a = "You are the first assistant. " + words(300, 3)
        a = _conversation(system_a, 11)
        b = _conversation("You are the second assistant. " + words(300, 4), 12)
        run.chat("a", a)
        run.chat("b", b)
        # switch: A comes back with its next turn
        a2 = _next(a, 21)
        rows["switch"] = {**run.chat("a", a2), "shares": run.shared(a2, a)}
        run.chat("b", _next(b, 22))
        # edited: A's next turn with its last question rewritten
        edited = [*a2[:-1], {"role": "user", "content": words(30, 77)}]
        rows["edited"] = {**run.chat("a", edited), "shares": run.shared(edited, a2)}
        run.chat("b", _next(b, 23))
        # fork: another session, A's whole last prompt, another answer, a new question
        fork = _next(edited, 24)
        rows["fork"] = {**run.chat("fork", fork), "shares": run.shared(fork, edited)}
        run.chat("b", _next(b, 25))
        # system: a new chat on A's system prompt
        newcomer = _conversation(system_a, 50)
        rows["system"] = {**run.chat("new", newcomer), "shares": run.shared(newcomer, a)}
        # restart: both processes stopped and started again; A's next turn
        keeper.stop()
        backend.stop()
        backend.start()
        keeper.start()
        after = _next(edited, 26)
        rows["restart"] = {**run.chat("a", after), "shares": run.shared(after, edited)}
        restoring = run.client.get("/api/sessions/current").json()["restoring"]
    finally:
        run.close()
        keeper.stop()
        backend.stop()
    return {"arch": arch, "backend": kind, "kind": restoring["kind"], "strategy": restoring["strategy"],
            "checkpoints_in_file": restoring["checkpoints_in_file"], "scenarios": rows}


def table(results: list[dict[str, Any]]) -> str:
    head = "| model | build | strategy | " + " | ".join(SCENARIOS) + " |\n"
    head += "|---|---|---|" + "---:|" * len(SCENARIOS) + "\n"
    build = {"binary": "b11434", "embedded": "b11549"}
    lines = []
    for r in results:
        cells = [f"{s['cache']} {s['cache_n']}/{s['shares']}" for s in (r["scenarios"][n] for n in SCENARIOS)]
        lines.append(f"| {r['arch']} ({r['kind']}) | {build[r['backend']]} | {r['strategy']} | " + " | ".join(cells)
                     + " |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.architectures", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--arch", action="append", choices=ARCHS, help="only these models (repeatable)")
    parser.add_argument("--backend", action="append", choices=KINDS, help="only these backends (repeatable)")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="slotkeeper-arch-") as tmp:
        for arch in args.arch or ARCHS:
            for kind in args.backend or KINDS:
                results.append(measure(arch, kind, Path(tmp)))
                print(json.dumps(results[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "architectures.json").write_text(json.dumps({
        "cells": "how the slot got its state, then cache_n / tokens the prompt shares with the state it could "
                 "start from", "results": results}, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
