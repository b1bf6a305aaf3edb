"""Scenario `days`: the two days of traffic slotkeeper is judged on, replayed live, each target on its own.

Unlike `day` (one fixed script sent unchanged to every target), every client here sends back the answers its own
target generated, as OpenWebUI and the coding agents do; so a proxy that keys a state on the answer it generated
(hearth-llm) is met on its own terms. The two days:

- `ids`: OpenWebUI set up with chat ids. Four chats on one shared system prompt, each request (the chat's turns and
  its title, tags and follow-up tasks) with the chat's `X-OpenWebUI-Chat-Id`; a new chat's title task is sent about
  30 ms before its first turn, follow-ups after every answer, tags after the first. Two coding agents on
  /v1/chat/completions, each with its `X-Session-Id`, on one shared agent system prompt, each turn adding the
  model's answer, a tool call and its result; a Claude-Code-shaped client on /v1/messages with `metadata.user_id`.
- `default`: OpenWebUI under its default settings: no chat id and no system prompt, so a chat is known only by its
  messages. One chat opens with a pasted document, one is short, and one talks to a reasoning model: the client
  sends its answers back without their reasoning (the first half of what was generated, as OpenWebUI drops the
  reasoning block from the history it sends). The same tasks. Two coding agents without ids on one shared system
  prompt, and a subagent (the same system prompt, its own task) after the first agent's third turn.

Targets, each on its own llama-server (one slot), one after another, in rounds: llama-server alone (`--cache-ram
0`), llama-server with its default host-memory prompt cache, hearth-llm (when installed, not at the CI size) and
slotkeeper (its RAM dir on tmpfs, its default idle saves). Each measure is the median of the rounds (`--rounds`; 3
by default, 2 at the CI size), the order of the targets reversed every other round.

Reuse: each request's prompt, as the target was sent it, is rendered and tokenized on the target's own llama-server
after its run; S_i is the longest token prefix it shares with any earlier prompt the same target was sent; reused =
prompt tokens - what the target's llama-server prefilled (its /metrics counter, so slotkeeper's warm-ups count), and
reuse = sum(reused) / sum(S). Time: the wall time of all requests, the side tasks' total time, and the main turns'
(chats' and agents') time to first token."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.agent import AgentSession
from bench.common import GRAMMAR, BenchConfig, machine, make_model, percentile, prime, processes
from bench.day import DEFAULT_CACHE_RAM, Hearth, hearth_binary, run_step
from bench.day_traffic import Request, Step, anthropic_as_chat, chat_body, filler, tokenize
from bench.messages import PrefillCounters, prefill_counters, system_part
from bench.openwebui import task_content
from tests.support import Slotkeeper

DAYS = ("ids", "default")
TARGETS = ("llama-server alone", "llama-server RAM cache", "hearth-llm", "slotkeeper")
TASK_KINDS = ("title", "tags", "follow_ups")
MAIN_KINDS = ("chat", "agent", "subagent", "claude-code")
CHAT_HEADER = "X-OpenWebUI-Chat-Id"
SESSION_HEADER = "X-Session-Id"
SEED = 20261207


@dataclass(frozen=True)
class Shape:
    chats: int
    chat_turns: int
    system_tokens: int  # the shared OpenWebUI system prompt (the `ids` day)
    first_message_tokens: int
    document_tokens: int
    agent_tokens: int
    agent_turns: int
    subagent_turns: int
    result_tokens: int
    answer_tokens: tuple[int, int]
    ctx: int  # each target's context per slot: more than the longest prompt of either day


def shape(config: BenchConfig) -> Shape:
    if config.small:
        return Shape(chats=2, chat_turns=2, system_tokens=300, first_message_tokens=60, document_tokens=300,
                     agent_tokens=500, agent_turns=2, subagent_turns=1, result_tokens=60, answer_tokens=(6, 10),
                     ctx=2048)
    return Shape(chats=4, chat_turns=3, system_tokens=1500, first_message_tokens=200, document_tokens=2500,
                 agent_tokens=3000, agent_turns=6, subagent_turns=3, result_tokens=300, answer_tokens=(16, 24),
                 ctx=8192)


@dataclass
class Chat:
    """One OpenWebUI chat: its history as the client keeps it, and what it sends beside each request."""

    name: str
    system: str | None
    first_text: str
    headers: dict[str, str]
    reasoning: bool = False  # the answers come back without their first half (the reasoning)
    history: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.system is not None:
            self.history.append({"role": "system", "content": self.system})

    def task(self, kind: str, max_tokens: int) -> Request:
        content = task_content(kind, [m for m in self.history if m["role"] != "system"])
        return Request(kind, self.name, "chat", chat_body([{"role": "user", "content": content}], max_tokens, False),
                       {}, headers=dict(self.headers))

    def answered(self, text: str) -> None:
        if self.reasoning:
            words = text.split(" ")
            text = " ".join(words[len(words) // 2:])
        self.history.append({"role": "assistant", "content": text})


@dataclass
class Agent:
    """A coding agent on /v1/chat/completions: each turn adds the model's answer, a tool call and its result."""

    name: str
    kind: str
    system: str
    task: str
    result_tokens: int
    seed: int
    headers: dict[str, str]
    history: list[dict[str, Any]] = field(default_factory=list)

    def request(self, max_tokens: int) -> Request:
        if not self.history:
            self.history = [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]
        return Request(self.kind, self.name, "chat", chat_body(list(self.history), max_tokens, True), {},
                       headers=dict(self.headers))

    def answered(self, text: str) -> None:
        n = len(self.history)
        call = f"call_{self.name}_{n}"
        self.history += [
            {"role": "assistant", "content": text,
             "tool_calls": [{"id": call, "type": "function",
                             "function": {"name": "read_file", "arguments": json.dumps({"arg": f"src/m{n}.py"})}}]},
            {"role": "tool", "tool_call_id": call, "content": filler(self.result_tokens, self.seed + n)},
        ]


# A turn yields its steps one at a time and is sent each step's answers (one text per request) back.
Turn = Generator[Step, list[str], None]


class Day:
    """One day's conversations and the order they speak in; every turn is built from what was answered so far."""

    def __init__(self, day: str, config: BenchConfig) -> None:
        self.day = day
        self.s = s = shape(config)
        self.rng = random.Random(SEED + DAYS.index(day))
        tools = "\n".join(f"- {name}(arg: string): " + filler(60, 70 + i)
                          for i, name in enumerate(("read_file", "edit_file", "run_command", "search", "task")))
        agent_system = (f"You are a coding agent working in a repository.\n# Tools\n{tools}\n# Rules\n"
                        + filler(max(0, s.agent_tokens - 400), 81))
        ids = day == "ids"
        self.chats: dict[str, Chat] = {}
        for k in range(s.chats):
            name = f"chat-{k}"
            if ids:
                system: str | None = "You are a helpful assistant in OpenWebUI. " + filler(s.system_tokens, 61)
                first = f"Chat {k}: please look at this. " + filler(s.first_message_tokens, 100 + k)
            else:
                system = None
                first = (f"Here is a document:\n{filler(s.document_tokens, 91)}\nPlease summarise it." if k == 0
                         else f"Chat {k}: a short question. " + filler(s.first_message_tokens // 4, 100 + k))
            self.chats[name] = Chat(name, system, first, {CHAT_HEADER: f"owui-{day}-{k}"} if ids else {},
                                    reasoning=not ids and k == 1)
        self.agents = {
            name: Agent(name, "agent", agent_system, f"{name}: fix the failing test. " + filler(120, seed),
                        s.result_tokens, seed + 500, {SESSION_HEADER: f"{day}-{name}"} if ids else {})
            for name, seed in (("agent-1", 3000), ("agent-2", 4000))}
        if not ids:
            self.agents["subagent"] = Agent("subagent", "subagent", agent_system,
                                            "subagent: find where the test fails. " + filler(120, 5000),
                                            s.result_tokens, 5500, {})
        self.claude = AgentSession(system_part(s.agent_tokens, 909), f"days-{day}-claude", 100, s.result_tokens) \
            if ids else None
        labels = ([f"chat-{k}" for k in range(s.chats) for _ in range(s.chat_turns)]
                  + ["agent-1"] * s.agent_turns + ["agent-2"] * s.agent_turns
                  + (["claude-code"] * s.agent_turns if ids else []))
        self.rng.shuffle(labels)
        if not ids:  # the subagent's turns right after the first agent's third (the parent waits for it)
            at = [i for i, label in enumerate(labels) if label == "agent-1"][min(3, s.agent_turns) - 1] + 1
            labels[at:at] = ["subagent"] * s.subagent_turns
        self.labels = labels

    def answer(self) -> int:
        return self.rng.randint(*self.s.answer_tokens)

    def turns(self) -> Iterator[Turn]:
        for label in self.labels:
            if label in self.chats:
                yield self.chat_turn(self.chats[label])
            elif label == "claude-code":
                yield self.claude_turn()
            else:
                yield self.agent_turn(self.agents[label])

    def chat_turn(self, chat: Chat) -> Turn:
        first = len([m for m in chat.history if m["role"] == "user"]) == 0
        chat.history.append({"role": "user", "content": chat.first_text if first
                             else filler(60, 7000 + len(chat.history) + 100 * int(chat.name[-1]))})
        main = Request("chat", chat.name, "chat", chat_body(list(chat.history), self.answer(), True), {},
                       headers=dict(chat.headers))
        if first:
            answers = yield [chat.task("title", self.answer()), main]
        else:
            answers = yield [main]
        chat.answered(answers[-1])
        yield [chat.task("follow_ups", self.answer())]
        if first:
            yield [chat.task("tags", self.answer())]

    def agent_turn(self, agent: Agent) -> Turn:
        answers = yield [agent.request(self.answer())]
        agent.answered(answers[0])

    def claude_turn(self) -> Turn:
        assert self.claude is not None
        body = self.claude.request(self.answer())
        body["messages"] = json.loads(json.dumps(body["messages"]))
        body["grammar"] = GRAMMAR
        answers = yield [Request("claude-code", "claude-code", "messages", body, anthropic_as_chat(body))]
        self.claude.answered(answers[0])


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    """Each day, `config.rounds` times: every target in turn, each on fresh processes (the order reversed every other
    round, so that a machine that slows down or speeds up over minutes favours none). Summed up per target: the median
    of each measure over the rounds."""
    model = make_model(root, config.model_size)
    hearth = None if config.small else hearth_binary()
    targets = [t for t in TARGETS if t != "hearth-llm" or hearth is not None]
    days: dict[str, Any] = {}
    for day in DAYS:
        rounds: list[dict[str, Any]] = []
        for round_ in range(config.rounds):
            order = targets if round_ % 2 == 0 else targets[::-1]
            rounds.append({name: run_target(config, root / day / f"{round_}" / name.replace(" ", "-"), model, day,
                                            name, hearth) for name in order})
        days[day] = {"summary": {name: median_summary([r[name]["summary"] for r in rounds]) for name in targets},
                     "rounds": [{name: r[name]["summary"] for name in targets} for r in rounds],
                     "samples": {name: [row for r in rounds for row in r[name]["samples"]] for name in targets}}
    return {
        "scenario": "days", "config": config.as_json(), "machine": machine(), "targets": targets,
        "skipped_targets": {} if hearth is not None else {"hearth-llm": "left out of the CI size" if config.small
                                                          else "not installed"},
        "shape": {**shape(config).__dict__, "answer_tokens": list(shape(config).answer_tokens)},
        "rounds": config.rounds, "days": days,
    }


def median_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each measure's median over the rounds (the token counts are the same in every round but for the answers), and
    the errors of all of them."""
    out: dict[str, Any] = {}
    for key, value in rounds[0].items():
        if key == "errors":
            out[key] = sum(r[key] for r in rounds)  # every round's
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in rounds)
        elif isinstance(value, dict):
            out[key] = median_summary([r[key] for r in rounds])
        else:
            out[key] = value
    return out


def run_target(config: BenchConfig, root: Path, model: Path, day: str, name: str,
               hearth: Path | None) -> dict[str, Any]:
    s = shape(config)
    metrics = ("--metrics",)
    label = name.replace(" ", "-")
    rows: list[dict[str, Any]] = []
    sent: list[Request] = []
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        front: Slotkeeper | Hearth | None = None
        if name == "slotkeeper":
            backend = procs.backend(f"{label}-behind", 0, s.ctx, extra_args=metrics, ram_dir=True)
            front = Slotkeeper(root / label / "cache", root / f"{label}.log", backend, ("--save-idle-seconds", "2"),
                               disk_slot_dir=root / label / "slots")
        elif name == "hearth-llm":
            assert hearth is not None
            backend = procs.backend(f"{label}-behind", 0, s.ctx, extra_args=metrics)
            front = Hearth(hearth, backend, root / f"{label}.log")
        else:
            backend = procs.backend(label, DEFAULT_CACHE_RAM if name == "llama-server RAM cache" else 0, s.ctx,
                                    extra_args=metrics)
        prime(client, backend.url)
        if front is not None:
            front.start()
            procs.stack.callback(front.stop)
        url = front.url if front is not None else backend.url
        base = prefill_counters(client, backend.url)
        wall = 0.0
        for index, turn in enumerate(Day(day, config).turns()):
            step = next(turn)
            while True:
                before = prefill_counters(client, backend.url)
                t0 = time.perf_counter()
                results = run_step(client, url, step)
                wall += time.perf_counter() - t0
                cost = prefill_counters(client, backend.url) - before
                for r, out in zip(step, results, strict=True):
                    r.render = r.render or {"messages": r.body["messages"]}
                    sent.append(r)
                    rows.append({"turn": index, "kind": r.kind, "conversation": r.conversation, "status": out.status,
                                 "ttft_ms": out.ttft_ms, "total_ms": out.total_ms, "step_prefilled": cost.prefilled,
                                 "step_size": len(step), **({"error": out.error} if out.error else {})})
                try:
                    step = turn.send([out.text for out in results])
                except StopIteration:
                    break
        prefilled = prefill_counters(client, backend.url) - base
        tokenize(client, backend.url, [[r] for r in sent])
    for row, r in zip(rows, sent, strict=True):
        row["prompt_tokens"], row["shared_prefix"] = len(r.tokens), r.shared
    return {"summary": summarize(rows, prefilled, wall), "samples": rows}


def summarize(rows: list[dict[str, Any]], prefilled: PrefillCounters, wall: float) -> dict[str, Any]:
    prompt = sum(r["prompt_tokens"] for r in rows)
    shared = sum(r["shared_prefix"] for r in rows)
    main = [r["ttft_ms"] for r in rows if r["kind"] in MAIN_KINDS and r["status"] == 200]
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        alone = [r for r in mine if r["step_size"] == 1]  # a two-request step's prefill is not one request's
        p, sh = sum(r["prompt_tokens"] for r in alone), sum(r["shared_prefix"] for r in alone)
        by_kind[kind] = {"requests": len(mine), "total_s": sum(r["total_ms"] for r in mine) / 1000,
                         "ttft_p50_ms": percentile([r["ttft_ms"] for r in mine], 50),
                         "reuse": (p - sum(r["step_prefilled"] for r in alone)) / sh if sh else None}
    return {
        "requests": len(rows), "errors": sum(1 for r in rows if r["status"] != 200),
        "prompt_tokens": prompt, "shared_prefix_tokens": shared, "prefilled": prefilled.prefilled,
        "reuse": (prompt - prefilled.prefilled) / shared if shared else None,
        "wall_s": wall, "prompt_s": prefilled.seconds,
        "side_tasks_s": sum(r["total_ms"] for r in rows if r["kind"] in TASK_KINDS) / 1000,
        "main_ttft_s": sum(main) / 1000, "main_ttft_p50_ms": percentile(main, 50) if main else None,
        "by_kind": by_kind,
    }
