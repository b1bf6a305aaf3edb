"""Runs an agent's sequence of turns (A1 B1 A2 B2 A3) through the recording proxy and measures it.

What is measured, per sequence:

(a) `prefilled`: prompt tokens llama-server evaluated over the whole sequence, its own counter
    (`llamacpp:prompt_tokens_total` on `/metrics`, with `--metrics`) read before the first turn and after the last,
    so whatever slotkeeper evaluates besides the agents' requests (a system prompt's warm-up) is counted.
(b) reuse efficiency, exact with the backend's own template and tokenizer. Each generation request the backend
    processed is rendered as llama-server renders it (`/apply-template` on its chat form: an Anthropic body through
    slotkeeper's own translation, a Responses body through slotkeeper's chat view of it; `/tokenize` with
    `add_special` and `parse_special`). S_i is the longest token prefix request i shares with any earlier processed
    request of the sequence. Then

        efficiency = (sum of prompt tokens - prefilled) / sum of S_i

    i.e. reused tokens (prompt minus what the backend had to evaluate) over what could at best have been reused. It
    may exceed 1: a slot also holds the tokens it generated, which a next turn can reuse. Requests refused with an
    HTTP error never reached the prompt stage and are left out of both sums (a 500 about the model's output, after
    the prompt was evaluated, is kept).
(c) error responses: HTTP status >= 400, and error events inside a 200 stream, each with its body.

For slotkeeper targets, slotkeeper's journal (`/api/requests/recent`) and its warm-up counter are read after every
turn, so each turn's rows (`why`: warm-up, own, hot, ...) are on record.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from slotkeeper.dialects.anthropic.claudecode import without_attribution
from slotkeeper.dialects.anthropic.requests import CountTokensRequest
from slotkeeper.dialects.anthropic.translate import chat_messages, chat_tools, system_texts
from slotkeeper.dialects.openai import responses_chat_view
from slotkeeper.tinymodel import TinyModelSpec
from tests.agents.drivers import DRIVERS, PROMPTS, Turn, make_project
from tests.agents.proxy import CAP, Proxies, Record, cap_body, read_answer
from tests.support import REPO

SEQUENCE = (("A", 1), ("B", 1), ("A", 2), ("B", 2), ("A", 3))
# The model the agents talk to: one layer, 64 wide, Qwen3-style template (tools, <think>), 64k tokens of context, so
# that their 20-50k-token prompts prefill in seconds on two cores.
AGENT_MODEL = TinyModelSpec(n_embd=64, n_layer=1, n_head=4, n_head_kv=2, n_ff=128, context_length=65536,
                            template="qwen3")
CONTEXT = 65536
GENERATION_ROUTES = ("/v1/chat/completions", "/chat/completions", "/v1/messages", "/v1/responses", "/responses",
                     "/api/chat", "/completion", "/v1/completions")
INSTALL_SCRIPT = REPO / "scripts" / "install-agents.sh"
REGISTRY_UNREACHABLE = 3  # install-agents.sh's exit status when npm cannot reach its registry


# llama-server's own errors about what the model generated (its output parser on sampled tokens): they come with or
# without slotkeeper, whenever the random model happens to emit a malformed tool call or reasoning block.
MODEL_OUTPUT_ERRORS = ("The model produced output that does not match the expected",
                       "Failed to parse tool call arguments as JSON")


class RegistryUnreachable(RuntimeError):
    """The agents are not installed and the npm registry cannot be reached."""


def install_agents() -> Path:
    """The bin directory of the pinned agents (scripts/install-agents.sh installs them once, into a cache)."""
    run = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=900)
    if run.returncode == REGISTRY_UNREACHABLE:
        raise RegistryUnreachable(run.stderr.strip())
    if run.returncode != 0:
        raise RuntimeError(f"scripts/install-agents.sh failed ({run.returncode}): {run.stderr[-3000:]}")
    return Path(run.stdout.strip().splitlines()[-1])


def route(record: Record) -> str:
    return record.path.split("?", 1)[0]


def is_generation(record: Record) -> bool:
    return record.method == "POST" and route(record) in GENERATION_ROUTES and isinstance(record.body, dict)


# -- llama-server's counters and slotkeeper's journal ----------------------------------------------------------


def prompt_tokens_total(client: httpx.Client, backend_url: str) -> int:
    """llama-server's running total of prompt tokens it evaluated (`llamacpp:prompt_tokens_total`)."""
    for line in client.get(f"{backend_url}/metrics").text.splitlines():
        if line.startswith("llamacpp:prompt_tokens_total "):
            return int(float(line.split()[1]))
    raise RuntimeError(f"{backend_url}/metrics has no llamacpp:prompt_tokens_total (started without --metrics?)")


def keeper_counter(client: httpx.Client, keeper_url: str, name: str) -> float:
    """One of slotkeeper's own /metrics values (summed over labels), 0 when absent."""
    total = 0.0
    for line in client.get(f"{keeper_url}/metrics").text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


WARM_UPS = "slotkeeper_warm_ups_total"


def journal_rows(client: httpx.Client, keeper_url: str, since: float, expected: int,
                 timeout: float = 10.0) -> list[dict[str, Any]]:
    """slotkeeper's journal rows of requests that ended after `since`, oldest first, once there are `expected` of
    them (a row is written just after its response ended) or the timeout passed."""
    deadline = time.monotonic() + timeout
    while True:
        rows = client.get(f"{keeper_url}/api/requests/recent").json()["requests"]
        mine = sorted((r for r in rows if r["time"] >= since), key=lambda r: r["time"])
        if len(mine) >= expected or time.monotonic() > deadline:
            return mine
        time.sleep(0.1)


# -- rendering a request as llama-server does ----------------------------------------------------------------


def anthropic_chat_body(body: dict[str, Any], through_slotkeeper: bool) -> dict[str, Any]:
    """The chat body llama-server renders for a /v1/messages body. Its messages go through slotkeeper's translation
    one by one; system-role entries inside `messages` (Claude Code sends one) stay in place as system messages, as
    llama-server keeps them. The system prompt: through slotkeeper, its translation (Claude Code's attribution line
    taken out, the blocks as text parts, which llama-server joins with newlines); straight to llama-server, the
    blocks' texts joined with nothing between them, as llama-server's own conversion does (measured with its
    /v1/messages/count_tokens)."""
    request = CountTokensRequest.model_validate({"model": body.get("model", "x"), "system": body.get("system"),
                                                 "messages": [{"role": "user", "content": "."}]})
    messages: list[dict[str, Any]]
    if through_slotkeeper:
        stripped, _ = without_attribution(request)  # type: ignore[arg-type]
        request = CountTokensRequest.model_validate(stripped.model_dump(exclude_none=True))
        messages = chat_messages(request)[:-1]  # the system message alone
    else:
        system = system_texts(request)
        messages = [{"role": "system", "content": "".join(system)}] if any(system) else []
    for message in body.get("messages", []):
        if message.get("role") == "system":
            content = message.get("content")
            if isinstance(content, list):
                texts = [b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"]
                content = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
            messages.append({"role": "system", "content": content})
            continue
        one = CountTokensRequest.model_validate({"model": "x", "messages": [message]})
        messages += chat_messages(one)
    out: dict[str, Any] = {"messages": messages}
    if body.get("tools"):
        out["tools"] = chat_tools(CountTokensRequest.model_validate(
            {"model": "x", "messages": [{"role": "user", "content": "."}], "tools": body["tools"]}).tools or [])
    return out


def chat_form(record: Record, through_slotkeeper: bool) -> dict[str, Any] | None:
    """The OpenAI chat body whose rendering is the request's prompt, or None for a route without one."""
    body = record.body
    if not isinstance(body, dict):
        return None
    path = route(record)
    if path == "/v1/messages":
        return anthropic_chat_body(body, through_slotkeeper)
    if path in ("/v1/responses", "/responses"):
        return responses_chat_view(body)
    if path in ("/v1/chat/completions", "/chat/completions", "/api/chat"):
        out = {"messages": body["messages"]}
        if body.get("tools"):
            out["tools"] = body["tools"]
        return out
    return None


def tokenize(client: httpx.Client, backend_url: str, chat: dict[str, Any]) -> list[int]:
    rendered = client.post(f"{backend_url}/apply-template", json=chat)
    rendered.raise_for_status()
    tokens = client.post(f"{backend_url}/tokenize", json={"content": rendered.json()["prompt"], "add_special": True,
                                                          "parse_special": True})
    tokens.raise_for_status()
    result: list[int] = tokens.json()["tokens"]
    return result


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# -- one sequence ----------------------------------------------------------------------------------------------


@dataclass
class Measured:
    """What one request's prompt was, token by token, and what it shared with earlier ones."""

    index: int
    prompt_tokens: int
    shared: int  # S_i: the longest prefix shared with any earlier processed request
    shared_with: int | None  # the index of that earlier request
    reported: int | None  # prompt_n + cache_n as the answer reported them (a check of the rendering)


@dataclass
class SequenceResult:
    agent: str
    target: str
    turns: list[Turn]
    records: list[Record]
    prefilled: int  # llama-server's counter over the whole sequence
    measured: list[Measured] = field(default_factory=list)
    journal: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # turn label -> slotkeeper's rows
    warm_ups: dict[str, float] = field(default_factory=dict)  # turn label -> slotkeeper's warm-ups in it
    outbound: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    # (b) reuse efficiency
    @property
    def prompt_tokens(self) -> int:
        return sum(m.prompt_tokens for m in self.measured)

    @property
    def shared_tokens(self) -> int:
        return sum(m.shared for m in self.measured)

    @property
    def efficiency(self) -> float | None:
        shared = self.shared_tokens
        return (self.prompt_tokens - self.prefilled) / shared if shared else None

    @property
    def cache_n_efficiency(self) -> float | None:
        """The same from the answers' own cache_n (warm-ups not counted): a per-request cross-check."""
        by_index = {r.index: r for r in self.records}
        reused = sum(by_index[m.index].cache_n or 0 for m in self.measured)
        shared = self.shared_tokens
        return reused / shared if shared else None

    # (c) errors
    def errors(self) -> list[Record]:
        """Answers with an HTTP error status, and 200 streams that carried an error event."""
        return [r for r in self.records if r.failed or (r.status == 200 and r.error)]

    def error_summary(self) -> list[str]:
        return [f"#{r.index} {r.turn} {r.method} {route(r)} {r.status}: {r.error[:300]}" for r in self.errors()]

    def rendering_mismatches(self) -> list[tuple[int, int, int | None]]:
        return [(m.index, m.prompt_tokens, m.reported) for m in self.measured
                if m.reported is not None and m.reported != m.prompt_tokens]

    def summary(self) -> dict[str, Any]:
        return {
            "agent": self.agent, "target": self.target, "seconds": round(self.seconds, 1),
            "requests": len(self.records), "generation_requests": len(self.measured),
            "prefilled": self.prefilled, "prompt_tokens": self.prompt_tokens, "shared_tokens": self.shared_tokens,
            "efficiency": self.efficiency, "cache_n_efficiency": self.cache_n_efficiency,
            "errors": self.error_summary(), "rendering_mismatches": self.rendering_mismatches(),
            "turns": [{"label": t.label, "command": t.command, "session": t.session, "returncode": t.returncode,
                       "stopped": t.stopped, "seconds": round(t.seconds, 1), "requests": t.requests}
                      for t in self.turns],
            "warm_ups": self.warm_ups, "outbound_attempts": self.outbound,
        }

    def save(self, directory: Path) -> None:
        """Every request body and answer summary, the turns and the summary, as JSON files under `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        for record in self.records:
            (directory / f"{record.index:03d}-{record.turn or 'none'}.json").write_text(
                json.dumps(record.as_json(), indent=1, ensure_ascii=False))
        (directory / "summary.json").write_text(json.dumps(self.summary(), indent=1))
        (directory / "journal.json").write_text(json.dumps(self.journal, indent=1))
        (directory / "measured.json").write_text(json.dumps([asdict(m) for m in self.measured], indent=1))


def run_sequence(agent: str, target_url: str, bin_dir: Path, work_dir: Path, *, backend_url: str,
                 keeper_url: str | None = None, target: str = "", sequence: tuple[tuple[str, int], ...] = SEQUENCE,
                 turn_timeout: float | None = None) -> SequenceResult:
    """Run the agent's turns against `target_url` (slotkeeper or llama-server) through a recording proxy, and
    measure them on `backend_url` (the llama-server behind it, started with --metrics). `keeper_url`: slotkeeper's
    own address when it is the target, for its journal."""
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with Proxies(target_url) as proxies, httpx.Client(timeout=300) as client:
        driver = DRIVERS[agent](bin_dir, work_dir / "home", make_project(work_dir / "project"), proxies)
        driver.configure()
        before = prompt_tokens_total(client, backend_url)
        turns: list[Turn] = []
        journal: dict[str, list[dict[str, Any]]] = {}
        warm_ups: dict[str, float] = {}
        for conversation, number in sequence:
            prompt = PROMPTS[conversation][number - 1]
            turn_started = time.time()
            warm_before = keeper_counter(client, keeper_url, WARM_UPS) if keeper_url else 0.0
            kwargs = {"timeout": turn_timeout} if turn_timeout else {}
            turn = driver.run_turn(conversation, number, prompt, **kwargs)
            turns.append(turn)
            if keeper_url:
                # Requests slotkeeper refused outright (a 4xx before any slot was involved) have no row.
                records = proxies.snapshot()
                served = sum(1 for i in turn.requests if is_generation(records[i]) and records[i].status < 400)
                journal[turn.label] = journal_rows(client, keeper_url, turn_started, served)
                warm_ups[turn.label] = keeper_counter(client, keeper_url, WARM_UPS) - warm_before
        proxies.wait_idle(60)
        prefilled = prompt_tokens_total(client, backend_url) - before
        records = proxies.snapshot()
        result = SequenceResult(agent, target or target_url, turns, records, prefilled, journal=journal,
                                warm_ups=warm_ups, outbound=list(proxies.outbound.attempts))
        result.measured = measure(client, backend_url, records, through_slotkeeper=keeper_url is not None)
    result.seconds = time.monotonic() - started
    return result


def processed(record: Record) -> bool:
    """Whether the backend evaluated the request's prompt: it answered 200, or failed only on what the model
    generated afterwards (an error about its output, HTTP 500 on a request that was not streamed)."""
    if record.status == 200:
        return True
    return record.status >= 400 and any(message in record.error for message in MODEL_OUTPUT_ERRORS)


def measure(client: httpx.Client, backend_url: str, records: list[Record], through_slotkeeper: bool) -> list[Measured]:
    """Each processed generation request's prompt tokens and S_i, in the order they were sent."""
    seen: list[tuple[int, list[int]]] = []
    out = []
    for record in sorted(records, key=lambda r: r.started):
        if not is_generation(record) or not processed(record):
            continue
        chat = chat_form(record, through_slotkeeper)
        if chat is None:
            continue
        try:
            tokens = tokenize(client, backend_url, chat)
        except httpx.HTTPStatusError:
            if record.status == 200:
                raise
            # The backend cannot render this failed request's input either (a tool call the random model wrote
            # with arguments that are not JSON, sent back by the agent): it failed before its prompt was evaluated.
            continue
        best, best_index = 0, None
        for index, other in seen:
            n = common_prefix(tokens, other)
            if n > best:
                best, best_index = n, index
        reported = None
        if record.prompt_n is not None and record.cache_n is not None:
            reported = record.prompt_n + record.cache_n
        out.append(Measured(record.index, len(tokens), best, best_index, reported))
        seen.append((record.index, tokens))
    return out


def as_sent(record: Record) -> dict[str, Any] | None:
    """A copy of the recorded request's JSON body as the recording proxy sent it on (its answer capped), or None for
    a request without one."""
    if not isinstance(record.body, dict):
        return None
    body: dict[str, Any] = json.loads(json.dumps(record.body))
    cap_body(record.path, body, CAP)
    return body


def backend_gives_it(client: httpx.Client, backend_url: str, record: Record) -> bool:
    """Whether llama-server itself answers the recorded request with an error: one of its errors about the model's
    output, or an error when the request (capped as the proxy sent it) is replayed straight to it."""
    if any(message in record.error for message in MODEL_OUTPUT_ERRORS):
        return True
    body = as_sent(record)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    for attempt in range(2):
        try:
            with client.stream(record.method, f"{backend_url}{record.path}", json=body, headers=headers) as answer:
                text = answer.read().decode("utf-8", errors="replace")
            break
        except httpx.RemoteProtocolError:  # a pooled connection the server had closed: once more
            if attempt:
                raise
    if answer.status_code >= 400:
        return True
    replayed = Record(0, "", record.method, record.path, {}, None, status=answer.status_code,
                      content_type=answer.headers.get("content-type", ""))
    read_answer(replayed, text.encode())
    return bool(replayed.error)


def not_from_backend(result: SequenceResult, client: httpx.Client, backend_url: str) -> list[Record]:
    """The error responses llama-server itself would not have given."""
    return [r for r in result.errors() if not backend_gives_it(client, backend_url, r)]


def recordings_dir(agent: str) -> Path:
    """Where one full sequence's request bodies are kept, outside the repository."""
    return Path(os.environ.get("SLOTKEEPER_AGENT_RECORDINGS", "/tmp/agent-recordings")) / agent
