"""The session signals and request shapes of the coding agents people point at a local model (shapes from the
clients' own sources: docs/clients.md), one table row each."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.datastructures import Headers

from slotkeeper.dialects import anthropic
from slotkeeper.serving.identity import resolve_session
from slotkeeper.types import OWN_BODY_FIELDS, IdSource

BILLING = "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=fa690;"


@pytest.mark.parametrize(("client", "headers", "body", "expected"), [
    ("OpenCode", {"x-session-affinity": "ses_1", "X-Session-Id": "ses_1"}, {}, "ses_1"),
    ("OpenCode (affinity only)", {"x-session-affinity": "ses_2"}, {}, "ses_2"),
    ("OpenCode to its own providers", {"x-opencode-session": "ses_3"}, {}, "ses_3"),
    ("Codex", {"session-id": "th-1", "thread-id": "th-1"}, {"prompt_cache_key": "th-1"}, "th-1"),
    ("Codex (thread id only)", {"thread-id": "th-2"}, {}, "th-2"),
    ("older Codex", {"session_id": "th-3", "conversation_id": "th-3"}, {}, "th-3"),
    ("OpenAI prompt_cache_key", {}, {"prompt_cache_key": "pck-1"}, "pck-1"),
    ("OpenRouter session_id", {}, {"session_id": "or-1"}, "or-1"),
    ("Claude Code", {"X-Claude-Code-Session-Id": "cc-1"}, {}, "cc-1"),
    ("Claude Code subagent", {"X-Claude-Code-Session-Id": "cc-1", "x-claude-code-agent-id": "a7"}, {}, "cc-1.agent-a7"),
    ("OpenWebUI", {"X-OpenWebUI-Chat-Id": "chat-1"}, {}, "chat-1"),
])
def test_each_clients_session_signal_is_its_session(client: str, headers: dict[str, str], body: dict[str, Any],
                                                    expected: str) -> None:
    key = resolve_session("m", Headers(headers=headers), body, ["a system prompt"])
    assert key.session_id == expected and key.source in (IdSource.HEADER, IdSource.BODY), client


def test_an_explicit_header_beats_prompt_cache_key_and_the_key_is_not_forwarded() -> None:
    key = resolve_session("m", Headers(headers={"x-session-id": "h"}), {"prompt_cache_key": "workspace"}, [])
    assert key.session_id == "h"
    assert "prompt_cache_key" in OWN_BODY_FIELDS


def test_a_renamed_openwebui_header_is_one_setting_away() -> None:
    """FORWARD_SESSION_INFO_HEADER_CHAT_ID=X-My-Chat in OpenWebUI pairs with --session-header X-My-Chat."""
    assert resolve_session("m", Headers(headers={"X-My-Chat": "c"}), {}, ["s"]).source is IdSource.SYSTEM_PROMPT
    assert resolve_session("m", Headers(headers={"X-My-Chat": "c"}), {}, ["s"], ["X-My-Chat"]).session_id == "c"


# -- Claude Code -----------------------------------------------------------------------------------------------------

def messages_request(system: Any, **extra: Any) -> anthropic.MessagesRequest:
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], "system": system, **extra}
    return anthropic.parse_messages_request(body)


@pytest.mark.parametrize(("system", "kept"), [
    ([{"type": "text", "text": BILLING}, {"type": "text", "text": "You are Claude Code."},
      {"type": "text", "text": "Rules."}], ["You are Claude Code.", "Rules."]),
    ([{"type": "text", "text": BILLING + " cc_prev_req=req_1;"}, {"type": "text", "text": "P"}], ["P"]),
    ([{"type": "text", "text": BILLING + "\nYou are Claude Code."}], ["You are Claude Code."]),  # a merged block
    ([{"type": "text", "text": "P"}, {"type": "text", "text": BILLING}], ["P"]),  # not first
    (BILLING + "\nYou are Claude Code.", ["You are Claude Code."]),  # the string form
    ([{"type": "text", "text": BILLING}], []),
])
def test_the_attribution_line_is_taken_out(system: Any, kept: list[str]) -> None:
    request, removed = anthropic.without_attribution(messages_request(system))
    assert removed == 1 and anthropic.system_texts(request) == kept


def test_two_requests_differing_only_in_cch_are_one_system_prompt() -> None:
    other = BILLING.replace("fa690", "0b1c2")
    first = anthropic.without_attribution(messages_request([{"type": "text", "text": BILLING},
                                                            {"type": "text", "text": "P"}]))[0]
    second = anthropic.without_attribution(messages_request([{"type": "text", "text": other},
                                                             {"type": "text", "text": "P"}]))[0]
    assert anthropic.system_texts(first) == anthropic.system_texts(second) == ["P"]
    assert anthropic.chat_body(first, {}) == anthropic.chat_body(second, {})


def test_a_system_prompt_without_the_line_is_left_alone() -> None:
    request = messages_request([{"type": "text", "text": "mentions x-anthropic-billing-header: inside a line"}])
    assert anthropic.without_attribution(request) == (request, 0)


@pytest.mark.parametrize(("user_id", "session"), [
    (json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "0b6e-uuid"}), "0b6e-uuid"),
    ("user_" + "a" * 64 + "_account__session_7f3c2a10-5b6d-4e8f-9a01-23456789abcd",  # before v2.1.78
     "7f3c2a10-5b6d-4e8f-9a01-23456789abcd"),
    ("user_" + "a" * 64 + "_account_0c1d2e3f-4a5b-6c7d-8e9f-0a1b2c3d4e5f_session_7f3c2a10-5b6d-4e8f-9a01-23456789abcd",
     "7f3c2a10-5b6d-4e8f-9a01-23456789abcd"),
    ("user_42_session_abc", "user_42_session_abc"),  # not Claude Code's shape: the whole value, as before
    ("someone-else", "someone-else"),  # another client's user id: used as it is, a weak hint
    ("{not json", "{not json"),
    (json.dumps({"device_id": "d"}), json.dumps({"device_id": "d"})),
    (None, None),
])
def test_the_session_inside_metadata_user_id(user_id: str | None, session: str | None) -> None:
    assert anthropic.session_from_user_id(user_id) == session


def side(body: dict[str, Any], headers: dict[str, str] | None = None) -> bool:
    full = {"model": "m", "max_tokens": 512, **body}
    return anthropic.is_side_request(Headers(headers=headers or {}), anthropic.parse_messages_request(full))


TITLE_SYSTEM = ("Generate a concise, sentence-case title (3-7 words) that captures the main topic or goal of this "
                "coding session.")
TOOL = {"name": "Bash", "description": "run", "input_schema": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(("what", "body", "headers", "expected"), [
    ("session title", {"system": TITLE_SYSTEM, "messages": [{"role": "user", "content": "fix the bug"}], "tools": []},
     None, True),
    ("bash prefix", {"messages": [{"role": "user", "content": "<policy_spec>\n# Claude Code Code Bash command "
                                                              "prefix detection"}]}, None, True),
    ("subagent warm-up", {"messages": [{"role": "user", "content": "Warmup"}]}, None, True),
    ("quota probe", {"max_tokens": 1, "messages": [{"role": "user", "content": "quota"}]}, None, True),
    ("declared auxiliary", {"stream": True, "tools": [TOOL], "messages": [{"role": "user", "content": "x"}]},
     {"x-claude-code-request-class": "auxiliary"}, True),
    ("declared compaction (reads the whole history: the session's slot)",
     {"messages": [{"role": "user", "content": "Summarize this coding conversation"}]},
     {"x-claude-code-request-class": "compaction"}, False),
    ("a turn of the agent", {"stream": True, "tools": [TOOL], "messages": [{"role": "user", "content": "Warmup"}]},
     None, False),
    ("a plain question", {"messages": [{"role": "user", "content": "what does this do?"}]}, None, False),
])
def test_claude_codes_side_requests(what: str, body: dict[str, Any], headers: dict[str, str] | None,
                                    expected: bool) -> None:
    assert side(body, headers) is expected, what
