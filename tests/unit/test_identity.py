"""Table-driven tests for session identity: the precedence promised to users, id validation and snapshot file names."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import Headers

from slotkeeper.errors import BadRequest
from slotkeeper.serving.identity import (
    CHAT_PREFIX,
    DEFAULT_SESSION,
    MAX_ID_LENGTH,
    conversation_id,
    is_side_task,
    resolve_session,
    session_group,
    system_session_id,
)
from slotkeeper.types import IdSource, SessionKey

MODEL = "tiny"
HEX40 = re.compile(r"[0-9a-f]{40}")
EXTRA_HEADERS = ("X-Team-Chat", "X-Other-Chat")


def resolve(
    headers: Mapping[str, str] | None = None,
    body: Mapping[str, object] | None = None,
    system: Sequence[str] = (),
    extra: Iterable[str] = EXTRA_HEADERS,
    model: str = MODEL,
) -> SessionKey:
    return resolve_session(model, Headers(headers=dict(headers or {})), dict(body or {}), list(system), extra)


def expected_sys_id(*texts: str) -> str:
    return "sys-" + hashlib.sha256("\n\n".join(texts).encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------------
# The precedence list, highest first. Each rule: (name, kind, key). Headers are sent with mixed-case names.

PRECEDENCE: list[tuple[str, str, str]] = [
    ("X-Session-Id", "header", "X-Session-Id"),
    ("X-Conversation-Id", "header", "X-Conversation-Id"),
    ("Session-Id", "header", "Session-Id"),
    ("Conversation-Id", "header", "Conversation-Id"),
    ("X-OpenWebUI-Chat-Id", "header", "X-OpenWebUI-Chat-Id"),
    ("extra-1", "header", "X-Team-Chat"),
    ("extra-2", "header", "X-Other-Chat"),
    ("body.session_id", "body", "session_id"),
    ("body.conversation_id", "body", "conversation_id"),
    ("body.chat_id", "body", "chat_id"),
    ("body.id", "body", "id"),
    ("system", "system", ""),
    ("default", "default", ""),
]
RULE_IDS = [name for name, _, _ in PRECEDENCE]


def apply_rule(rule: tuple[str, str, str], value: str, request: dict[str, Any]) -> tuple[str, IdSource]:
    """Put `value` where `rule` reads it; return the (session id, source) the rule yields when it wins."""
    _, kind, key = rule
    if kind == "header":
        request["headers"][key] = value
        return value, IdSource.HEADER
    if kind == "body":
        request["body"][key] = value
        return value, IdSource.BODY
    if kind == "system":
        request["system"].append(value)
        return expected_sys_id(value), IdSource.SYSTEM_PROMPT
    return DEFAULT_SESSION, IdSource.DEFAULT


def empty_request() -> dict[str, Any]:
    return {"headers": {}, "body": {}, "system": []}


@pytest.mark.parametrize("rule", PRECEDENCE, ids=RULE_IDS)
def test_each_rule_alone(rule: tuple[str, str, str]) -> None:
    request = empty_request()
    expected = apply_rule(rule, f"value-of-{rule[0]}", request)
    key = resolve(**request)
    assert (key.session_id, key.source) == expected
    assert key.model == MODEL


@pytest.mark.parametrize(
    ("winner", "loser"),
    list(itertools.combinations(PRECEDENCE, 2)),
    ids=[f"{a[0]}>{b[0]}" for a, b in itertools.combinations(PRECEDENCE, 2)],
)
def test_higher_rule_beats_lower_rule(winner: tuple[str, str, str], loser: tuple[str, str, str]) -> None:
    request = empty_request()
    apply_rule(loser, f"loser-{loser[0]}", request)
    expected = apply_rule(winner, f"winner-{winner[0]}", request)
    key = resolve(**request)
    assert (key.session_id, key.source) == expected


def test_all_rules_at_once_the_first_wins() -> None:
    request = empty_request()
    results = [apply_rule(rule, f"v-{rule[0]}", request) for rule in reversed(PRECEDENCE)]
    assert (resolve(**request).session_id, resolve(**request).source) == results[-1]


# ---------------------------------------------------------------------------------------------------------------------
# Headers


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"X-SESSION-ID": "a"}, "a"),
        ({"x-session-id": "a"}, "a"),
        ({"x-SeSsIoN-iD": "a"}, "a"),
        ({"CONVERSATION-ID": "c"}, "c"),
        ({"x-openwebui-chat-id": "w"}, "w"),
        ({"X-OPENWEBUI-CHAT-ID": "w"}, "w"),
        ({"x-team-chat": "t"}, "t"),
        ({"X-TEAM-CHAT": "t"}, "t"),
    ],
    ids=["upper", "lower", "mixed", "conversation-upper", "openwebui-lower", "openwebui-upper", "extra-lower",
         "extra-upper"],
)
def test_header_names_are_case_insensitive(headers: dict[str, str], expected: str) -> None:
    key = resolve(headers=headers)
    assert key.session_id == expected
    assert key.source is IdSource.HEADER


@pytest.mark.parametrize(
    "extra",
    [("X-Team-Chat",), ("x-team-chat",), ("X-TEAM-CHAT",)],
    ids=["mixed", "lower", "upper"],
)
def test_configured_extra_header_names_are_case_insensitive(extra: tuple[str, ...]) -> None:
    # resolve_session documents that a plain dict must be lower-cased; the configured names may be any case.
    key = resolve_session(MODEL, {"x-team-chat": "t"}, {}, [], extra)
    assert key.session_id == "t"


def test_lower_cased_plain_dict_is_accepted() -> None:
    key = resolve_session(MODEL, {"x-conversation-id": "abc"}, {}, [])
    assert (key.session_id, key.source) == ("abc", IdSource.HEADER)


def test_extra_headers_in_the_order_given() -> None:
    headers = {"X-A": "a", "X-B": "b"}
    assert resolve(headers=headers, extra=("X-A", "X-B")).session_id == "a"
    assert resolve(headers=headers, extra=("X-B", "X-A")).session_id == "b"


def test_unconfigured_header_is_ignored() -> None:
    key = resolve(headers={"X-Team-Chat": "t"}, extra=())
    assert key.source is IdSource.DEFAULT


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({"X-Session-Id": ""}, {}, DEFAULT_SESSION),
        ({"X-Session-Id": "   "}, {}, DEFAULT_SESSION),
        ({"X-Session-Id": " \t "}, {}, DEFAULT_SESSION),
        ({"X-Session-Id": "  ", "X-Conversation-Id": "conv"}, {}, "conv"),
        ({"X-Session-Id": "  ", "X-OpenWebUI-Chat-Id": "web"}, {}, "web"),
        ({"X-Session-Id": " "}, {"session_id": "body"}, "body"),
        ({}, {"session_id": "   ", "conversation_id": "conv"}, "conv"),
        ({}, {"session_id": "", "chat_id": "chat"}, "chat"),
        ({}, {"chat_id": "\t", "id": "plain"}, "plain"),
        ({"X-Session-Id": "  padded  "}, {}, "padded"),
        ({}, {"session_id": "  padded  "}, "padded"),
    ],
    ids=["header-empty", "header-spaces", "header-tab", "falls-to-next-header", "falls-to-openwebui",
         "falls-to-body", "body-spaces", "body-empty", "body-tab", "header-stripped", "body-stripped"],
)
def test_whitespace_only_values_are_skipped(
    headers: dict[str, str], body: dict[str, object], expected: str
) -> None:
    assert resolve(headers=headers, body=body).session_id == expected


# ---------------------------------------------------------------------------------------------------------------------
# Body values


@pytest.mark.parametrize(
    "value",
    [True, False, None, {"a": 1}, {}, [1, 2], [], 1.5],
    ids=["true", "false", "none", "dict", "empty-dict", "list", "empty-list", "float"],
)
@pytest.mark.parametrize("field", ["session_id", "conversation_id", "chat_id", "id"])
def test_non_id_body_values_are_ignored(field: str, value: object) -> None:
    key = resolve(body={field: value})
    assert key.source is IdSource.DEFAULT
    assert key.session_id == DEFAULT_SESSION


@pytest.mark.parametrize("value", [True, None, {"x": "y"}], ids=["bool", "none", "dict"])
def test_ignored_body_value_falls_through_to_next_field(value: object) -> None:
    key = resolve(body={"session_id": value, "conversation_id": "next"})
    assert (key.session_id, key.source) == ("next", IdSource.BODY)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(42, "42"), (0, "0"), (-7, "-7"), (10**20, "100000000000000000000")],
    ids=["int", "zero", "negative", "big"],
)
@pytest.mark.parametrize("field", ["session_id", "conversation_id", "chat_id", "id"])
def test_int_body_values_are_accepted(field: str, value: int, expected: str) -> None:
    key = resolve(body={field: value})
    assert (key.session_id, key.source) == (expected, IdSource.BODY)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"id": "chatcmpl-abc123"}, DEFAULT_SESSION),
        ({"id": "cmpl-abc123"}, DEFAULT_SESSION),
        ({"id": "msg_01XYZ"}, DEFAULT_SESSION),
        ({"id": "resp_123"}, DEFAULT_SESSION),
        ({"id": "  chatcmpl-abc  "}, DEFAULT_SESSION),
        ({"id": "chat-123"}, "chat-123"),
        ({"id": "msg-1"}, "msg-1"),
        ({"id": "resp"}, "resp"),
        ({"id": "my-chatcmpl-1"}, "my-chatcmpl-1"),
        ({"id": 7}, "7"),
        ({"session_id": "chatcmpl-1"}, "chatcmpl-1"),
        ({"conversation_id": "msg_1"}, "msg_1"),
        ({"chat_id": "resp_1"}, "resp_1"),
    ],
    ids=["chatcmpl", "cmpl", "msg_", "resp_", "padded-chatcmpl", "chat-", "msg-hyphen", "resp-bare",
         "prefix-not-at-start", "int-id", "session_id-keeps-prefix", "conversation_id-keeps-prefix",
         "chat_id-keeps-prefix"],
)
def test_body_id_response_prefixes(body: dict[str, object], expected: str) -> None:
    assert resolve(body=body).session_id == expected


def test_response_like_id_falls_through_to_system_prompt() -> None:
    key = resolve(body={"id": "chatcmpl-1"}, system=["You are terse."])
    assert (key.session_id, key.source) == (expected_sys_id("You are terse."), IdSource.SYSTEM_PROMPT)


# ---------------------------------------------------------------------------------------------------------------------
# System prompt and default


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (["You are helpful."], ["You are helpful."], True),
        (["You are helpful."], ["You are terse."], False),
        (["a", "b"], ["a", "b"], True),
        (["a", "b"], ["b", "a"], False),
        (["a", "b"], ["a\n\nb"], True),
        (["a"], ["a "], False),
        (["A"], ["a"], False),
    ],
    ids=["identical", "different", "two-identical", "order-matters", "joined-by-blank-line", "trailing-space",
         "case-sensitive"],
)
def test_system_prompt_ids(a: list[str], b: list[str], same: bool) -> None:
    ka, kb = resolve(system=a), resolve(system=b)
    assert ka.source is kb.source is IdSource.SYSTEM_PROMPT
    assert (ka.session_id == kb.session_id) is same
    assert (ka == kb) is same


@pytest.mark.parametrize(
    "texts",
    [["You are helpful."], ["one", "two"], ["héllo ☕"], ["x" * 10_000]],
    ids=["one", "two", "unicode", "long"],
)
def test_system_session_id_format(texts: list[str]) -> None:
    sid = resolve(system=texts).session_id
    assert sid == expected_sys_id(*texts) == system_session_id(texts)
    assert re.fullmatch(r"sys-[0-9a-f]{16}", sid)


AGENT_A = {"role": "user", "content": "fix the failing test in parser.py"}
AGENT_B = {"role": "user", "content": "write the release notes"}


REPLY = {"role": "assistant", "content": "Looking at parser.py now."}


def test_conversations_on_one_system_prompt_are_told_apart_by_their_first_message() -> None:
    system = ["You are a coding agent."]
    a1 = resolve_session("m", {}, {}, system, opening=AGENT_A, reply=REPLY)
    b1 = resolve_session("m", {}, {}, system, opening=AGENT_B, reply=REPLY)
    assert a1 != b1 and a1.source is b1.source is IdSource.SYSTEM_PROMPT
    # The later turns of each keep its id: its first message and the first answer name it.
    assert resolve_session("m", {}, {}, system, opening=dict(AGENT_A), reply=dict(REPLY)) == a1
    group = system_session_id(system)
    assert re.fullmatch(group.replace("-", "\\-") + r"\.c[0-9a-f]{12}", a1.session_id), a1.session_id
    assert session_group(a1.session_id) == session_group(b1.session_id) == group
    assert a1.session_id == conversation_id(system, AGENT_A, REPLY)
    # Keys that never change what the model sees do not make another conversation.
    marked = {**AGENT_A, "cache_control": {"type": "ephemeral"}}
    assert resolve_session("m", {}, {}, system, opening=marked, reply=REPLY) == a1
    # Another system prompt, the same first message: another group.
    other = resolve_session("m", {}, {}, ["You are a reviewer."], opening=AGENT_A, reply=REPLY)
    assert other != a1 and session_group(other.session_id) != group


@pytest.mark.parametrize("system", [[], ["You are a helpful assistant."]], ids=["no-system", "system"])
def test_two_chats_that_open_alike_are_two_conversations(system: list[str]) -> None:
    """Confirmed at 99614b5 (#38): two chats without an id that both opened with "hi" had one name, so each chat's
    saved state replaced the other's. The first answer names a conversation too, and a first turn (no answer yet)
    is a conversation of its own."""
    hi = {"role": "user", "content": "hi"}
    first_1 = resolve_session("m", {}, {}, system, opening=hi)
    first_2 = resolve_session("m", {}, {}, system, opening=dict(hi))
    assert first_1 != first_2 and not first_1.is_default
    assert re.fullmatch(r"(chat-[0-9a-f]{16}|sys-[0-9a-f]{16}\.c[0-9a-f]{12})\.t[0-9a-f]{8}", first_1.session_id)
    assert resolve_session("m", {}, {}, system, opening=hi, first_turn_tag="0000abcd").session_id.endswith(".t0000abcd")
    chat_1 = resolve_session("m", {}, {}, system, opening=hi, reply={"role": "assistant", "content": "Hello!"})
    chat_2 = resolve_session("m", {}, {}, system, opening=hi, reply={"role": "assistant", "content": "Hi there."})
    assert len({chat_1, chat_2, first_1, first_2}) == 4
    again = resolve_session("m", {}, {}, system, opening=hi, reply={"role": "assistant", "content": " Hello! "})
    assert again == chat_1  # its text as the name sees it (spaces folded), whatever turn it is
    # An agent's first answer is often a call with no text: the calls tell two apart, not the ids clients make.
    def call(path: str, call_id: str) -> dict[str, object]:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "read", "arguments": f'{{"path": "{path}"}}'}}]}

    reads_a = resolve_session("m", {}, {}, system, opening=hi, reply=call("a.py", "call_1"))
    assert resolve_session("m", {}, {}, system, opening=hi, reply=call("a.py", "call_9")) == reads_a
    assert resolve_session("m", {}, {}, system, opening=hi, reply=call("b.py", "call_1")) != reads_a
    # The name of a branch (a state a conversation left, kept by the store) is slotkeeper's own: never a client's.
    with pytest.raises(BadRequest, match="a conversation left"):
        resolve_session("m", {"x-session-id": chat_1.session_id + "~0011aabb"}, {}, system, opening=hi)
    assert resolve_session("m", {"x-session-id": "mine~0011aabb"}, {}, system).session_id == "mine~0011aabb"
    # A client may send the name back, for its own conversation only.
    echoed = resolve_session("m", {"x-session-id": chat_1.session_id}, {}, system, opening=hi,
                             reply={"role": "assistant", "content": "Hello!"})
    assert echoed == chat_1
    with pytest.raises(BadRequest, match="another conversation"):
        resolve_session("m", {"x-session-id": chat_2.session_id}, {}, system, opening=hi,
                        reply={"role": "assistant", "content": "Hello!"})


def test_a_system_prompt_alone_is_its_group_and_explicit_ids_still_win() -> None:
    system = ["You are a coding agent."]
    assert resolve_session("m", {}, {}, system).session_id == system_session_id(system)
    assert resolve_session("m", {"x-session-id": "s1"}, {}, system, opening=AGENT_A).session_id == "s1"
    assert session_group("s1") is None and session_group("default") is None


def test_without_an_id_or_a_system_prompt_a_chat_is_named_by_its_first_message() -> None:
    """OpenWebUI with its default settings sends neither: each chat is still a conversation of its own. Only a
    request without any message is the catch-all `default`."""
    first = resolve_session("m", {}, {}, [], opening=AGENT_A, reply=REPLY)
    assert first.source is IdSource.MESSAGES and first.session_id.startswith(CHAT_PREFIX) and not first.is_default
    assert resolve_session("m", {}, {}, [], opening={"role": "user", "content": "another chat"}, reply=REPLY) != first
    assert resolve_session("m", {}, {}, []).is_default
    assert session_group(first.session_id) is None


def test_a_name_survives_a_moved_reminder_and_text_parts() -> None:
    """Agents move `<system-reminder>` blocks in and out of the first user message between runs, and send its
    text as a string or as parts: the conversation keeps its name (the tokens decide reuse anyway)."""
    system = ["You are a coding agent."]
    plain = {"role": "user", "content": "fix the failing test"}
    reminded = {"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nToday is Monday.\n</system-reminder>"},
        {"type": "text", "text": "fix the failing test"}]}
    inline = {"role": "user", "content": "<system-reminder>Today is Tuesday.</system-reminder>\nfix the failing test"}
    names = {resolve_session("m", {}, {}, system, opening=o, reply=REPLY).session_id for o in (plain, reminded, inline)}
    assert len(names) == 1
    other = {"role": "user", "content": "fix the failing build"}
    assert resolve_session("m", {}, {}, system, opening=other, reply=REPLY).session_id not in names


def test_the_side_state_prefix_is_not_a_clients_id() -> None:
    with pytest.raises(BadRequest, match="keeps for the names it makes itself"):
        resolve_session("m", {"x-session-id": "~side-0123456789abcdef"}, {}, [])


@pytest.mark.parametrize("where", ["header", "body"])
def test_the_catch_all_name_is_not_a_clients_id(where: str) -> None:
    """Confirmed at 99614b5 (#38): an explicit id `default` made a conversation equal to the catch-all session
    (a key's source takes no part in equality), so a request without an id or any message took its slot, ran over
    its state and marked it clean: the conversation's finished turn never reached disk."""
    headers, body = ({"x-session-id": "default"}, {}) if where == "header" else ({}, {"session_id": " default "})
    with pytest.raises(BadRequest, match="without an id or any message"):
        resolve_session("m", headers, body, [], opening={"role": "user", "content": "hi"})
    assert resolve_session("m", {"x-session-id": "Default"}, {}, []).session_id == "Default"


@pytest.mark.parametrize("texts", [[], [""], ["", ""]], ids=["none", "one-empty", "two-empty"])
def test_empty_system_texts_give_default(texts: list[str]) -> None:
    key = resolve(system=texts)
    assert (key.session_id, key.source) == (DEFAULT_SESSION, IdSource.DEFAULT)
    assert key.is_default


@pytest.mark.parametrize(
    ("request_kwargs", "is_default"),
    [
        ({}, True),
        ({"headers": {"X-Session-Id": "a"}}, False),
        ({"body": {"chat_id": "a"}}, False),
        ({"system": ["s"]}, False),
    ],
    ids=["default", "header", "body", "system"],
)
def test_is_default(request_kwargs: dict[str, Any], is_default: bool) -> None:
    assert resolve(**request_kwargs).is_default is is_default


# ---------------------------------------------------------------------------------------------------------------------
# Model namespacing and SessionKey equality


@pytest.mark.parametrize(
    "request_kwargs",
    [{"headers": {"X-Session-Id": "same"}}, {"body": {"session_id": "same"}}, {"system": ["sys"]}, {}],
    ids=["header", "body", "system", "default"],
)
def test_same_id_under_two_models_differs(request_kwargs: dict[str, Any]) -> None:
    a = resolve(model="model-a", **request_kwargs)
    b = resolve(model="model-b", **request_kwargs)
    assert a.session_id == b.session_id
    assert a != b
    assert a.file_stem("fp") != b.file_stem("fp")


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (IdSource.HEADER, IdSource.BODY),
        (IdSource.BODY, IdSource.SYSTEM_PROMPT),
        (IdSource.SYSTEM_PROMPT, IdSource.DEFAULT),
        (IdSource.HEADER, IdSource.DEFAULT),
    ],
    ids=["header-body", "body-system", "system-default", "header-default"],
)
def test_session_key_equality_ignores_source(left: IdSource, right: IdSource) -> None:
    a, b = SessionKey(MODEL, "x", left), SessionKey(MODEL, "x", right)
    assert a == b
    assert hash(a) == hash(b)
    assert a.file_stem("fp") == b.file_stem("fp")
    assert len({a, b}) == 1


def test_header_and_body_with_same_id_are_the_same_session() -> None:
    a = resolve(headers={"X-Session-Id": "shared"})
    b = resolve(body={"session_id": "shared"})
    assert (a.source, b.source) == (IdSource.HEADER, IdSource.BODY)
    assert a == b


def test_session_key_str() -> None:
    assert str(SessionKey("m", "s")) == "m/s"


# ---------------------------------------------------------------------------------------------------------------------
# Id validation


@pytest.mark.parametrize(
    "value",
    [
        "x" * (MAX_ID_LENGTH + 1),
        "x" * 1000,
        "a\x00b",
        "a\nb",
        "a\rb",
        "a\tb",
        "a\x1bb",
        "a\x7fb",
        "\x00",
    ],
    ids=["257-chars", "1000-chars", "nul", "newline", "cr", "tab-inside", "escape", "del", "only-nul"],
)
@pytest.mark.parametrize("where", ["header", "extra-header", "body.session_id", "body.id"])
def test_invalid_ids_raise_bad_request(where: str, value: str) -> None:
    headers: dict[str, str] = {}
    body: dict[str, object] = {}
    if where == "header":
        headers["x-session-id"] = value
    elif where == "extra-header":
        headers["x-team-chat"] = value
    else:
        body[where.removeprefix("body.")] = value
    with pytest.raises(BadRequest) as info:
        resolve_session(MODEL, headers, body, [], EXTRA_HEADERS)
    assert info.value.status_code == 400
    assert "session id" in info.value.message


def test_invalid_higher_precedence_id_is_an_error_not_a_fallback() -> None:
    with pytest.raises(BadRequest):
        resolve_session(MODEL, {"x-session-id": "bad\x00id"}, {"session_id": "good"}, [])


@pytest.mark.parametrize(
    "value",
    [
        "x" * MAX_ID_LENGTH,
        "  " + "x" * MAX_ID_LENGTH + "  ",
        "\U0001f999" * MAX_ID_LENGTH,
        "\nnewline-at-edges\n",
        "\tpadded-with-tabs\t",
    ],
    ids=["256-chars", "256-after-strip", "256-astral-chars", "newline-edges-stripped", "tab-edges-stripped"],
)
def test_boundary_ids_are_accepted(value: str) -> None:
    key = resolve_session(MODEL, {"x-session-id": value}, {}, [])
    assert key.session_id == value.strip()


@pytest.mark.parametrize(
    "value",
    ["café", "会话-42", "🦙 llama", "Ωmega", "ñ/ü\\ä", "id with spaces"],
    ids=["latin", "cjk", "emoji", "greek", "slashes", "spaces"],
)
@pytest.mark.parametrize("where", ["header", "body"])
def test_unicode_ids_are_accepted(where: str, value: str) -> None:
    if where == "header":
        key = resolve_session(MODEL, {"x-session-id": value}, {}, [])
    else:
        key = resolve_session(MODEL, {}, {"session_id": value}, [])
    assert key.session_id == value
    assert HEX40.fullmatch(key.file_stem("fp"))


@pytest.mark.parametrize(
    "raw_body",
    [r'{"session_id": "\ud800"}', r'{"chat_id": "abc\udfff"}', r'{"id": "x\ud83d"}'],
    ids=["lone-high-surrogate", "lone-low-surrogate", "truncated-pair"],
)
def test_lone_surrogate_body_id_is_rejected_or_usable(raw_body: str) -> None:
    # json.loads accepts a lone \uXXXX surrogate escape, so a client can send one. Such an id must either be
    # refused with a 400 or be usable end to end (its snapshot file name computed), never crash later.
    body = json.loads(raw_body)
    try:
        key = resolve_session(MODEL, {}, body, [])
    except BadRequest:
        return
    assert HEX40.fullmatch(key.file_stem("fp"))


def test_lone_surrogate_in_system_prompt_is_rejected_or_usable() -> None:
    texts = [json.loads(r'"You are \ud800 helpful"')]
    try:
        key = resolve_session(MODEL, {}, {}, texts)
    except BadRequest:
        return
    assert key.source is IdSource.SYSTEM_PROMPT
    assert HEX40.fullmatch(key.file_stem("fp"))


# ---------------------------------------------------------------------------------------------------------------------
# SessionKey.file_stem


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("fp1", "m", "s"), ("fp2", "m", "s")),
        (("fp", "m1", "s"), ("fp", "m2", "s")),
        (("fp", "m", "s1"), ("fp", "m", "s2")),
        (("fp", "m", "S"), ("fp", "m", "s")),
        (("fp", "ab", "c"), ("fp", "a", "bc")),
    ],
    ids=["fingerprint", "model", "session", "case", "field-boundary"],
)
def test_file_stem_differs(a: tuple[str, str, str], b: tuple[str, str, str]) -> None:
    stem_a = SessionKey(a[1], a[2]).file_stem(a[0])
    stem_b = SessionKey(b[1], b[2]).file_stem(b[0])
    assert HEX40.fullmatch(stem_a)
    assert HEX40.fullmatch(stem_b)
    assert stem_a != stem_b


def test_file_stem_is_stable() -> None:
    assert SessionKey("m", "s").file_stem("fp") == SessionKey("m", "s").file_stem("fp")


@pytest.mark.parametrize(
    "session_id",
    ["../../etc/passwd", "/etc/passwd", "..", ".", "a/b\\c", "C:\\Windows\\win.ini", "name.gguf", "~root", "*?[]"],
    ids=["dotdot", "absolute", "parent", "current", "slashes", "windows", "extension", "tilde", "glob"],
)
def test_file_stem_of_path_like_id_is_only_hex(session_id: str) -> None:
    key = resolve_session(MODEL, {"x-session-id": session_id}, {}, [])
    assert key.session_id == session_id
    assert HEX40.fullmatch(key.file_stem("fingerprint"))


# ---------------------------------------------------------------------------------------------------------------------
# Property


def _valid_id(text: str) -> bool:
    stripped = text.strip()
    return bool(stripped) and len(stripped) <= MAX_ID_LENGTH and not stripped.startswith("~side-") and (
        stripped != "default") and not any(
        ord(ch) < 0x20 or ord(ch) == 0x7F for ch in stripped
    )


@given(text=st.text(max_size=300).filter(_valid_id), fingerprint=st.text(max_size=20))
def test_any_valid_header_id_round_trips(text: str, fingerprint: str) -> None:
    key = resolve_session(MODEL, {"x-session-id": text}, {"session_id": "ignored"}, ["ignored"])
    assert key.session_id == text.strip()
    assert key.source is IdSource.HEADER
    assert HEX40.fullmatch(key.file_stem(fingerprint))


def test_opencodes_title_request_is_a_side_request() -> None:
    """OpenCode sends it streamed, under the conversation's id, just before a new conversation's first request."""
    title = [{"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
             {"role": "user", "content": "Generate a title for this conversation:\n"},
             {"role": "user", "content": '"Read calc.py"'}]
    assert is_side_task({}, title, stream=True)
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are a title generator."}]}]
    assert is_side_task({}, parts, stream=True)
    main = [{"role": "system", "content": "You are opencode, an interactive CLI tool."}, title[2]]
    assert not is_side_task({}, main, stream=True)
