"""Table-driven tests for the OpenAI dialect: body parsing, system prompt extraction, checks, the upstream body and
error rendering."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from slotkeeper.dialects import openai
from slotkeeper.errors import (
    BadRequest,
    NotFound,
    SlotkeeperError,
    UpstreamError,
    UpstreamUnavailable,
)

# ---------------------------------------------------------------------------------------------------------------------
# parse_body


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"", "empty"),
        (b"   ", "empty"),
        (b"\n\t\r\n", "empty"),
        (b"{", "not valid JSON"),
        (b"{'a': 1}", "not valid JSON"),
        (b"hello", "not valid JSON"),
        (b'{"a": 1,}', "not valid JSON"),
        (b'{"a": 1} {"b": 2}', "not valid JSON"),
        (b"\xff\xfe\xfa", "not valid JSON"),
        (b"[]", "must be a JSON object, not list"),
        (b'[{"messages": []}]', "must be a JSON object, not list"),
        (b'"a string"', "must be a JSON object, not str"),
        (b"42", "must be a JSON object, not int"),
        (b"1.5", "must be a JSON object, not float"),
        (b"true", "must be a JSON object, not bool"),
        (b"null", "must be a JSON object"),
    ],
    ids=["empty", "spaces", "whitespace", "truncated", "single-quotes", "bare-word", "trailing-comma",
         "two-objects", "invalid-utf8", "empty-array", "array-of-object", "string", "int", "float", "bool", "null"],
)
def test_parse_body_rejects(raw: bytes, fragment: str) -> None:
    with pytest.raises(BadRequest) as info:
        openai.parse_body(raw)
    assert fragment in info.value.message
    assert info.value.status_code == 400


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"{}", {}),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
         {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        (b'  \n{"a": 1}\n  ', {"a": 1}),
        ('{"text": "caf\u00e9 \u2615"}'.encode(), {"text": "caf\u00e9 \u2615"}),
        (b'\xef\xbb\xbf{"bom": true}', {"bom": True}),
        (b'{"n": null, "f": 1.5, "l": [1, "x"]}', {"n": None, "f": 1.5, "l": [1, "x"]}),
    ],
    ids=["empty-object", "chat", "padded", "utf8", "utf8-bom", "mixed-values"],
)
def test_parse_body_accepts_objects(raw: bytes, expected: dict[str, Any]) -> None:
    assert openai.parse_body(raw) == expected


# ---------------------------------------------------------------------------------------------------------------------
# system_texts


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([{"role": "system", "content": "Be terse."}], ["Be terse."]),
        ([{"role": "developer", "content": "Dev rules."}], ["Dev rules."]),
        ([{"role": "system", "content": "A"}, {"role": "user", "content": "hi"}, {"role": "system", "content": "B"}],
         ["A", "B"]),
        ([{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}], ["S", "D"]),
        ([{"role": "system", "content": [{"type": "text", "text": "part 1"}, {"type": "text", "text": "part 2"}]}],
         ["part 1", "part 2"]),
        ([{"role": "system", "content": [{"type": "text", "text": "t"}, {"type": "image_url", "image_url": {}}]}],
         ["t"]),
        ([{"role": "system", "content": [{"type": "text"}]}], [""]),
        ([{"role": "system", "content": [{"type": "text", "text": 5}]}], ["5"]),
        ([{"role": "system", "content": ["bare string part", {"text": "no type"}, None]}], []),
        ([{"role": "system", "content": []}], []),
        ([{"role": "system", "content": ""}], [""]),
        ([{"role": "system", "content": None}], []),
        ([{"role": "system"}], []),
        ([{"role": "system", "content": {"text": "dict"}}], []),
        ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}],
         []),
        ([{"role": "System", "content": "case"}], []),
        ([{"content": "no role"}], []),
        (["not a message", 3, None, {"role": "system", "content": "ok"}], ["ok"]),
        ([], []),
    ],
    ids=["string", "developer", "several-system", "system-and-developer", "text-parts", "non-text-parts-skipped",
         "text-part-without-text", "text-part-non-string", "malformed-parts", "empty-parts", "empty-string",
         "null-content", "no-content", "dict-content", "non-system-roles", "role-case-sensitive", "no-role",
         "non-mapping-messages", "empty-list"],
)
def test_system_texts(messages: list[Any], expected: list[str]) -> None:
    assert openai.system_texts(messages) == expected


@pytest.mark.parametrize(
    "messages",
    [None, "system: hi", {"role": "system", "content": "x"}, 42, ({"role": "system", "content": "x"},)],
    ids=["none", "string", "dict", "int", "tuple"],
)
def test_system_texts_of_non_list_is_empty(messages: object) -> None:
    assert openai.system_texts(messages) == []


SYS = {"role": "system", "content": "be brief"}
HI = {"role": "user", "content": "hi"}
HELLO = {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([SYS, HI], None),
        ([SYS, HI, HELLO, {"role": "user", "content": "more"}], HELLO),
        ([HI, HELLO, {"role": "user", "content": "more"}, {"role": "assistant", "content": "later"}], HELLO),
        ([SYS, HI, {"role": "tool", "content": "42"}, HELLO], HELLO),
        ([HELLO, HI], None),  # an answer before the opening is not its answer
        ([SYS], None),
        (None, None),
        ("hi", None),
    ],
    ids=["first-turn", "second-turn", "later-turns", "after-a-tool", "answer-before-opening", "system-only", "none",
         "not-a-list"],
)
def test_first_reply_is_the_first_answer_after_the_opening(messages: object, expected: object) -> None:
    assert openai.first_reply(messages) == expected


# ---------------------------------------------------------------------------------------------------------------------
# check_chat_request / check_completion_request


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": []},
        {"messages": None},
        {"messages": "hi"},
        {"messages": {"role": "user", "content": "hi"}},
        {"prompt": "hi"},
    ],
    ids=["missing", "empty", "null", "string", "object", "prompt-instead"],
)
def test_check_chat_request_rejects(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest, match="'messages' must be a non-empty array"):
        openai.check_chat_request(body)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "model": "m"},
    ],
    ids=["one", "two"],
)
def test_check_chat_request_accepts(body: dict[str, Any]) -> None:
    assert openai.check_chat_request(body) is None


@pytest.mark.parametrize("body", [{}, {"messages": [{"role": "user", "content": "x"}]}, {"prompts": "x"}],
                         ids=["empty", "chat-body", "misspelled"])
def test_check_completion_request_rejects(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest, match="'prompt' is required"):
        openai.check_completion_request(body)


@pytest.mark.parametrize(
    "prompt",
    ["hello", "", ["a", "b"], [1, 2, 3]],
    ids=["string", "empty-string", "list-of-strings", "tokens"],
)
def test_check_completion_request_accepts(prompt: object) -> None:
    assert openai.check_completion_request({"prompt": prompt}) is None


# ---------------------------------------------------------------------------------------------------------------------
# upstream_body


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "slot", "expected"),
    [
        (CHAT, 0, {**CHAT, "id_slot": 0, "cache_prompt": True}),
        (CHAT, 3, {**CHAT, "id_slot": 3, "cache_prompt": True}),
        ({**CHAT, "session_id": "s"}, 1, {**CHAT, "id_slot": 1, "cache_prompt": True}),
        ({**CHAT, "conversation_id": "c"}, 1, {**CHAT, "id_slot": 1, "cache_prompt": True}),
        ({**CHAT, "chat_id": "c"}, 1, {**CHAT, "id_slot": 1, "cache_prompt": True}),
        ({**CHAT, "id": "chat-1"}, 1, {**CHAT, "id_slot": 1, "cache_prompt": True}),
        ({**CHAT, "id": "chatcmpl-1"}, 1, {**CHAT, "id_slot": 1, "cache_prompt": True}),
        ({**CHAT, "session_id": "s", "conversation_id": "c", "chat_id": "x", "id": 5}, 2,
         {**CHAT, "id_slot": 2, "cache_prompt": True}),
        ({**CHAT, "id_slot": 7}, 0, {**CHAT, "id_slot": 0, "cache_prompt": True}),
        ({**CHAT, "id_slot": -1}, 2, {**CHAT, "id_slot": 2, "cache_prompt": True}),
        ({**CHAT, "cache_prompt": False}, 0, {**CHAT, "id_slot": 0, "cache_prompt": True}),
        ({**CHAT, "cache_prompt": "no"}, 0, {**CHAT, "id_slot": 0, "cache_prompt": True}),
        ({"prompt": "p", "id_slot": 9, "cache_prompt": False, "session_id": "s"}, 4,
         {"prompt": "p", "id_slot": 4, "cache_prompt": True}),
        ({}, 0, {"id_slot": 0, "cache_prompt": True}),
    ],
    ids=["plain", "slot-3", "drops-session_id", "drops-conversation_id", "drops-chat_id", "drops-id",
         "drops-response-like-id", "drops-all-own-fields", "overrides-client-id_slot", "overrides-negative-id_slot",
         "overrides-cache_prompt-false", "overrides-cache_prompt-junk", "completion", "empty"],
)
def test_upstream_body(body: dict[str, Any], slot: int, expected: dict[str, Any]) -> None:
    assert openai.upstream_body(body, slot) == expected


PASS_THROUGH: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.2,
    "top_p": 0.9,
    "max_tokens": 64,
    "max_completion_tokens": 64,
    "n": 1,
    "stop": ["\n\n", "</s>"],
    "seed": 42,
    "logprobs": True,
    "top_logprobs": 3,
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "user": "someone",
    "metadata": {"k": "v"},
    "thinking_budget_tokens": 256,
    "chat_template_kwargs": {"enable_thinking": False},
    "reasoning_format": "deepseek",
    "n_probs": 2,
    "samplers": ["top_k", "temperature"],
    "grammar": "root ::= \"x\"",
    "unknown_future_field": [None, {"nested": [1, 2]}],
    "session": "not one of ours",
    "ID": "uppercase is not ours",
}


@pytest.mark.parametrize("field", sorted(PASS_THROUGH), ids=sorted(PASS_THROUGH))
def test_upstream_body_keeps_other_fields_unchanged(field: str) -> None:
    body = {**PASS_THROUGH, "session_id": "s", "id_slot": 5, "cache_prompt": False}
    forwarded = openai.upstream_body(body, 1)
    assert field in forwarded
    assert forwarded[field] == PASS_THROUGH[field]


def test_upstream_body_key_set() -> None:
    body = {**PASS_THROUGH, "session_id": "s", "conversation_id": "c", "chat_id": "x", "id": "i", "id_slot": 5,
            "cache_prompt": False}
    assert set(openai.upstream_body(body, 1)) == set(PASS_THROUGH) | {"id_slot", "cache_prompt"}


@pytest.mark.parametrize(
    "body",
    [
        {**PASS_THROUGH, "session_id": "s", "id_slot": 5, "cache_prompt": False},
        {"messages": [{"role": "user", "content": "x"}], "id": "chat", "chat_id": "c"},
        {},
    ],
    ids=["full", "own-fields", "empty"],
)
def test_upstream_body_does_not_mutate_input(body: dict[str, Any]) -> None:
    before = copy.deepcopy(body)
    forwarded = openai.upstream_body(body, 3)
    assert body == before
    assert forwarded is not body
    forwarded["extra"] = 1
    assert "extra" not in body


# ---------------------------------------------------------------------------------------------------------------------
# error_event


@pytest.mark.parametrize(
    ("error", "message", "error_type", "code"),
    [
        (BadRequest("bad thing"), "bad thing", "invalid_request_error", 400),
        (BadRequest("line one\nline two\n\nline four"), "line one\nline two\n\nline four", "invalid_request_error",
         400),
        (BadRequest('quotes " and unicode \u2615'), 'quotes " and unicode \u2615', "invalid_request_error", 400),
        (NotFound("no such model"), "no such model", "not_found_error", 404),
        (UpstreamUnavailable("backend went away"), "backend went away", "upstream_unavailable", 502),
        (SlotkeeperError("internal"), "internal", "server_error", 500),
        (UpstreamError(500, b"Internal Server Error"), "Internal Server Error", "upstream_error", 500),
        (UpstreamError(400, b'{"error": {"code": 400, "message": "context full", "type": "exceed_context_size"}}'),
         "context full", "exceed_context_size", 400),
    ],
    ids=["bad-request", "multiline-message", "quotes-unicode", "not-found", "unavailable", "generic",
         "upstream-text", "upstream-json"],
)
def test_error_event_is_one_sse_event(error: SlotkeeperError, message: str, error_type: str, code: int) -> None:
    event = openai.error_event(error)
    assert isinstance(event, bytes)
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    assert event.count(b"\n") == 2, "the JSON must be on one line so the event is not split"
    payload = json.loads(event[len(b"data: "):-2])
    assert payload == {"error": {"message": message, "type": error_type, "code": code}}


# ---------------------------------------------------------------------------------------------------------------------
# UpstreamError.openai_body


LLAMA_ERROR = {"error": {"code": 400, "message": "the request exceeds the available context size",
                         "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 8192}}


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (400, json.dumps(LLAMA_ERROR).encode(), LLAMA_ERROR),
        (503, b'{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}',
         {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}),
        (500, b'{"error": "plain string error"}', {"error": "plain string error"}),
        (500, b'{"error": {"message": "m"}, "extra": [1]}', {"error": {"message": "m"}, "extra": [1]}),
        (500, b"Internal Server Error",
         {"error": {"message": "Internal Server Error", "type": "upstream_error", "code": 500}}),
        (502, b"<html>Bad Gateway</html>\n",
         {"error": {"message": "<html>Bad Gateway</html>", "type": "upstream_error", "code": 502}}),
        (503, b"", {"error": {"message": "backend answered HTTP 503", "type": "upstream_error", "code": 503}}),
        (500, b"\xff\xfe", {"error": {"message": "\ufffd\ufffd", "type": "upstream_error", "code": 500}}),
        (404, b'{"detail": "Not Found"}',
         {"error": {"message": "backend answered HTTP 404", "type": "upstream_error", "code": 404}}),
        (500, b"[1, 2]", {"error": {"message": "backend answered HTTP 500", "type": "upstream_error", "code": 500}}),
        (500, b'"just a string"',
         {"error": {"message": "backend answered HTTP 500", "type": "upstream_error", "code": 500}}),
    ],
    ids=["llama-json", "loading-json", "string-error", "extra-fields", "text", "html", "empty", "invalid-utf8",
         "json-without-error", "json-array", "json-string"],
)
def test_upstream_error_openai_body(status: int, body: bytes, expected: dict[str, Any]) -> None:
    error = UpstreamError(status, body)
    assert error.status_code == status
    assert error.body == body
    assert error.openai_body() == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (json.dumps(LLAMA_ERROR).encode(), "the request exceeds the available context size"),
        (b'{"error": "plain string error"}', "plain string error"),
        (b"  some text  ", "some text"),
        (b"x" * 2000, "x" * 500),
        (b"", "backend answered HTTP 500"),
    ],
    ids=["json-message", "string-error", "text-stripped", "text-truncated", "empty"],
)
def test_upstream_error_message(body: bytes, message: str) -> None:
    assert UpstreamError(500, body).message == message


# ---------------------------------------------------------------------------------------------------------------------
# Responses API and embeddings helpers


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"input": "hi"}, []),
        ({"instructions": "Be brief.", "input": "hi"}, ["Be brief."]),
        ({"instructions": None, "input": "hi"}, []),
        ({"input": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]}, ["S"]),
        ({"input": [{"role": "developer", "content": [{"type": "input_text", "text": "D"}, {"type": "x"}]}]}, ["D"]),
        ({"instructions": "I", "input": [{"role": "system", "content": [{"type": "text", "text": "T"}]}]},
         ["I", "T"]),
        ({"input": [{"type": "message"}, "junk", {"role": "system", "content": 5}]}, []),
    ],
    ids=["string-input", "instructions", "null-instructions", "system-item", "developer-parts",
         "instructions-then-items", "odd-items"],
)
def test_responses_system_texts(body: dict[str, Any], expected: list[str]) -> None:
    assert openai.responses_system_texts(body) == expected


@pytest.mark.parametrize("body", [{}, {"input": ""}, {"input": []}, {"input": 5}, {"input": None}],
                         ids=["missing", "empty-string", "empty-list", "number", "null"])
def test_check_responses_request_rejects(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest, match="'input'"):
        openai.check_responses_request(body)


@pytest.mark.parametrize("body", [{"input": "hi"}, {"input": [{"role": "user", "content": "hi"}]}],
                         ids=["string", "items"])
def test_check_responses_request_accepts(body: dict[str, Any]) -> None:
    openai.check_responses_request(body)


def test_check_embeddings_request() -> None:
    openai.check_embeddings_request({"input": "x"})
    with pytest.raises(BadRequest, match="'input'"):
        openai.check_embeddings_request({"model": "m"})


def test_without_own_fields_keeps_everything_else() -> None:
    body = {"input": "x", "model": "m", "session_id": "s", "conversation_id": "c", "chat_id": "d", "id": "e",
            "dimensions": 8}
    assert openai.without_own_fields(body) == {"input": "x", "model": "m", "dimensions": 8}
