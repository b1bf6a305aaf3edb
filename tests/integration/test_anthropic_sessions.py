"""Anthropic traffic under session and slot control, through the official client, against both real llama.cpp
servers: a coding-agent-shaped conversation reuses its previous turn, and comes back `restored` after another
session used the one slot. Assertions are on token counts and headers, never on text."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from tests.conftest import Stack
from tests.support import ANSWER_SLACK, words

pytestmark = pytest.mark.backend

TOOLS: list[Any] = [
    {"name": "read_file", "description": "Read a file from the workspace.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
     "cache_control": {"type": "ephemeral"}},
    {"name": "run", "description": "Run a shell command.",
     "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
]


class AgentConversation:
    """An Anthropic conversation with a ~2k-token system prompt and tools; each turn sends the whole history."""

    def __init__(self, client: anthropic.Anthropic, session: str, seed: int) -> None:
        self.client = client
        self.session = session
        self.system: list[Any] = [{"type": "text", "text": f"You are a coding agent ({session}). " + words(2300, seed),
                                   "cache_control": {"type": "ephemeral"}}]
        self.messages: list[Any] = [{"role": "user", "content": words(200, seed + 1)}]
        self.seed = seed

    def turn(self, stream: bool = False) -> tuple[anthropic.types.Message, str]:
        kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "system": self.system, "tools": TOOLS,
                                  "messages": self.messages, "extra_headers": {"X-Session-Id": self.session},
                                  "extra_body": {"temperature": 0}}
        if stream:
            with self.client.messages.stream(**kwargs) as s:
                message = s.get_final_message()
                cache = s.response.headers["x-slotkeeper-cache"]
        else:
            raw = self.client.messages.with_raw_response.create(**kwargs)
            message, cache = raw.parse(), raw.headers["x-slotkeeper-cache"]
        self.seed += 1
        answer = [{"type": "text", "text": b.text} for b in message.content if b.type == "text"] or "..."
        self.messages += [{"role": "assistant", "content": answer},
                          {"role": "user", "content": words(40, self.seed)}]
        return message, cache


def prompt_tokens(message: anthropic.types.Message) -> int:
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_agent_conversation_reuses_and_restores(stack: Stack) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    with anthropic.Anthropic(base_url=keeper.url, api_key="x", max_retries=0, timeout=120) as client:
        agent = AgentConversation(client, "agent-1", seed=1)
        first, cache1 = agent.turn()
        assert cache1 == "cold"
        assert prompt_tokens(first) > 2000

        second, cache2 = agent.turn(stream=True)
        assert cache2 == "hot"
        assert (second.usage.cache_read_input_tokens or 0) >= prompt_tokens(first), second.usage
        assert second.usage.input_tokens < 120, second.usage  # only the new messages are prefilled

        third, cache3 = agent.turn()
        assert cache3 == "hot"
        assert (third.usage.cache_read_input_tokens or 0) >= prompt_tokens(second), third.usage

        other = AgentConversation(client, "agent-2", seed=50)
        other_message, other_cache = other.turn()  # takes the one slot: agent-1 is saved first
        assert other_cache == "cold"
        saved = keeper.row("agent-1")
        assert saved is not None and saved["n_tokens"] >= prompt_tokens(third)

        fourth, cache4 = agent.turn(stream=True)
        assert cache4 == "restored"
        assert (fourth.usage.cache_read_input_tokens or 0) >= saved["n_tokens"] - ANSWER_SLACK, fourth.usage
        assert fourth.usage.input_tokens < 120, fourth.usage
        assert other_message.type == "message"


def test_metadata_user_id_keeps_sessions_apart(stack: Stack) -> None:
    """Two agents on one system prompt, told apart only by metadata.user_id: each resumes its own state."""
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    system = "Shared agent prompt. " + words(800, 7)
    with anthropic.Anthropic(base_url=keeper.url, api_key="x", max_retries=0, timeout=120) as client:
        def ask(user: str, text: str) -> tuple[anthropic.types.Message, Any]:
            raw = client.messages.with_raw_response.create(
                model="tiny", max_tokens=2, system=system, metadata={"user_id": user},
                messages=[{"role": "user", "content": text}])
            return raw.parse(), raw.headers

        a1, headers = ask("user_a_session_1", words(300, 1))
        assert headers["x-slotkeeper-session"] == "user_a_session_1"
        _, headers = ask("user_b_session_2", words(300, 2))
        assert headers["x-slotkeeper-session"] == "user_b_session_2"
        a2, headers = ask("user_a_session_1", words(300, 1) + " more")
        assert headers["x-slotkeeper-cache"] == "restored"
        assert (a2.usage.cache_read_input_tokens or 0) >= prompt_tokens(a1) - ANSWER_SLACK
