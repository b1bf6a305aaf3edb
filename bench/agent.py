"""Scenario `agent`: a coding agent and an OpenWebUI-like chat sharing one llama-server (one slot, optionally two).

The agent sends Anthropic-shaped streamed requests (/v1/messages, its session in `metadata.user_id` as Claude Code
sends it): a long system prompt, four tools, reminder blocks, and a history that grows by one tool call and one tool
result per turn. The chat sends streamed turns (its first one pastes a document) and, under the same chat id, the
non-streamed `### Task:` side requests OpenWebUI makes after replies (title, tags, follow-ups). The two alternate:
two agent turns, then a chat turn and its tasks. Every request goes to three targets in rotating order: llama-server
alone with `--cache-ram 0`, llama-server with its default host-memory prompt cache, and slotkeeper over a
`--cache-ram 0` llama-server. Measured: TTFT of the main turns, and the prompt tokens each backend evaluated in
total (its `/metrics` counters, so slotkeeper's warm-ups are counted too)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    BenchConfig,
    StreamResult,
    describe,
    keeper_record,
    machine,
    make_model,
    prime,
    processes,
    ratio,
    stream_chat,
)
from bench.messages import (
    MessagesResult,
    PrefillCounters,
    SystemPart,
    messages_body,
    prefill_counters,
    stream_messages,
    system_part,
)
from bench.openwebui import CHAT_HEADER, Chat, side_task
from tests.support import words

TARGETS = ("llama-server cram0", "llama-server default", "slotkeeper")
MAIN_KINDS = ("agent", "chat")


@dataclass
class AgentSession:
    """A coding agent's conversation: each turn adds a tool call and its result (fixed text, the same for every
    target, whatever the model answered)."""

    part: SystemPart
    session: str
    task_tokens: int
    result_tokens: int
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def user_id(self) -> str:
        return f"user_bench_account__session_{self.session}"

    def request(self, max_tokens: int) -> dict[str, Any]:
        if not self.messages:
            self.messages.append(self.part.first_user("Fix the failing test. " + words(self.task_tokens, 9)))
        body = messages_body(self.part, self.messages, max_tokens)
        body["metadata"] = {"user_id": self.user_id}
        return body

    def answered(self, text: str | None = None) -> None:
        """The turn's answer (`text`, what the model said; fixed filler when None), a tool call and its result."""
        n = len(self.messages) // 2
        tool_id = f"toolu_{self.session}_{n}"
        self.messages += [
            {"role": "assistant", "content": [{"type": "text", "text": words(30, 300 + n) if text is None else text},
                                              {"type": "tool_use", "id": tool_id, "name": "read_file",
                                               "input": {"arg": f"src/module_{n}.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id,
                                          "content": words(self.result_tokens, 400 + n)}]},
        ]


def schedule(agent_turns: int, chat_turns: int) -> list[str]:
    """Two agent turns, then a chat turn (with its tasks), until both are used up."""
    out: list[str] = []
    while agent_turns or chat_turns:
        for _ in range(min(2, agent_turns)):
            out.append("agent")
            agent_turns -= 1
        if chat_turns:
            out.append("chat")
            chat_turns -= 1
    return out


def run(config: BenchConfig, root: Path) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    totals: dict[str, dict[str, Any]] = {}
    for slots in config.agent_slots:
        rows, counters = run_workload(config, root / f"slots-{slots}", slots)
        samples += rows
        totals[str(slots)] = {t: {"prefilled": c.prefilled, "reused": c.reused, "prompt_seconds": c.seconds}
                              for t, c in counters.items()}
    summary = {str(slots): summarize([s for s in samples if s["slots"] == slots], totals[str(slots)])
               for slots in config.agent_slots}
    return {"scenario": "agent", "config": config.as_json(), "machine": machine(), "targets": list(TARGETS),
            "samples": samples, "summary": summary}


def run_workload(config: BenchConfig, root: Path, slots: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    model = make_model(root, config.model_size)
    result_tokens = 100 if config.small else 400
    agent = AgentSession(system_part(config.system_tokens, 303), f"agent-{slots}", 100, result_tokens)
    chat = Chat(f"chat-{slots}", 300 if config.small else 1500, seed=17)
    ctx = config.system_tokens + config.agent_turns * (result_tokens + 150) + 2048
    metrics = ("--metrics",)
    samples: list[dict[str, Any]] = []
    with processes(root, model) as procs, httpx.Client(timeout=600) as client:
        behind = procs.backend("agent-behind", 0, ctx, parallel=slots, extra_args=metrics, ram_dir=True)
        keeper = procs.slotkeeper("agent-slotkeeper", behind)
        backends = {TARGETS[0]: procs.backend("agent-cram0", 0, ctx, parallel=slots, extra_args=metrics),
                    TARGETS[1]: procs.backend("agent-default", 8192, ctx, parallel=slots, extra_args=metrics),
                    TARGETS[2]: behind}
        urls = {TARGETS[0]: backends[TARGETS[0]].url, TARGETS[1]: backends[TARGETS[1]].url, TARGETS[2]: keeper.url}
        for backend in backends.values():
            prime(client, backend.url)
        first = {t: prefill_counters(client, b.url) for t, b in backends.items()}

        def start(target: str) -> tuple[str, float, PrefillCounters]:
            return target, time.time(), prefill_counters(client, backends[target].url)

        def finish(mark: tuple[str, float, PrefillCounters], session: str, sample: dict[str, Any]) -> None:
            """Record one request with what its backend's counters say it cost (slotkeeper's warm-ups included)."""
            target, since, before = mark
            cost = prefill_counters(client, backends[target].url) - before
            sample.update(target=target, slots=slots, backend_prefilled=cost.prefilled,
                          backend_prompt_ms=cost.seconds * 1000)
            if target == "slotkeeper":
                row = keeper_record(client, keeper.url, session, since)
                sample.update(cache=row["cache"], side=row["side"], restore_ms=row["restore_ms"],
                              save_ms=row["save_ms"])
            samples.append(sample)

        previous: str | None = None
        for step, kind in enumerate(schedule(config.agent_turns, config.chat_turns)):
            order = [TARGETS[(step + i) % len(TARGETS)] for i in range(len(TARGETS))]
            # The conversation's first turn, or whether the slot was last used by the other conversation (its tasks
            # included) or by this one.
            seen = any(s["kind"] == kind for s in samples)
            position = "first" if not seen else "consecutive" if previous == kind else "switched"
            previous = kind
            fields = {"step": step, "kind": kind, "position": position}
            if kind == "agent":
                body = agent.request(config.answer_tokens)
                for target in order:
                    mark = start(target)
                    finish(mark, agent.user_id, {**fields, **_streamed(stream_messages(client, urls[target], body))})
                agent.answered()
                continue
            messages = chat.next_turn()
            for target in order:
                mark = start(target)
                r = stream_chat(client, urls[target], messages, chat.chat_id, config.answer_tokens, CHAT_HEADER)
                finish(mark, chat.chat_id, {**fields, **_streamed(r)})
            chat.answered()
            for task in chat.tasks_after_reply():
                task_messages = chat.task_messages(task)
                for target in order:
                    mark = start(target)
                    u = side_task(client, urls[target], task_messages, chat.chat_id, config.answer_tokens)
                    finish(mark, chat.chat_id, {"step": step, "kind": f"task:{task}", "position": "task",
                                                "total_ms": u.total_ms, "prompt_n": u.prompt_n, "cache_n": u.cache_n})
        counters: dict[str, PrefillCounters] = {t: prefill_counters(client, b.url) - first[t]
                                                for t, b in backends.items()}
    return samples, counters


def _streamed(r: StreamResult | MessagesResult) -> dict[str, Any]:
    if isinstance(r, MessagesResult):
        return {"ttft_ms": r.ttft_ms, "total_ms": r.total_ms, "prompt_n": r.prefilled, "cache_n": r.reused}
    return {"ttft_ms": r.ttft_ms, "total_ms": r.total_ms, "prompt_n": r.prompt_n, "cache_n": r.cache_n}


def summarize(samples: list[dict[str, Any]], totals: dict[str, Any]) -> dict[str, Any]:
    per_target: dict[str, Any] = {}
    for target in TARGETS:
        mine = [s for s in samples if s["target"] == target]
        main = [s for s in mine if s["kind"] in MAIN_KINDS]
        switched = [s for s in main if s["position"] == "switched"]
        per_target[target] = {
            "ttft_ms": {f"{kind} {position}": describe([s["ttft_ms"] for s in rows])
                        for kind in MAIN_KINDS for position in ("first", "consecutive", "switched")
                        if (rows := [s for s in main if s["kind"] == kind and s["position"] == position])},
            "switched_ttft_ms": describe([s["ttft_ms"] for s in switched]),
            "switched_backend_prompt_ms": describe([s["backend_prompt_ms"] for s in switched]),
            "main_ttft_ms": describe([s["ttft_ms"] for s in main]),
            "requests": len(mine),
            "main_prompt_n": sum(s["prompt_n"] for s in main),
            "task_prompt_n": sum(s["prompt_n"] for s in mine if s["kind"] not in MAIN_KINDS),
            "backend": totals[target],
        }
    keeper = [s for s in samples if s["target"] == "slotkeeper"]
    per_target["slotkeeper"]["cache_states"] = {
        kind: {c: sum(1 for s in keeper if s["kind"] == kind and s["cache"] == c)
               for c in sorted({s["cache"] for s in keeper if s["kind"] == kind})}
        for kind in sorted({s["kind"] for s in keeper})}
    per_target["slotkeeper"]["side_requests"] = sum(1 for s in keeper if s["side"])
    by_step: dict[int, dict[str, float]] = {}
    for s in samples:
        if s["kind"] in MAIN_KINDS and s["position"] == "switched":
            by_step.setdefault(s["step"], {})[s["target"]] = s["ttft_ms"]
    keeper_stats = per_target["slotkeeper"]
    ratios = {}
    for target, label in ((TARGETS[0], "cram0_over_slotkeeper"), (TARGETS[1], "default_over_slotkeeper")):
        ratios[label] = {
            "switched_ttft_of_medians": ratio(per_target[target]["switched_ttft_ms"]["median"],
                                              keeper_stats["switched_ttft_ms"]["median"]),
            "switched_ttft_median_per_turn": statistics.median(ratio(t[target], t["slotkeeper"])
                                                               for t in by_step.values()),
            "main_ttft_of_medians": ratio(per_target[target]["main_ttft_ms"]["median"],
                                          keeper_stats["main_ttft_ms"]["median"]),
            "prefilled": ratio(totals[target]["prefilled"], totals["slotkeeper"]["prefilled"]),
            "prompt_seconds": ratio(totals[target]["prompt_seconds"], totals["slotkeeper"]["prompt_seconds"]),
        }
    return {"targets": per_target, "ratios": ratios,
            "requests": {kind: sum(1 for s in keeper if s["kind"] == kind) for kind in sorted({s["kind"]
                                                                                                for s in keeper})}}
