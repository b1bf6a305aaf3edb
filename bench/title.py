"""Scenario `title`: a new OpenWebUI chat whose title task is sent just before the chat's own request, on one slot.

OpenWebUI 0.12 sends a new chat's title task (not streamed, one `### Task:` user message, up to 1000 tokens of
answer) 14-63 ms before the chat's streamed request. Where the task takes the slot first, the user waits for the
title before the answer starts. Each target gets new chats in pairs: one without a title task, one with the task
sent 30 ms before it (in a thread), in alternating order. Measured: the chat's time to first token with and without
the task, and their ratio. Targets: slotkeeper as it is (side tasks held back, `--side-task-hold-seconds 0.25`),
slotkeeper with the hold off (`0`: arrival order), and llama-server alone with `--cache-ram 0`. Every backend is a
`--cache-ram 0` llama-server with one slot."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import BenchConfig, describe, machine, make_model, prime, processes, ratio, stream_chat
from bench.openwebui import CHAT_HEADER, Chat

TARGETS = ("slotkeeper", "slotkeeper hold 0", "llama-server cram0")
TITLE_LEAD_SECONDS = 0.03


def _pair(client: httpx.Client, url: str, chat: Chat, with_title: bool, title_tokens: int,
          answer_tokens: int) -> dict[str, Any]:
    messages = chat.next_turn()
    title_result: dict[str, Any] = {}
    thread = None
    if with_title:
        # The title task quotes the chat's first message, as OpenWebUI's does (the reply is not there yet).
        task = chat.task_messages("title")

        def send() -> None:
            # A title generation that runs its length (OpenWebUI allows 1000 tokens), the same on every target.
            body = {"messages": task, "max_tokens": title_tokens, "stream": False, "temperature": 0,
                    "ignore_eos": True}
            started = time.perf_counter()
            response = client.post(f"{url}/v1/chat/completions", json=body, headers={CHAT_HEADER: chat.chat_id})
            title_result.update(total_ms=(time.perf_counter() - started) * 1000, started=started,
                                status=response.status_code, kind=response.headers.get("x-slotkeeper-request"))

        thread = threading.Thread(target=send)
        thread.start()
        time.sleep(TITLE_LEAD_SECONDS)
    started = time.perf_counter()
    main = stream_chat(client, url, messages, chat.chat_id, answer_tokens, header=CHAT_HEADER)
    if thread is not None:
        thread.join(120)
    chat.answered()
    row: dict[str, Any] = {"with_title": with_title, "ttft_ms": main.ttft_ms, "total_ms": main.total_ms,
                           "prompt_n": main.prompt_n, "cache_n": main.cache_n}
    if title_result:
        # When the title finished, counted from the chat request's start: before its first token means it went first.
        row["title_ms"] = title_result["total_ms"]
        row["title_done_after_chat_start_ms"] = title_result["started"] * 1000 + title_result["total_ms"] - (
            started * 1000)
        row["title_kind"] = title_result["kind"]
        row["title_status"] = title_result["status"]
    return row


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    model = make_model(root / "models", config.model_size)
    pairs = 2 if config.small else 5
    document = 300 if config.small else 1500
    title_tokens = 40 if config.small else 300
    rows: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        urls: dict[str, str] = {}
        for name in TARGETS:
            backend = procs.backend(name.replace(" ", "-"), cache_ram=0, ctx_per_slot=8192,
                                    ram_dir=name.startswith("slotkeeper"))
            prime(client, backend.url)
            if name == "slotkeeper":
                urls[name] = procs.slotkeeper("slotkeeper", backend).url
            elif name == "slotkeeper hold 0":
                urls[name] = procs.slotkeeper("slotkeeper-hold-0", backend, "--side-task-hold-seconds", "0").url
            else:
                urls[name] = backend.url
        for i in range(pairs):
            order = TARGETS[i % len(TARGETS):] + TARGETS[:i % len(TARGETS)]
            for with_title in ((False, True) if i % 2 == 0 else (True, False)):
                for name in order:
                    # Every chat its own document: nothing of one is in the cache for the next.
                    chat = Chat(f"new-chat-{i}-{int(with_title)}", document, seed=1000 * (i + 1) + int(with_title))
                    rows[name].append(_pair(client, urls[name], chat, with_title, title_tokens,
                                            config.answer_tokens))
    summary: dict[str, Any] = {}
    for name in TARGETS:
        alone = [r["ttft_ms"] for r in rows[name] if not r["with_title"]]
        titled = [r["ttft_ms"] for r in rows[name] if r["with_title"]]
        first = [r for r in rows[name] if r["with_title"] and r["title_done_after_chat_start_ms"] < r["ttft_ms"]]
        summary[name] = {"ttft_without_title": describe(alone), "ttft_with_title": describe(titled),
                         "ratio_of_medians": ratio(statistics.median(titled), statistics.median(alone)),
                         "title_ran_first": len(first), "pairs": len(titled),
                         "title_ms_median": statistics.median(r["title_ms"] for r in rows[name] if r["with_title"])}
    return {"scenario": "title", "config": config.as_json(), "machine": machine(), "targets": list(TARGETS),
            "pairs": pairs, "document_tokens": document, "title_tokens": title_tokens,
            "title_lead_ms": TITLE_LEAD_SECONDS * 1000, "summary": summary,
            "samples": [{"target": name, **row} for name in TARGETS for row in rows[name]]}
