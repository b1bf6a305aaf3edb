"""The `days` benchmark's traffic (bench/days.py), without a server: each turn is built from the answers its target
gave, with what each day's clients send beside the body."""

from __future__ import annotations

import itertools
from typing import Any

from bench.common import BenchConfig
from bench.day_traffic import Request
from bench.days import CHAT_HEADER, SESSION_HEADER, Day


def replay(day: str) -> list[tuple[Request, str]]:
    """Every request of the day, each answered with a text naming it."""
    sent: list[tuple[Request, str]] = []
    for turn in Day(day, BenchConfig(small=True)).turns():
        step = next(turn)
        while True:
            answers = [f"answer number {len(sent) + i} given here" for i in range(len(step))]
            sent += list(zip(step, answers, strict=True))
            try:
                step = turn.send(answers)
            except StopIteration:
                break
    return sent


def said(r: Request) -> list[dict[str, Any]]:
    return [m for m in r.body["messages"] if m["role"] == "assistant"]


def test_each_conversation_sends_back_the_answers_it_was_given() -> None:
    for day in ("ids", "default"):
        sent = replay(day)
        for kind in ("chat", "agent"):
            for name in {r.conversation for r, _ in sent if r.kind == kind}:
                turns = [(r, a) for r, a in sent if r.conversation == name and r.kind == kind]
                assert len(turns) >= 2
                for (before, answer), (after, _) in itertools.pairwise(turns):
                    assert said(after)[-1]["content"].endswith(answer.split(" ")[-1])
                    if kind == "agent":
                        assert said(after)[-1]["content"] == answer and said(after)[-1]["tool_calls"]
                    assert after.body["messages"][:len(before.body["messages"])] == before.body["messages"]


def test_the_ids_day_names_every_request_and_the_default_day_none() -> None:
    ids = replay("ids")
    for r, _ in ids:
        if r.api == "messages":
            assert r.body["metadata"]["user_id"]
        elif r.kind in ("agent", "subagent"):
            assert r.headers == {SESSION_HEADER: f"ids-{r.conversation}"}
        else:  # a chat's turns and its tasks carry the chat's id
            assert r.headers[CHAT_HEADER].startswith("owui-ids-")
    assert {r.kind for r, _ in ids} >= {"chat", "title", "tags", "follow_ups", "agent", "claude-code"}
    default = replay("default")
    assert all(not r.headers for r, _ in default)
    assert all(r.body["messages"][0]["role"] != "system" for r, _ in default if r.kind == "chat")
    assert {r.kind for r, _ in default} >= {"chat", "title", "tags", "follow_ups", "agent", "subagent"}


def test_a_reasoning_chats_answers_come_back_without_their_first_half() -> None:
    sent = replay("default")
    turns = [(r, a) for r, a in sent if r.conversation == "chat-1" and r.kind == "chat"]
    (_, answer), (after, _) = turns[0], turns[1]
    words = answer.split(" ")
    assert said(after)[-1]["content"] == " ".join(words[len(words) // 2:])
    other = [(r, a) for r, a in sent if r.conversation == "chat-0" and r.kind == "chat"]
    assert said(other[1][0])[-1]["content"] == other[0][1]


def test_a_new_chats_title_task_goes_with_its_first_turn_and_tasks_quote_the_answer() -> None:
    sent = replay("ids")
    steps = [r.kind for r, _ in sent]
    first = steps.index("title")
    assert steps[first + 1] == "chat" and sent[first][0].conversation == sent[first + 1][0].conversation
    answer = sent[first + 1][1]
    follow = next(r for r, _ in sent[first + 2:] if r.kind == "follow_ups")
    assert answer in follow.body["messages"][0]["content"]
