"""Scenario `swap`: two models behind one llama-server router with `--models-max 1`, through slotkeeper (which
launches its own router) and to a router alone, side by side, the targets taking turns. Each round: a conversation
on model A (`--tokens` long; its first turn is the "first turn on a new model", A not loaded), a turn on B (which
unloads A), then A's return turn: the router alone prefills A's whole conversation again, slotkeeper restores the
state it saved before A was unloaded. Also measured on the router alone: how long loading A takes (POST /models/load
until /models says loaded), the part of the return turn no cache can save; slotkeeper's restore time is its own
record of the turn."""

from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    MODEL_SPECS,
    BenchConfig,
    describe,
    keeper_record,
    machine,
    ratio,
    stream_chat,
)
from bench.switch import next_turn, opening
from slotkeeper.tinymodel import TinyModelSpec, write_tiny_model
from slotkeeper.upstream.launcher import free_port
from tests.support import Slotkeeper, llama_server_binary, wait_healthy, words

TARGETS = ("router alone", "slotkeeper")
MODELS = ("model-a", "model-b")


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    models_dir = root / "models"
    models_dir.mkdir(exist_ok=True)
    spec = MODEL_SPECS[config.model_size]
    for k, name in enumerate(MODELS):
        path = models_dir / f"{name}.gguf"
        if not path.exists():
            write_tiny_model(path, TinyModelSpec(**{**_spec_fields(spec), "seed": 4100 + k, "name": name}))
    tokens = config.tokens[0]
    ctx = tokens + 1024
    samples: list[dict[str, Any]] = []
    router_port = free_port()
    argv = [str(llama_server_binary()), "--models-dir", str(models_dir), "--models-max", "1", "-c", str(ctx),
            "-np", "1", "-t", str(config.threads)]
    with (root / "router.log").open("ab") as log:
        router = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(router_port)], stdout=log,
                                  stderr=subprocess.STDOUT)
    keeper = Slotkeeper(root / "slotkeeper" / "cache", root / "slotkeeper.log",
                        extra_args=("--", *argv))
    try:
        alone = f"http://127.0.0.1:{router_port}"
        wait_healthy(alone, router, 60)
        keeper.start(timeout=120)
        urls = {"router alone": alone, "slotkeeper": keeper.url}
        with httpx.Client(timeout=1200) as client:
            for r in range(config.rounds):
                order = TARGETS if r % 2 == 0 else TARGETS[::-1]
                for target in order:
                    samples.append(_round(client, urls[target], target, r, tokens, config.answer_tokens))
                samples[-1 if order[-1] == "router alone" else -2]["load_ms"] = _load_time(client, alone)
    finally:
        keeper.stop()
        router.terminate()
        router.wait(30)
    return {"scenario": "swap", "config": config.as_json(), "machine": machine(), "samples": samples,
            "summary": summarize(samples, tokens)}


def _spec_fields(spec: Any) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in ("arch", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff",
                                                   "context_length", "template")}


def _round(client: httpx.Client, url: str, target: str, r: int, tokens: int, answer: int) -> dict[str, Any]:
    """One round on one target: A's first turn (A not loaded), a turn on B, A's return turn."""
    session = f"swap-{target.replace(' ', '-')}-{r}"
    messages = opening(session, tokens, 9100 + r)
    first = stream_chat(client, url, messages, session, answer, model=MODELS[0])
    other = [{"role": "user", "content": words(200, 9300 + r)}]
    stream_chat(client, url, other, f"{session}-b", answer, model=MODELS[1])
    since = time.time()
    back = stream_chat(client, url, next_turn(messages, 9500 + r), session, answer, model=MODELS[0])
    sample: dict[str, Any] = {
        "target": target, "round": r, "first_ttft_ms": first.ttft_ms, "first_prompt_n": first.prompt_n,
        "first_prompt_ms": first.prompt_ms,
        "return_ttft_ms": back.ttft_ms, "return_prompt_n": back.prompt_n, "return_cache_n": back.cache_n,
        # What the backend says it spent on the prompt tokens it evaluated (the new message, through slotkeeper).
        "return_prompt_ms": back.prompt_ms,
    }
    if target == "slotkeeper":
        row = keeper_record(client, url, session, since)
        sample.update({"cache": row["cache"], "restored": row["restored"], "restore_ms": row["restore_ms"]})
    # B again, so that each round starts with A unloaded on both targets.
    stream_chat(client, url, [*other, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}],
                f"{session}-b", answer, model=MODELS[1])
    return sample


def _load_time(client: httpx.Client, router: str) -> float:
    """Milliseconds the router alone takes to load A (unloaded, B loaded): POST /models/load until /models says so;
    B is loaded again after, as the rounds expect."""
    started = time.perf_counter()
    _post(client, f"{router}/models/load", {"model": MODELS[0]}).raise_for_status()
    while True:
        models = client.get(f"{router}/models").json()["data"]
        if any(m["id"] == MODELS[0] and m["status"]["value"] == "loaded" for m in models):
            break
        time.sleep(0.005)
    took = (time.perf_counter() - started) * 1000
    _post(client, f"{router}/models/load", {"model": MODELS[1]})
    return took


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> httpx.Response:
    """A POST, sent once more when the pooled connection turns out to have been closed by the server while idle (the
    request was then never processed)."""
    try:
        return client.post(url, json=body)
    except httpx.RemoteProtocolError:
        return client.post(url, json=body)


def summarize(samples: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    by = {t: [s for s in samples if s["target"] == t] for t in TARGETS}
    alone, keeper = by["router alone"], by["slotkeeper"]
    load = statistics.median(s["load_ms"] for s in alone if "load_ms" in s)
    restore = statistics.median(s["restore_ms"] for s in keeper)
    keeper_return = statistics.median(s["return_ttft_ms"] for s in keeper)
    alone_return = statistics.median(s["return_ttft_ms"] for s in alone)
    # The return turn through slotkeeper but for the prefill of the turn's new message, which no cache can save.
    keeper_rest = statistics.median(s["return_ttft_ms"] - max(0.0, s["return_prompt_ms"]) for s in keeper)
    return {
        "tokens": tokens,
        "targets": {t: {"first_ttft_ms": describe([s["first_ttft_ms"] for s in rows]),
                        "return_ttft_ms": describe([s["return_ttft_ms"] for s in rows]),
                        "return_prompt_n_median": statistics.median(s["return_prompt_n"] for s in rows),
                        "return_cache_n_median": statistics.median(s["return_cache_n"] for s in rows)}
                    for t, rows in by.items()},
        "router_load_ms": load,
        "slotkeeper_restore_ms": restore,
        "slotkeeper_return_new_tokens_prompt_ms": statistics.median(s["return_prompt_ms"] for s in keeper),
        "ratios": {
            # Goal: <= 1.2 (only the model's load and one restore remain).
            "return_over_load_plus_restore": ratio(keeper_return, load + restore),
            # The same without the new message's prefill (the backend's own prompt_ms of the turn).
            "return_but_new_tokens_over_load_plus_restore": ratio(keeper_rest, load + restore),
            # Goal: >= 5 on `medium` at 8k tokens.
            "router_alone_over_slotkeeper_return": ratio(alone_return, keeper_return),
            # Goal: <= 1.05 (the first turn on a model that is not loaded costs no more through slotkeeper).
            "first_turn_slotkeeper_over_alone": ratio(
                statistics.median(s["first_ttft_ms"] for s in keeper),
                statistics.median(s["first_ttft_ms"] for s in alone)),
        },
    }
