"""A Claude-Code-shaped session (tests/fixtures/clients/claude-code.json) through the official `anthropic` client
against both real llama.cpp servers, on one slot: an attribution line with a new `cch` on every request, the agent's
tool loop, and its side requests (title, subagent warm-up, command-prefix check) under the session's id.

With the line taken out (the default), every turn after the first reuses the previous turn's whole prompt, side
requests in between included. The baseline, the same sequence with the line kept (`--keep-attribution-block`, what
slotkeeper did before), reuses only the tokens in front of `cch`. Assertions on token counts, never on text."""

from __future__ import annotations

import itertools
from typing import Any

import anthropic
import pytest

from tests.client_fixtures import expand, load
from tests.conftest import Stack
from tests.support import turn_log, wait_until

pytestmark = pytest.mark.backend

SESSION = "5b1f0c6e-7d2a-4c1e-9f3b-2a8d6e4c1b07"
# The tokens of the system prompt's start that come before `cch` in the line: all a kept line lets anything reuse.
BEFORE_CCH = 100


def run_session(client: anthropic.Anthropic) -> list[dict[str, Any]]:
    """Replay the fixture; returns, per request, its kind, slotkeeper's headers and the prompt's token counts."""
    fixture = load("claude-code")
    names = {"SESSION": SESSION, "DEVICE": "d" * 64}
    metadata = expand(fixture["metadata"], names)
    history: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, request in enumerate(fixture["requests"]):
        names["TOOL_ID"] = f"toolu_{i:02d}"
        if request["kind"] == "side":
            raw = client.messages.with_raw_response.create(
                model="tiny", max_tokens=request["max_tokens"], system=expand(request["system"], names),
                messages=expand(request["messages"], names), tools=request["tools"], metadata=metadata)
            message, headers = raw.parse(), raw.headers
        else:
            if "tool_call" in request:  # the model's last answer asked for a tool: the client sends it back so
                history[-1]["content"].append({"type": "tool_use", "id": names["TOOL_ID"],
                                               "name": request["tool_call"]["name"],
                                               "input": request["tool_call"]["input"]})
            history += expand(request["append"], names)
            kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "system": expand(fixture["system"], names),
                                      "tools": fixture["tools"], "messages": history, "metadata": metadata,
                                      "extra_body": {"temperature": 0}}
            if request["stream"]:
                with client.messages.stream(**kwargs) as stream:
                    message = stream.get_final_message()
                    headers = stream.response.headers
            else:
                raw = client.messages.with_raw_response.create(**kwargs)
                message, headers = raw.parse(), raw.headers
            text = "".join(b.text for b in message.content if b.type == "text") or "..."
            history.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
        usage = message.usage
        results.append({"kind": request["kind"], "side": headers.get("x-slotkeeper-request") == "side",
                        "session": headers.get("x-slotkeeper-session"), "cache_n": usage.cache_read_input_tokens or 0,
                        "prompt": usage.input_tokens + (usage.cache_read_input_tokens or 0)})
    return results


def test_every_turn_reuses_the_previous_turns_prompt(stack: Stack) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    with anthropic.Anthropic(base_url=keeper.url, api_key="x", max_retries=0, timeout=120,
                             default_headers=expand(load("claude-code")["headers"], {"SESSION": SESSION})) as client:
        results = run_session(client)
    assert all(r["session"] == SESSION for r in results), results
    assert [r["side"] for r in results] == [r["kind"] == "side" for r in results], results
    mains = [r for r in results if r["kind"] == "main"]
    assert mains[0]["prompt"] > 1500, mains[0]
    for previous, turn in itertools.pairwise(mains):
        assert turn["cache_n"] >= previous["prompt"] - 8, (previous, turn, results)
    # A streamed turn's log line is written once its stream has ended on slotkeeper's side, a moment after the
    # client has read the last event.
    assert wait_until(lambda: len(turn_log(keeper, SESSION)) == len(results), timeout=10)
    rows = turn_log(keeper, SESSION)
    assert [row["side"] for row in rows] == ["yes" if r["side"] else "no" for r in results], rows


def test_baseline_with_the_attribution_line_kept_reuses_nothing(stack: Stack) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0), "--keep-attribution-block")
    with anthropic.Anthropic(base_url=keeper.url, api_key="x", max_retries=0, timeout=120,
                             default_headers=expand(load("claude-code")["headers"], {"SESSION": SESSION})) as client:
        results = run_session(client)
    mains = [r for r in results if r["kind"] == "main"]
    assert all(turn["prompt"] > 1500 and turn["cache_n"] < BEFORE_CCH for turn in mains[1:]), mains
