"""OpenWebUI with its default settings (tests/fixtures/clients/openwebui-default.json): no chat id and no system
prompt, so its chats are known only by their messages. Two chats, A (which opens with a pasted document of about
2,500 tokens) and B, in the order A1 B1 A2 B2 A3, each turn with the tasks OpenWebUI sends around it (a new chat's
title task 30 ms before its first request, follow-ups after every answer, tags after the first), replayed

- through slotkeeper with the official `ollama` client on one slot of a `--cache-ram 0` server, and
- straight to a llama-server with its default RAM cache, as the equivalent /v1/chat/completions bodies (what
  slotkeeper sends upstream for them: the `ollama` client cannot talk to llama-server).

Against both real llama.cpp servers, on counts: what llama-server prefilled over the sequence (its /metrics
`llamacpp:prompt_tokens_total`, read before and after, so slotkeeper's own evaluations count) through slotkeeper must
not exceed what it prefilled with its RAM cache alone; and slotkeeper must reuse at least 98% of what each request
shares with any earlier one (exact token prefixes, from the backend's /apply-template and /tokenize). Every answer
must be a 200.

The tasks carry num_predict in `options` (OpenWebUI's title task has it at the top level, which the `ollama` client
has no argument for), and every request asks for 8 tokens at temperature 0."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import ollama
import pytest

from bench.messages import prefill_counters
from tests.client_fixtures import load, prompt_tokens, shared
from tests.conftest import Stack
from tests.openwebui_chats import FIXTURE, Ask, Step, steps
from tests.support import Backend, wait_until

pytestmark = pytest.mark.backend

NUM_PREDICT = 8
TITLE_LEAD_S = 0.03  # OpenWebUI 0.11 starts a new chat's title task as it creates the chat, just before the answer
DEFAULT_CACHE_RAM = 8192  # llama-server's own default --cache-ram (MiB): the Backend helper always passes the option
EFFICIENCY = 0.98


@dataclass
class Sequence:
    """The replayed requests in the order they are sent, their prompt tokens and, for each, the longest token prefix
    it shares with any earlier one."""

    asks: list[Ask]
    tokens: list[list[int]]
    shares: list[int]

    @property
    def prompt(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def shared(self) -> int:
        return sum(self.shares)


def measured(backend_url: str, plan: list[Step]) -> Sequence:
    asks = [ask for step in plan for ask in step]
    with httpx.Client(base_url=backend_url, timeout=120) as client:
        tokens = [prompt_tokens(client, {"messages": ask.messages}) for ask in asks]
    shares = [max((shared(tokens[i], tokens[j]) for j in range(i)), default=0) for i in range(len(tokens))]
    return Sequence(asks, tokens, shares)


def options(fixture: dict[str, Any], ask: Ask) -> dict[str, Any]:
    chat_options = fixture["chat"].get("options", {}) if ask.kind == "chat" else {}
    return {**chat_options, "num_predict": NUM_PREDICT, "temperature": 0}


def upstream_body(ask: Ask) -> dict[str, Any]:
    """The body slotkeeper sends llama-server for the Ollama request: its messages, stream flag and sampling
    (`num_ctx` is fixed when the server starts, and not sent)."""
    return {"messages": ask.messages, "stream": ask.stream, "n_predict": NUM_PREDICT, "temperature": 0,
            "cache_prompt": True}


def replay(plan: list[Step], send: Any) -> list[int]:
    """Every step in order: a new chat's title task from a thread, the chat's first request 30 ms after it (as
    OpenWebUI starts both at once); each later request after the previous one ended. The statuses, in send order."""
    statuses: list[int] = []
    for step in plan:
        if len(step) == 1:
            statuses.append(send(step[0]))
            continue
        out: dict[int, int] = {}
        title, turn = step

        def task(ask: Ask = title, into: dict[int, int] = out) -> None:
            into[0] = send(ask)

        first = threading.Thread(target=task)
        first.start()
        time.sleep(TITLE_LEAD_S)
        out[1] = send(turn)
        first.join()
        statuses += [out[0], out[1]]
    return statuses


def through_slotkeeper(url: str, model: str, fixture: dict[str, Any]) -> Any:
    def send(ask: Ask) -> int:
        # A client per request, as OpenWebUI opens a session per request; it sends its own User-Agent.
        client = ollama.Client(host=url, headers=fixture["headers"], timeout=300)
        try:
            if ask.stream:
                for _ in client.chat(model=model, messages=ask.messages, stream=True, options=options(fixture, ask)):
                    pass
            else:
                client.chat(model=model, messages=ask.messages, stream=False, options=options(fixture, ask))
            return 200
        except ollama.ResponseError as error:
            return error.status_code
        finally:
            client.close()
    return send


def straight_to(url: str) -> Any:
    def send(ask: Ask) -> int:
        with httpx.Client(base_url=url, timeout=300) as client:
            if not ask.stream:
                return client.post("/v1/chat/completions", json=upstream_body(ask)).status_code
            with client.stream("POST", "/v1/chat/completions", json=upstream_body(ask)) as response:
                for _ in response.iter_lines():
                    pass
                return response.status_code
    return send


def settled(keeper_url: str, n: int) -> list[dict[str, Any]]:
    """slotkeeper's records of the last `n` requests, oldest first, once all are written and no slot is busy."""
    with httpx.Client(base_url=keeper_url, timeout=60) as client:
        def rows() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = client.get("/api/requests/recent", params={"limit": 200}).json()["requests"]
            return found

        def idle() -> bool:
            current = client.get("/api/sessions/current").json()
            return not any(slot["busy"] for slot in current["slots"]) and not current["queue"]

        assert wait_until(lambda: len(rows()) >= n and idle(), timeout=30), rows()
        time.sleep(0.5)  # anything slotkeeper starts once idle is counted too
        assert wait_until(idle, timeout=30)
        return list(reversed(rows()[:n]))


def test_openwebui_default_chats_reuse_what_they_share(stack: Stack, tmp_path) -> None:
    fixture = load(FIXTURE)
    plan = steps(fixture)
    backend = stack.backend(parallel=1, cache_ram=0, extra_args=("--metrics",))
    keeper = stack.slotkeeper(backend)
    seq = measured(backend.url, plan)
    document_turn = seq.asks.index(next(a for a in seq.asks if (a.chat, a.turn, a.kind) == ("A", 1, "chat")))
    assert seq.shares[document_turn] > 2000, seq.shares  # the fixture's shape: A2 carries the pasted document
    model = httpx.get(f"{keeper.url}/api/tags").json()["models"][0]["name"]
    with httpx.Client(timeout=60) as counters:
        before = prefill_counters(counters, backend.url)
        started = time.monotonic()
        keeper_statuses = replay(plan, through_slotkeeper(keeper.url, model, fixture))
        keeper_seconds = time.monotonic() - started
        rows = settled(keeper.url, len(seq.asks))
        keeper_prefilled = (prefill_counters(counters, backend.url) - before).prefilled
        keeper.stop()
        backend.stop()

        direct = Backend(stack.kind, stack.model, tmp_path / "direct-slots", tmp_path / f"direct-{stack.kind}.log",
                         parallel=1, cache_ram=DEFAULT_CACHE_RAM, extra_args=("--metrics",))
        try:
            direct.start()
            before = prefill_counters(counters, direct.url)
            started = time.monotonic()
            direct_statuses = replay(plan, straight_to(direct.url))
            direct_seconds = time.monotonic() - started
            direct_prefilled = (prefill_counters(counters, direct.url) - before).prefilled
        finally:
            direct.stop()

    efficiency = (seq.prompt - keeper_prefilled) / seq.shared
    direct_efficiency = (seq.prompt - direct_prefilled) / seq.shared
    asked = "\n".join(f"  {ask.what:<14} prompt {len(tokens):>5}, shared with an earlier one {share:>5}"
                      for ask, tokens, share in zip(seq.asks, seq.tokens, seq.shares, strict=True))
    recorded = "\n".join(f"  {row['api']:<12} side={row['side']!s:<5} {row['session'][:40]:<40} "
                         f"cache={row['cache']:<8} cache_n={row['cache_n']} prompt_n={row['prompt_n']} "
                         f"status={row['status']}" for row in rows)
    report = (f"[{stack.kind}] {len(seq.asks)} requests, prompt tokens {seq.prompt}, shared with earlier ones "
              f"{seq.shared}; slotkeeper prefilled {keeper_prefilled} (efficiency {efficiency:.4f}, "
              f"{keeper_seconds:.1f} s); llama-server with its default RAM cache prefilled {direct_prefilled} "
              f"(efficiency {direct_efficiency:.4f}, {direct_seconds:.1f} s)\n"
              f"the requests in send order:\n{asked}\nslotkeeper's records in the order they ended:\n{recorded}")
    print(report)
    assert keeper_statuses == [200] * len(seq.asks) and direct_statuses == [200] * len(seq.asks), (
        keeper_statuses, direct_statuses)
    assert all(row["status"] == 200 for row in rows), report
    assert keeper_prefilled <= direct_prefilled, report
    assert efficiency >= EFFICIENCY, report
