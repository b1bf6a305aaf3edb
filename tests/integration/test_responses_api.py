"""/v1/responses keeps sessions like /v1/chat/completions, against both real llama.cpp servers, through the official
`openai` client's Responses API in the shapes OpenAI Codex CLI sends (tests/fixtures/clients/codex.json: streamed,
the whole history resent every turn, a `session-id` header).

- Two Codex threads take turns on one slot: every resumed turn is restored and reuses its previous prompt.
- A new thread on the same instructions starts from their system state, cut once from the first thread's slot.
- A thread whose earlier message was edited runs, reuses its state up to the edit, and goes on from the edit.
Counts come from the stream's `response.completed` event (usage.input_tokens_details.cached_tokens is the backend's
cache_n, and its `timings` say the same), outcomes from X-Slotkeeper-Cache and the request journal; never text.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Stack
from tests.support import Backend, Slotkeeper, chat, wait_until, words

pytestmark = pytest.mark.backend

CODEX: dict[str, Any] = json.loads((Path(__file__).parent.parent / "fixtures" / "clients" / "codex.json").read_text())
REQUESTS: list[dict[str, Any]] = CODEX["requests"]
# What a resumed turn may fall short of the tokens it shares with its snapshot (the restores' bar elsewhere too).
SLACK = 8
# Codex sends no max_output_tokens; the random model is stopped early instead of running to its context's end.
MAX_OUTPUT = 6


@dataclass(frozen=True)
class Turn:
    """What one Responses turn did: the cache outcome, the tokens the backend reused and those it prefilled."""

    outcome: str
    cache_n: int
    prompt_n: int

    @property
    def n_prompt(self) -> int:
        return self.cache_n + self.prompt_n


def send(client: openai.OpenAI, headers: dict[str, str], body: dict[str, Any]) -> Turn:
    raw = client.responses.with_raw_response.create(**body, max_output_tokens=MAX_OUTPUT, extra_headers=headers)
    assert raw.http_response.status_code == 200
    events = list(raw.parse())
    [done] = [e for e in events if e.type == "response.completed"]
    usage = done.response.usage
    cache_n = usage.input_tokens_details.cached_tokens
    timings = (done.model_extra or {}).get("timings") or {}
    assert timings.get("cache_n") == cache_n, timings  # llama-server's own timings agree with its usage
    return Turn(raw.headers.get("x-slotkeeper-cache", "direct"), cache_n, usage.input_tokens - cache_n)


class CodexThread:
    """One Codex thread replayed from the recording: request i resends the whole history of turns 0..i.

    `name` makes it a thread of its own: its session id and, unless `same_history` (a fork), its user texts, so its
    history is its own too."""

    def __init__(self, keeper: Slotkeeper, name: str | None = None, same_history: bool = False) -> None:
        self.client = openai.OpenAI(base_url=keeper.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.requests = [copy.deepcopy(r) for r in REQUESTS]
        if name is not None:
            for request in self.requests:
                _rename(request, name, texts=not same_history)
        self.session = self.requests[0]["headers"]["session-id"]
        self.turns: list[Turn] = []

    def turn(self, body: dict[str, Any] | None = None) -> Turn:
        """The next recorded request, or `body` (a history the test made from one)."""
        request = self.requests[len(self.turns)] if body is None else {**self.requests[0], "body": body}
        turn = send(self.client, request["headers"], request["body"])
        self.turns.append(turn)
        return turn

    def close(self) -> None:
        self.client.close()


def _rename(request: dict[str, Any], name: str, texts: bool) -> None:
    headers, body = request["headers"], request["body"]
    for field in ("session-id", "thread-id", "x-client-request-id"):
        headers[field] = name
    headers["x-codex-window-id"] = f"{name}:0"
    body["prompt_cache_key"] = name
    for item in body["input"] if texts else ():
        if item.get("type") == "message" and item.get("role") == "user":
            for part in item["content"]:
                part["text"] = f"[{name}] {part['text']}"


def user_text_edited(body: dict[str, Any], index: int) -> dict[str, Any]:
    """`body` with input item `index` (a user message) rewritten from its first character on."""
    edited = copy.deepcopy(body)
    part = edited["input"][index]["content"][0]
    part["text"] = "Actually, " + part["text"]
    return edited


def shared_tokens(backend: Backend, first: dict[str, Any], second: dict[str, Any]) -> int:
    """The tokens two Responses requests' prompts share, measured on the backend itself (slotkeeper stopped): the
    second request right after the first in the one slot reuses exactly their common prefix. Each request on a
    client of its own: llama-server may close a connection after a streamed answer, and a second request sent on
    it before the close is seen fails unsent (seen once in a whole-suite run: "Server disconnected without sending
    a response")."""
    turns = []
    for body in (first, second):
        direct = openai.OpenAI(base_url=backend.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            turns.append(send(direct, {}, body))
        finally:
            direct.close()
    return turns[1].cache_n


def journal(keeper: Slotkeeper, session: str, n: int) -> list[dict[str, Any]]:
    """The session's last `n` journal entries, oldest first (a stream's entry is written when it closes)."""
    def entries() -> list[dict[str, Any]]:
        recent = httpx.get(f"{keeper.url}/api/requests/recent", timeout=10).json()["requests"]
        return [e for e in reversed(recent) if e["session"] == session]

    assert wait_until(lambda: len(entries()) >= n, timeout=10)
    return entries()[-n:]


def system_rows(keeper: Slotkeeper) -> list[dict[str, Any]]:
    return [r for r in keeper.index_rows() if r["kind"] == "system"]


def cuts(keeper: Slotkeeper) -> int:
    return keeper.log_text().count("cut back to system prompt")


def test_codex_threads_taking_turns_resume_from_their_snapshots(stack: Stack) -> None:
    """The recorded thread and a second one alternate on a 1-slot backend, so every resumed turn needs a restore;
    each reuses the whole previous prompt, which the next request's history extends. The second thread's first turn
    reuses what the slot held of the first's: the instructions and the tools."""
    backend = stack.backend(parallel=1, cache_ram=0)
    keeper = stack.slotkeeper(backend)
    threads = [CodexThread(keeper), CodexThread(keeper, "thread-b")]
    try:
        for _ in REQUESTS:
            for thread in threads:
                thread.turn()
    finally:
        for thread in threads:
            thread.close()

    a, b = threads
    assert a.turns[0].outcome == "cold" and warm_ups(keeper) == 0  # nothing was evaluated before the first turn
    for thread in threads:
        for previous, turn in zip(thread.turns, thread.turns[1:], strict=False):
            assert turn.outcome == "restored", (thread.session, thread.turns)
            assert turn.cache_n >= previous.n_prompt - SLACK, (thread.session, thread.turns)
        assert [e["cache_n"] for e in journal(keeper, thread.session, len(REQUESTS))] == [
            t.cache_n for t in thread.turns]
        row = keeper.row(thread.session)  # saved at a switch: the last one came after its turn before last at least
        assert row is not None and row["n_tokens"] >= thread.turns[-2].n_prompt
    keeper.stop()  # the backend's one slot, measured on its own
    shared = shared_tokens(backend, a.requests[0]["body"], b.requests[0]["body"])
    assert shared > 400 and b.turns[0].cache_n >= shared - SLACK, (shared, b.turns[0])


def warm_ups(keeper: Slotkeeper) -> int:
    return keeper.log_text().count("warmed up in slot")


def test_a_new_codex_thread_starts_from_the_system_snapshot(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0), "--save-idle-seconds", "0.5")
    first, new = CodexThread(keeper), CodexThread(keeper, "thread-new")
    try:
        first.turn()
        # Saved once the slot idles, then cut back to the instructions and tools, which are saved on their own.
        assert wait_until(lambda: len(system_rows(keeper)) == 1, timeout=30), keeper.log_text()[-2000:]
        [system] = system_rows(keeper)
        assert first.turns[0].n_prompt > system["n_tokens"] > 400
        # Another conversation (no system prompt) takes the only slot.
        assert chat(client_for(keeper), [{"role": "user", "content": words(300, 9)}], "elsewhere").status_code == 200
        turn = new.turn()
    finally:
        first.close()
        new.close()
    assert turn.cache_n >= system["n_tokens"] - SLACK, (turn, system["n_tokens"])
    # The system state, or the first thread's, which the new thread's tokens, as slotkeeper renders its Responses
    # body, share a few more of (the backend renders the body itself, and reuses the same either way).
    [entry] = journal(keeper, new.session, 1)
    assert (turn.outcome, entry["restored_from"]) in (("restored", f"system:{system['session_id'][:12]}"),
                                                      ("prefix", first.session)), entry
    assert cuts(keeper) == 1 and warm_ups(keeper) == 0


def test_an_edited_codex_history_reuses_the_state_up_to_the_edit(stack: Stack) -> None:
    """The last request comes again with an earlier user message rewritten (as a client that edits a message
    resends it): it runs, is restored from the thread's snapshot and reuses what the two prompts share; the thread
    then goes on from the edited history."""
    backend = stack.backend(parallel=1, cache_ram=0)
    keeper = stack.slotkeeper(backend)
    thread, other = CodexThread(keeper), CodexThread(keeper, "thread-other")
    last = REQUESTS[-1]["body"]
    edit_at = len(REQUESTS[-2]["body"]["input"]) - 1  # the user message the third turn added
    edited = user_text_edited(last, edit_at)
    extended = copy.deepcopy(edited)
    extended["input"] += [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Both cases pass."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Good, thanks."}]}]
    try:
        for _ in REQUESTS:
            thread.turn()
            other.turn()
        after_edit = thread.turn(edited)
        other.turn(other.requests[-1]["body"])
        goes_on = thread.turn(extended)
    finally:
        thread.close()
        other.close()

    keeper.stop()
    shared = shared_tokens(backend, last, edited)
    assert after_edit.outcome == "restored"
    assert after_edit.cache_n >= shared - SLACK, (after_edit, shared)
    assert shared < thread.turns[len(REQUESTS) - 1].n_prompt  # the edit did cut the reuse short
    assert shared >= thread.turns[1].n_prompt  # the edit comes after the second turn's prompt
    assert goes_on.outcome == "restored"
    assert goes_on.cache_n >= after_edit.n_prompt - SLACK, (goes_on, after_edit)


def test_a_forked_codex_thread_starts_from_its_parent_up_to_the_fork(stack: Stack) -> None:
    """A new thread (a session id of its own) that resends another thread's history with an earlier user message
    rewritten starts from that thread's snapshot (`prefix`) and reuses it up to the edit."""
    backend = stack.backend(parallel=1, cache_ram=0)
    keeper = stack.slotkeeper(backend)
    parent, other = CodexThread(keeper), CodexThread(keeper, "thread-other")
    fork = CodexThread(keeper, "thread-fork", same_history=True)
    last = REQUESTS[-1]["body"]
    forked = user_text_edited(last, len(REQUESTS[-2]["body"]["input"]) - 1)
    try:
        for _ in REQUESTS:
            parent.turn()
        other.turn()  # takes the only slot: the parent is saved
        turn = fork.turn(forked)
    finally:
        for thread in (parent, other, fork):
            thread.close()
    keeper.stop()
    shared = shared_tokens(backend, last, forked)

    assert turn.outcome == "prefix"
    assert turn.cache_n >= shared - SLACK, (turn, shared)
    assert shared > parent.turns[1].n_prompt  # more than the system part: most of the parent's history
