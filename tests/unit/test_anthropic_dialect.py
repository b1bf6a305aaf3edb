"""Table-driven tests for the Anthropic dialect: request validation, translation to the backend's chat body, the
answer as an Anthropic message, errors, and the stream encoder (one named test per streaming edge case)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from slotkeeper.dialects import anthropic
from slotkeeper.dialects.framing import KEEPALIVE, SseDecoder, UpstreamEvent
from slotkeeper.errors import BadRequest, NotFound, SlotkeeperError, UpstreamError, UpstreamUnavailable

USER = {"role": "user", "content": "hi"}


def request(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 16, "messages": [USER], **fields}


def parsed(**fields: Any) -> anthropic.MessagesRequest:
    return anthropic.parse_messages_request(request(**fields))


def chat(**fields: Any) -> dict[str, Any]:
    return anthropic.chat_body(parsed(**fields), request(**fields))


# ---------------------------------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"model": "m", "messages": [USER]}, "max_tokens: Field required"),
        ({"model": "m", "max_tokens": 5}, "messages: Field required"),
        ({"max_tokens": 5, "messages": [USER]}, "model: Field required"),
        (request(messages=[]), "messages: List should have at least 1 item"),
        (request(messages="hi"), "messages: Input should be a valid list"),
        (request(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
        (request(max_tokens="many"), "max_tokens: Input should be a valid integer"),
        (request(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
        (request(messages=[{"role": "user"}]), "messages.0.content: Field required"),
        (request(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
        (request(messages=[{"role": "user", "content": [{"type": "bogus"}]}]), "'bogus'"),
        (request(messages=[{"role": "user", "content": [{"type": "text"}]}]), "text: Field required"),
        (request(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]),
         "source"),
        (request(messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA"}}]}]),
         "source.type"),
        (request(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                               "input": "[]"}]}]), "input"),
        (request(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]), "tool_use_id: Field required"),
        (request(system=5), "system"),
        (request(system=[{"type": "image"}]), "system"),
        (request(tools=[{"description": "no name"}]), "tools.0.name: Field required"),
        (request(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "not supported"),
        (request(tool_choice={"type": "tool"}), "needs a 'name'"),
        (request(tool_choice={"type": "sometimes"}), "tool_choice.type"),
        (request(tool_choice="auto"), "tool_choice"),
        (request(thinking={"type": "maybe"}), "thinking.type"),
        (request(thinking={"type": "enabled", "budget_tokens": -1}), "budget_tokens"),
        (request(temperature=-0.5), "temperature"),
        (request(top_p=1.5), "top_p"),
        (request(top_k=-1), "top_k"),
        (request(stop_sequences="END"), "stop_sequences"),
        (request(stream="yes"), "stream"),
        (request(metadata={"user_id": 5}), "metadata.user_id"),
    ],
    ids=["no-max-tokens", "no-messages", "no-model", "empty-messages", "messages-not-list", "max-tokens-zero",
         "max-tokens-text", "tool-role-in-messages", "no-content", "content-number", "unknown-block",
         "text-without-text", "image-file-source", "pdf-document", "tool-input-not-object", "tool-result-no-id",
         "system-number", "system-image", "tool-without-name", "server-tool", "tool-choice-tool-no-name",
         "tool-choice-unknown", "tool-choice-string", "thinking-unknown", "thinking-negative-budget",
         "negative-temperature", "top-p-above-one", "negative-top-k", "stop-sequences-string", "stream-not-bool",
         "user-id-number"],
)
def test_parse_messages_request_rejects(body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(BadRequest) as info:
        anthropic.parse_messages_request(body)
    assert info.value.status_code == 400
    assert fragment in info.value.message
    assert info.value.message.startswith("invalid request: ")


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"system": "Be brief."},
        {"system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]},
        {"system": []},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                    "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]},
        {"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}}]}]},
        {"messages": [USER, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig"}, {"type": "redacted_thinking", "data": "x"},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok", "is_error": True}]}]},
        {"tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"},
                    "cache_control": {"type": "ephemeral"}}, {"name": "g", "type": "custom"}]},
        {"tool_choice": {"type": "auto"}},
        {"tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
        {"tool_choice": {"type": "tool", "name": "f"}},
        {"tool_choice": {"type": "none"}},
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"thinking": {"type": "disabled"}},
        {"thinking": {"type": "adaptive"}},
        {"metadata": {"user_id": "user_abc_session_1"}},
        {"metadata": {}},
        {"stop_sequences": ["END", "\n\nHuman:"], "stream": True, "temperature": 0.2, "top_p": 0.9, "top_k": 40},
        {"service_tier": "auto", "container": None, "output_config": {"effort": "high"}, "speed": "fast"},
    ],
    ids=["minimal", "system-string", "system-blocks-cache-control", "system-empty-list", "block-cache-control",
         "images-and-document", "tool-round-trip", "tools", "tool-choice-auto", "tool-choice-any",
         "tool-choice-tool", "tool-choice-none", "thinking-enabled", "thinking-disabled", "thinking-adaptive",
         "metadata-user-id", "metadata-empty", "sampling", "ignored-anthropic-fields"],
)
def test_parse_messages_request_accepts(fields: dict[str, Any]) -> None:
    assert anthropic.parse_messages_request(request(**fields)).model == "tiny"


def test_count_tokens_request_needs_no_max_tokens() -> None:
    counted = anthropic.parse_count_tokens_request({"model": "m", "messages": [USER]})
    assert anthropic.count_tokens_body(counted) == {"messages": [USER]}


def test_count_tokens_request_still_needs_messages() -> None:
    with pytest.raises(BadRequest, match="messages"):
        anthropic.parse_count_tokens_request({"model": "m"})


def test_count_tokens_body_includes_tools_and_system() -> None:
    counted = anthropic.parse_count_tokens_request({"model": "m", "system": "S", "messages": [USER],
                                                    "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    assert anthropic.count_tokens_body(counted) == {
        "messages": [{"role": "system", "content": "S"}, USER],
        "tools": [{"type": "function", "function": {"name": "f", "description": "",
                                                    "parameters": {"type": "object"}}}],
    }


def test_validation_error_skips_string_branch_noise() -> None:
    with pytest.raises(BadRequest) as info:
        anthropic.parse_messages_request(request(messages=[{"role": "user", "content": [{"type": "bogus"}]}]))
    assert "valid string" not in info.value.message


# ---------------------------------------------------------------------------------------------------------------------
# system texts (session rules) and the metadata hint


@pytest.mark.parametrize(
    ("system", "expected"),
    [
        (None, []),
        ("S", ["S"]),
        ("", [""]),
        ([{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}],
         ["A", "B"]),
        ([], []),
    ],
    ids=["none", "string", "empty-string", "blocks", "empty-blocks"],
)
def test_system_texts(system: Any, expected: list[str]) -> None:
    fields = {} if system is None else {"system": system}
    assert anthropic.system_texts(parsed(**fields)) == expected


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [(None, None), ({}, None), ({"user_id": "u-1"}, "u-1"), ({"user_id": None}, None)],
    ids=["absent", "empty", "user-id", "null-user-id"],
)
def test_metadata_user_id(metadata: Any, expected: str | None) -> None:
    fields = {} if metadata is None else {"metadata": metadata}
    assert anthropic.metadata_user_id(parsed(**fields)) == expected


# ---------------------------------------------------------------------------------------------------------------------
# chat_messages: Anthropic content -> OpenAI chat messages

TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}}
TOOL_CALL = {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, [USER]),
        ({"system": "S"}, [{"role": "system", "content": "S"}, USER]),
        ({"system": ""}, [USER]),
        ({"system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}]},
         [{"role": "system", "content": "S"}, USER]),
        ({"system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
         [{"role": "system", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}, USER]),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "one"}]}]},
         [{"role": "user", "content": "one"}]),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
         [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
        ({"messages": [{"role": "user", "content": []}]}, [{"role": "user", "content": ""}]),
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "see"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}]}]},
         [{"role": "user", "content": [{"type": "text", "text": "see"},
                                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]}]),
        ({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}}]}]},
         [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}]),
        ({"messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "the doc"}},
            {"type": "text", "text": "summarise"}]}]},
         [{"role": "user", "content": [{"type": "text", "text": "the doc"}, {"type": "text", "text": "summarise"}]}]),
        ({"messages": [USER, {"role": "assistant", "content": "hello"}]},
         [USER, {"role": "assistant", "content": "hello"}]),
        # Claude Code opens and resumes with `[user, system]`; llama-server takes the system message in its place.
        ({"messages": [USER, {"role": "system", "content": "resume here"}]},
         [USER, {"role": "system", "content": "resume here"}]),
        ({"messages": [USER, {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                          "text": "b"}]}]},
         [USER, {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
        ({"messages": [USER, {"role": "assistant", "content": [TOOL_USE]}]},
         [USER, {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}]),
        ({"messages": [USER, {"role": "assistant", "content": [{"type": "text", "text": "let me look"}, TOOL_USE]}]},
         [USER, {"role": "assistant", "content": "let me look", "tool_calls": [TOOL_CALL]}]),
        ({"messages": [USER, {"role": "assistant", "content": [
            TOOL_USE, {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}]}]},
         [USER, {"role": "assistant", "content": "", "tool_calls": [
             TOOL_CALL, {"id": "toolu_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}]),
        ({"messages": [USER, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "step 1. ", "signature": "s"},
            {"type": "thinking", "thinking": "step 2."}, {"type": "text", "text": "answer"}]}]},
         [USER, {"role": "assistant", "content": "answer", "reasoning_content": "step 1. step 2."}]),
        ({"messages": [USER, {"role": "assistant", "content": [
            {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "answer"}]}]},
         [USER, {"role": "assistant", "content": "answer"}]),
        ({"messages": [USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                               "input": {"q": "caf\u00e9"}}]}]},
         [USER, {"role": "assistant", "content": "", "tool_calls": [
             {"id": "t", "type": "function", "function": {"name": "f", "arguments": '{"q": "caf\u00e9"}'}}]}]),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]},
         [{"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}]}]},
         [{"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}]},
         [{"role": "tool", "tool_call_id": "toolu_1",
           "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://x.test/p.png"}}]}]}]},
         [{"role": "tool", "tool_call_id": "toolu_1",
           "content": [{"type": "image_url", "image_url": {"url": "https://x.test/p.png"}}]}]),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]},
         [{"role": "tool", "tool_call_id": "toolu_1", "content": ""}]),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                     "content": [], "is_error": True}]}]},
         [{"role": "tool", "tool_call_id": "toolu_1", "content": ""}]),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": "1"},
            {"type": "tool_result", "tool_use_id": "b", "content": "2"},
            {"type": "text", "text": "and now?"}]}]},
         [{"role": "tool", "tool_call_id": "a", "content": "1"}, {"role": "tool", "tool_call_id": "b", "content": "2"},
          {"role": "user", "content": "and now?"}]),
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "first"}, {"type": "tool_result", "tool_use_id": "a", "content": "1"}]}]},
         [{"role": "tool", "tool_call_id": "a", "content": "1"}, {"role": "user", "content": "first"}]),
    ],
    ids=["string-user", "system-string", "system-empty-dropped", "system-one-block", "system-two-blocks",
         "one-text-block", "two-text-blocks", "empty-blocks", "text-and-base64-image", "url-image",
         "text-document", "assistant-string", "system-after-user", "system-blocks-after-user",
         "assistant-tool-use-only", "assistant-text-and-tool-use",
         "assistant-two-tool-uses", "assistant-thinking", "assistant-redacted-thinking", "tool-input-unicode",
         "tool-result-string", "tool-result-one-text", "tool-result-two-texts", "tool-result-image",
         "tool-result-missing-content", "tool-result-error-empty", "two-tool-results-then-text",
         "tool-result-moves-before-text"],
)
def test_chat_messages(fields: dict[str, Any], expected: list[dict[str, Any]]) -> None:
    assert anthropic.chat_messages(parsed(**fields)) == expected


def test_tool_arguments_round_trip_to_the_same_object() -> None:
    message = {"role": "assistant", "content": [TOOL_USE]}
    call = anthropic.chat_messages(parsed(messages=[USER, message]))[1]["tool_calls"][0]
    assert anthropic.tool_input(call["function"]["arguments"]) == TOOL_USE["input"]


# ---------------------------------------------------------------------------------------------------------------------
# chat_body: the rest of the request


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {}),
        ({"stop_sequences": ["END", "STOP"]}, {"stop": ["END", "STOP"], "verbose": True}),
        ({"stop_sequences": []}, {}),
        ({"temperature": 0, "top_p": 0.5, "top_k": 7}, {"temperature": 0, "top_p": 0.5, "top_k": 7}),
        ({"stream": True}, {"stream": True, "return_progress": True}),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, {"thinking_budget_tokens": 2048}),
        ({"thinking": {"type": "enabled"}}, {}),
        ({"thinking": {"type": "disabled"}}, {"reasoning_effort": "none"}),
        ({"thinking": {"type": "adaptive"}}, {}),
        ({"tool_choice": {"type": "any"}}, {}),
        ({"tools": [{"name": "f"}], "tool_choice": {"type": "auto"}},
         {"tools": [{"type": "function", "function": {"name": "f", "description": "",
                                                      "parameters": {"type": "object", "properties": {}}}}],
          "tool_choice": "auto"}),
        ({"metadata": {"user_id": "u"}}, {}),
        ({"chat_template_kwargs": {"enable_thinking": False}, "seed": 3, "min_p": 0.1},
         {"chat_template_kwargs": {"enable_thinking": False}, "seed": 3, "min_p": 0.1}),
        ({"service_tier": "auto", "container": "c", "session_id": "s", "id_slot": 3, "cache_prompt": False},
         {}),
    ],
    ids=["minimal", "stop-sequences", "no-stop-sequences", "sampling", "stream", "thinking-enabled",
         "thinking-enabled-no-budget", "thinking-disabled", "thinking-adaptive", "tool-choice-without-tools",
         "tools-auto", "metadata-not-forwarded", "llama-server-extras", "anthropic-and-own-fields-dropped"],
)
def test_chat_body(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    base = {"model": "tiny", "messages": [USER], "max_tokens": 16, "stream": False}
    assert chat(**fields) == {**base, **expected}


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "tool", "name": "f"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        ({"type": "auto", "disable_parallel_tool_use": True}, {"tool_choice": "auto", "parallel_tool_calls": False}),
        ({"type": "any", "disable_parallel_tool_use": False}, {"tool_choice": "required"}),
    ],
    ids=["auto", "any", "named-tool", "none", "no-parallel", "parallel-allowed"],
)
def test_tool_choice(choice: dict[str, Any], expected: dict[str, Any]) -> None:
    body = chat(tools=[{"name": "f"}, {"name": "g"}], tool_choice=choice)
    assert {k: body[k] for k in ("tool_choice", "parallel_tool_calls") if k in body} == expected
    assert [t["function"]["name"] for t in body["tools"]] == ["f", "g"]  # never narrowed: the prompt stays the same


def test_tools_keep_their_schema_unchanged() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["a", "b"]}},
              "required": ["city"], "additionalProperties": False}
    body = chat(tools=[{"name": "w", "description": "weather", "input_schema": schema}])
    assert body["tools"] == [{"type": "function",
                              "function": {"name": "w", "description": "weather", "parameters": schema}}]


def test_chat_body_does_not_mutate_its_input() -> None:
    raw = request(system=[{"type": "text", "text": "S"}], stop_sequences=["x"], seed=1,
                  messages=[USER, {"role": "assistant", "content": [TOOL_USE]}])
    before = copy.deepcopy(raw)
    anthropic.chat_body(anthropic.parse_messages_request(raw), raw)
    assert raw == before


def test_passthrough_fields_are_llama_server_fields_only() -> None:
    assert not anthropic.PASSTHROUGH_FIELDS & {"id_slot", "cache_prompt", "session_id", "stream", "messages",
                                               "model", "max_tokens", "tools", "metadata"}


# ---------------------------------------------------------------------------------------------------------------------
# answers: usage, stop reasons, tool input, to_message


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"timings": {"cache_n": 100, "prompt_n": 7, "predicted_n": 5}}, anthropic.Usage(7, 5, 100)),
        ({"timings": {"prompt_n": 3}}, anthropic.Usage(3, 0, 0)),
        ({"usage": {"prompt_tokens": 20, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 15}}},
         anthropic.Usage(5, 4, 15)),
        ({"usage": {"prompt_tokens": 20, "completion_tokens": 4}}, anthropic.Usage(20, 4, 0)),
        ({"usage": {"prompt_tokens": 20, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 15}},
          "timings": {"cache_n": 16, "prompt_n": 4, "predicted_n": 4}}, anthropic.Usage(4, 4, 16)),
        ({}, None),
        ({"timings": {"prompt_per_second": 1.0}}, None),
        ({"usage": None}, None),
    ],
    ids=["timings", "timings-partial", "usage-with-cache", "usage-without-details", "timings-win", "nothing",
         "timings-without-counts", "usage-null"],
)
def test_usage_from(data: dict[str, Any], expected: anthropic.Usage | None) -> None:
    assert anthropic.usage_from(data) == expected


def test_usage_as_dict_has_every_sdk_field() -> None:
    assert anthropic.Usage(1, 2, 3).as_dict() == {"input_tokens": 1, "output_tokens": 2,
                                                  "cache_read_input_tokens": 3, "cache_creation_input_tokens": 0}


@pytest.mark.parametrize(
    ("finish", "word", "stops", "expected"),
    [
        ("stop", "", (), ("end_turn", None)),
        ("stop", None, ("END",), ("end_turn", None)),
        ("stop", "END", ("END",), ("stop_sequence", "END")),
        ("stop", "<|im_end|>", ("END",), ("end_turn", None)),
        ("stop", "END", (), ("end_turn", None)),
        ("length", "", ("END",), ("max_tokens", None)),
        ("tool_calls", "", (), ("tool_use", None)),
        (None, None, (), ("end_turn", None)),
    ],
    ids=["eos", "eos-with-stops", "stop-sequence", "template-stop-word", "word-not-requested", "length",
         "tool-calls", "unknown"],
)
def test_stop_reason(finish: object, word: object, stops: tuple[str, ...], expected: tuple[str, str | None]) -> None:
    assert anthropic.stop_reason(finish, word, stops) == expected


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ("{}", {}),
        ("", {}),
        ("   ", {}),
        (None, {}),
        ({"already": "object"}, {"already": "object"}),
        ('{"a": ', {"_raw_arguments": '{"a": '}),
        ("[1, 2]", {"_raw_arguments": "[1, 2]"}),
        ('"text"', {"_raw_arguments": '"text"'}),
    ],
    ids=["object", "empty-object", "empty", "blank", "none", "mapping", "truncated", "array", "string"],
)
def test_tool_input(arguments: object, expected: dict[str, Any]) -> None:
    assert anthropic.tool_input(arguments) == expected


def completion(message: dict[str, Any], finish: str = "stop", **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", **message},
                                             "finish_reason": finish}],
            "timings": {"cache_n": 10, "prompt_n": 5, "predicted_n": 3}, **extra}


@pytest.mark.parametrize(
    ("data", "stops", "content", "reason", "sequence"),
    [
        (completion({"content": "hello"}), (), [{"type": "text", "text": "hello"}], "end_turn", None),
        (completion({"content": "hel"}, "length"), (), [{"type": "text", "text": "hel"}], "max_tokens", None),
        (completion({"content": ""}), (), [], "end_turn", None),
        (completion({"content": None}), (), [], "end_turn", None),
        (completion({"content": "x", "reasoning_content": "think"}), (),
         [{"type": "thinking", "thinking": "think", "signature": ""}, {"type": "text", "text": "x"}], "end_turn",
         None),
        (completion({"content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}},
            {"type": "function", "function": {"name": "g", "arguments": "{}"}}]}, "tool_calls"), (),
         [{"type": "tool_use", "id": "call_1", "name": "f", "input": {"q": 1}},
          {"type": "tool_use", "id": "toolu_msg_x_1", "name": "g", "input": {}}], "tool_use", None),
        (completion({"content": "a"}, __verbose={"stop_type": "word", "stopping_word": "END"}), ("END",),
         [{"type": "text", "text": "a"}], "stop_sequence", "END"),
        (completion({"content": "a"}, __verbose={"stop_type": "eos", "stopping_word": ""}), ("END",),
         [{"type": "text", "text": "a"}], "end_turn", None),
        ({"choices": []}, (), [], "end_turn", None),
        ({}, (), [], "end_turn", None),
    ],
    ids=["text", "max-tokens", "empty-text", "null-content", "thinking-first", "tool-calls", "stop-sequence",
         "eos-with-stop-sequences", "no-choices", "empty-answer"],
)
def test_to_message(data: dict[str, Any], stops: tuple[str, ...], content: list[dict[str, Any]], reason: str,
                    sequence: str | None) -> None:
    message = anthropic.to_message(data, message_id="msg_x", model="claude-x", stop_sequences=stops)
    assert message["content"] == content
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, sequence)
    assert {k: message[k] for k in ("id", "type", "role", "model")} == {
        "id": "msg_x", "type": "message", "role": "assistant", "model": "claude-x"}
    assert set(message["usage"]) == {"input_tokens", "output_tokens", "cache_read_input_tokens",
                                     "cache_creation_input_tokens"}


def test_to_message_usage_from_timings() -> None:
    message = anthropic.to_message(completion({"content": "x"}), message_id="m", model="m")
    assert message["usage"] == {"input_tokens": 5, "output_tokens": 3, "cache_read_input_tokens": 10,
                                "cache_creation_input_tokens": 0}


# ---------------------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("error", "error_type"),
    [
        (BadRequest("bad"), "invalid_request_error"),
        (NotFound("nope"), "not_found_error"),
        (SlotkeeperError("boom"), "api_error"),
        (UpstreamUnavailable("down"), "api_error"),
        (UpstreamError(400, b'{"error":{"code":400,"message":"too long","type":"exceed_context_size_error"}}'),
         "invalid_request_error"),
        (UpstreamError(401, b'{"error":{"message":"Invalid API Key"}}'), "authentication_error"),
        (UpstreamError(402, b"pay"), "billing_error"),
        (UpstreamError(403, b"no"), "permission_error"),
        (UpstreamError(404, b"{}"), "not_found_error"),
        (UpstreamError(413, b"big"), "request_too_large"),
        (UpstreamError(429, b"slow down"), "rate_limit_error"),
        (UpstreamError(500, b'{"error":{"message":"x"}}'), "api_error"),
        (UpstreamError(501, b'{"error":{"message":"not supported"}}'), "api_error"),
        (UpstreamError(503, b'{"error":{"message":"Loading model"}}'), "overloaded_error"),
        (UpstreamError(529, b""), "overloaded_error"),
    ],
    ids=["bad-request", "not-found", "internal", "unavailable", "context", "auth", "billing", "permission",
         "upstream-404", "too-large", "rate-limit", "server-error", "not-supported", "loading", "overloaded"],
)
def test_error_body(error: SlotkeeperError, error_type: str) -> None:
    assert anthropic.error_body(error) == {"type": "error", "error": {"type": error_type, "message": error.message}}


def test_upstream_error_message_is_the_backends() -> None:
    error = UpstreamError(400, b'{"error":{"code":400,"message":"request exceeds context","type":"x"}}')
    assert anthropic.error_body(error)["error"]["message"] == "request exceeds context"


@pytest.mark.parametrize(
    ("event", "status"),
    [
        ({"error": {"code": 500, "message": "decode failed", "type": "server_error"}}, 500),
        ({"error": {"code": 400, "message": "x", "type": "invalid_request_error"}}, 400),
        ({"error": {"message": "no code"}}, 500),
        ({"error": "plain"}, 500),
        ({"error": {"code": 99, "message": "odd"}}, 500),
    ],
    ids=["server-error", "bad-request", "no-code", "string-error", "odd-code"],
)
def test_upstream_error_event(event: dict[str, Any], status: int) -> None:
    assert anthropic.upstream_error(event).status_code == status


def test_sse_names_the_event_and_escapes_non_ascii() -> None:
    frame = anthropic.sse({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": "caf\u00e9 \ufffd \ud800"}})
    assert frame.startswith(b"event: content_block_delta\ndata: {")
    assert frame.endswith(b"}\n\n")
    assert frame.isascii()


# ---------------------------------------------------------------------------------------------------------------------
# the stream encoder


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    """One upstream chat.completion.chunk, as llama-server sends it."""
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
            "object": "chat.completion.chunk", **extra}


ROLE = chunk({"role": "assistant", "content": None})
TIMINGS = {"cache_n": 40, "prompt_n": 6, "predicted_n": 4}


def progress(total: int, cache: int, processed: int) -> dict[str, Any]:
    return chunk({"role": "assistant", "content": None},
                 prompt_progress={"total": total, "cache": cache, "processed": processed, "time_ms": 1})


def text(t: str) -> dict[str, Any]:
    return chunk({"content": t})


def finish(reason: str = "stop", **extra: Any) -> dict[str, Any]:
    return chunk({}, reason, timings=TIMINGS, **extra)


def tool(index: int, arguments: str, call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return chunk({"tool_calls": [call]})


def encode(events: list[UpstreamEvent], stops: tuple[str, ...] = (), end: bool = True) -> list[dict[str, Any]]:
    encoder = anthropic.MessageStreamEncoder("msg_1", "claude-x", stops)
    raw = b"".join(encoder.feed(e) for e in events) + (encoder.finish() if end else b"")
    return parse_sse(raw)


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """Every event must carry an `event:` line equal to its data's type (the SDK skips events without one)."""
    events = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
        data = json.loads(data_line[6:])
        assert data["type"] == name_line[7:]
        events.append(data)
    return events


def kinds(events: list[dict[str, Any]]) -> list[str]:
    """Event types, with ping left out and block events suffixed by their block or delta type."""
    out = []
    for e in events:
        if e["type"] == "ping":
            continue
        if e["type"] == "content_block_start":
            out.append(f"start:{e['content_block']['type']}")
        elif e["type"] == "content_block_delta":
            out.append(f"delta:{e['delta']['type']}")
        elif e["type"] == "content_block_stop":
            out.append("stop")
        else:
            out.append(e["type"])
    return out


def check_grammar(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Anthropic's sequence: message_start; per block start, deltas, stop with contiguous indices from 0;
    message_delta; message_stop. Returns the message the SDK would accumulate."""
    events = [e for e in events if e["type"] != "ping"]
    assert events[0]["type"] == "message_start"
    message = copy.deepcopy(events[0]["message"])
    partial: dict[int, str] = {}
    open_index: int | None = None
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(message["content"])
            open_index = e["index"]
            message["content"].append(copy.deepcopy(e["content_block"]))
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            block, delta = message["content"][open_index], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                assert delta["type"] == "input_json_delta"
                partial[open_index] = partial.get(open_index, "") + delta["partial_json"]
        else:
            assert e["type"] == "content_block_stop" and e["index"] == open_index, e
            if open_index in partial:
                message["content"][open_index]["input"] = json.loads(partial[open_index])
            open_index = None
    assert open_index is None
    assert events[-2]["type"] == "message_delta" and events[-1]["type"] == "message_stop"
    message.update(events[-2]["delta"])
    message["usage"].update(events[-2]["usage"])
    return message


def test_stream_text_only() -> None:
    events = encode([ROLE, text("Hel"), text("lo"), finish()])
    assert kinds(events) == ["message_start", "start:text", "delta:text_delta", "delta:text_delta", "stop",
                             "message_delta", "message_stop"]
    message = check_grammar(events)
    assert message["content"] == [{"type": "text", "text": "Hello"}]
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    assert message["id"] == "msg_1" and message["model"] == "claude-x" and message["role"] == "assistant"


def test_stream_thinking_then_text() -> None:
    events = encode([ROLE, chunk({"reasoning_content": "Let me "}), chunk({"reasoning_content": "think."}),
                     text("Answer"), finish()])
    assert kinds(events) == ["message_start", "start:thinking", "delta:thinking_delta", "delta:thinking_delta",
                             "stop", "start:text", "delta:text_delta", "stop", "message_delta", "message_stop"]
    message = check_grammar(events)
    assert message["content"] == [{"type": "thinking", "thinking": "Let me think.", "signature": ""},
                                  {"type": "text", "text": "Answer"}]


def test_stream_tool_call_split_over_many_deltas() -> None:
    pieces = ['{"ci', 'ty": "Pa', "ris", '", "days"', ": 2}"]
    events = encode([ROLE, tool(0, "", "call_7", "get_weather"), *(tool(0, p) for p in pieces),
                     finish("tool_calls")])
    assert kinds(events) == ["message_start", "start:tool_use", *["delta:input_json_delta"] * 5, "stop",
                             "message_delta", "message_stop"]
    message = check_grammar(events)
    assert message["content"] == [{"type": "tool_use", "id": "call_7", "name": "get_weather",
                                   "input": {"city": "Paris", "days": 2}}]
    assert message["stop_reason"] == "tool_use"


def test_stream_tool_call_arguments_in_the_first_delta() -> None:
    message = check_grammar(encode([ROLE, tool(0, '{"q": 1}', "call_1", "f"), finish("tool_calls")]))
    assert message["content"] == [{"type": "tool_use", "id": "call_1", "name": "f", "input": {"q": 1}}]


def test_stream_two_tool_calls() -> None:
    events = encode([ROLE, tool(0, '{"a":', "call_a", "f"), tool(0, " 1}"), tool(1, "", "call_b", "g"),
                     tool(1, '{"b": 2}'), finish("tool_calls")])
    assert kinds(events) == ["message_start", "start:tool_use", "delta:input_json_delta", "delta:input_json_delta",
                             "stop", "start:tool_use", "delta:input_json_delta", "stop", "message_delta",
                             "message_stop"]
    message = check_grammar(events)
    assert [(b["id"], b["name"], b["input"]) for b in message["content"]] == [
        ("call_a", "f", {"a": 1}), ("call_b", "g", {"b": 2})]
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1]


def test_stream_two_tool_calls_in_one_chunk() -> None:
    both = chunk({"tool_calls": [
        {"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"index": 1, "id": "c1", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]})
    message = check_grammar(encode([ROLE, both, finish("tool_calls")]))
    assert [(b["id"], b["input"]) for b in message["content"]] == [("c0", {}), ("c1", {"x": 1})]


def test_stream_text_then_tool_call() -> None:
    events = encode([ROLE, text("Checking."), tool(0, '{"k": "v"}', "call_1", "lookup"), finish("tool_calls")])
    assert kinds(events) == ["message_start", "start:text", "delta:text_delta", "stop", "start:tool_use",
                             "delta:input_json_delta", "stop", "message_delta", "message_stop"]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]


def test_stream_tool_call_without_id_gets_one() -> None:
    nameless = chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{}"}}]})
    message = check_grammar(encode([ROLE, nameless, finish("tool_calls")]))
    assert message["content"][0]["id"] == "toolu_msg_1_0"
    assert message["content"][0]["name"] == "f"


def test_stream_tool_call_with_no_arguments_has_empty_input() -> None:
    message = check_grammar(encode([ROLE, tool(0, "", "c", "now"), finish("tool_calls")]))
    assert message["content"] == [{"type": "tool_use", "id": "c", "name": "now", "input": {}}]


def test_stream_stop_sequence() -> None:
    verbose = {"stop_type": "word", "stopping_word": "END"}
    events = encode([ROLE, text("a b"), finish("stop", __verbose=verbose)], stops=("END", "HALT"))
    message = check_grammar(events)
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")


def test_stream_stop_sequence_reported_on_an_earlier_final_chunk() -> None:
    # llama-server puts __verbose on the first chunk of its final result, which may be a content diff.
    verbose = {"stop_type": "word", "stopping_word": "HALT"}
    events = encode([ROLE, text("a", ) | {"__verbose": verbose}, finish("stop")], stops=("END", "HALT"))
    assert check_grammar(events)["stop_sequence"] == "HALT"


def test_stream_end_of_turn_with_stop_sequences_requested() -> None:
    verbose = {"stop_type": "eos", "stopping_word": ""}
    message = check_grammar(encode([ROLE, text("a"), finish("stop", __verbose=verbose)], stops=("END",)))
    assert (message["stop_reason"], message["stop_sequence"]) == ("end_turn", None)


def test_stream_max_tokens() -> None:
    message = check_grammar(encode([ROLE, text("a"), text("b"), finish("length")]))
    assert message["stop_reason"] == "max_tokens"


def test_stream_error_mid_stream() -> None:
    upstream_error = {"error": {"code": 500, "message": "decode failed", "type": "server_error"}}
    events = encode([ROLE, text("partial"), upstream_error, text("never"), finish()])
    assert kinds(events) == ["message_start", "start:text", "delta:text_delta", "error"]
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "decode failed"}}


def test_stream_error_before_any_event() -> None:
    encoder = anthropic.MessageStreamEncoder("msg_1", "m")
    events = parse_sse(encoder.fail(UpstreamUnavailable("the backend broke the connection")))
    assert events == [{"type": "error", "error": {"type": "api_error",
                                                  "message": "the backend broke the connection"}}]
    assert encoder.finish() == b"" and encoder.feed(text("x")) == b""


def test_stream_broken_connection_after_text() -> None:
    encoder = anthropic.MessageStreamEncoder("msg_1", "m")
    raw = encoder.feed(ROLE) + encoder.feed(text("a")) + encoder.fail(UpstreamUnavailable("reset"))
    assert kinds(parse_sse(raw)) == ["message_start", "start:text", "delta:text_delta", "error"]
    assert encoder.finish() == b""


def test_stream_ends_without_finish_reason_is_an_error() -> None:
    events = encode([ROLE, text("a")])
    assert kinds(events)[-1] == "error"
    assert "before the answer was complete" in events[-1]["error"]["message"]


def test_stream_empty_output() -> None:
    events = encode([ROLE, text(""), finish("stop")])
    assert kinds(events) == ["message_start", "message_delta", "message_stop"]
    assert check_grammar(events)["content"] == []


def test_stream_nothing_from_upstream_but_a_finish() -> None:
    assert kinds(encode([finish("length")])) == ["message_start", "message_delta", "message_stop"]


def test_stream_usage_in_message_delta() -> None:
    events = encode([ROLE, text("a"), finish()])
    assert events[-2]["usage"] == {"input_tokens": 6, "output_tokens": 4, "cache_read_input_tokens": 40,
                                   "cache_creation_input_tokens": 0}


def test_stream_usage_from_the_usage_chunk_when_no_timings() -> None:
    usage_chunk = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": 4}}}
    events = encode([ROLE, text("a"), chunk({}, "stop"), usage_chunk])
    assert events[-2]["usage"]["input_tokens"] == 5 and events[-2]["usage"]["cache_read_input_tokens"] == 4


def test_stream_progress_becomes_message_start_counts_and_pings() -> None:
    events = encode([progress(2000, 1500, 1500), progress(2000, 1500, 1800), progress(2000, 1500, 2000), ROLE,
                     text("a"), finish()])
    assert [e["type"] for e in events[:4]] == ["message_start", "ping", "ping", "ping"]
    assert events[0]["message"]["usage"]["input_tokens"] == 500
    assert events[0]["message"]["usage"]["cache_read_input_tokens"] == 1500
    check_grammar(events)


def test_stream_keepalive_becomes_ping() -> None:
    events = encode([KEEPALIVE, KEEPALIVE, ROLE, text("a"), KEEPALIVE, text("b"), finish()])
    assert [e["type"] for e in events[:3]] == ["message_start", "ping", "ping"]
    assert sum(e["type"] == "ping" for e in events) == 3
    assert check_grammar(events)["content"] == [{"type": "text", "text": "ab"}]


def test_stream_message_start_is_sent_once() -> None:
    events = encode([KEEPALIVE, progress(10, 0, 10), ROLE, ROLE, text("a"), finish()])
    assert sum(e["type"] == "message_start" for e in events) == 1


def test_stream_message_start_shape() -> None:
    start = encode([ROLE, finish()])[0]
    assert start == {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0,
                  "cache_creation_input_tokens": 0}}}


def test_stream_finish_is_idempotent() -> None:
    encoder = anthropic.MessageStreamEncoder("msg_1", "m")
    encoder.feed(finish())
    assert encoder.finish() != b""
    assert encoder.finish() == b"" and encoder.feed(text("late")) == b""


def test_stream_text_interrupted_by_thinking_opens_new_blocks() -> None:
    events = encode([text("a"), chunk({"reasoning_content": "r"}), text("b"), finish()])
    assert kinds(events) == ["message_start", "start:text", "delta:text_delta", "stop", "start:thinking",
                             "delta:thinking_delta", "stop", "start:text", "delta:text_delta", "stop",
                             "message_delta", "message_stop"]
    check_grammar(events)


def test_stream_chunk_with_text_and_finish() -> None:
    message = check_grammar(encode([chunk({"content": "last"}, "length", timings=TIMINGS)]))
    assert message["content"] == [{"type": "text", "text": "last"}] and message["stop_reason"] == "max_tokens"


def test_stream_ignores_odd_chunks() -> None:
    odd: list[UpstreamEvent] = [{"choices": "x"}, {"choices": [None]}, chunk({"tool_calls": ["bad"]}),
                                chunk({"content": 5}), {"object": "unknown"}]
    assert kinds(encode([*odd, text("a"), finish()])) == ["message_start", "start:text", "delta:text_delta", "stop",
                                                          "message_delta", "message_stop"]


def test_stream_from_real_llama_server_bytes() -> None:
    """The bytes llama-server sent for a stop-sequence stream with return_progress and verbose (recorded)."""
    raw = (
        b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],'
        b'"object":"chat.completion.chunk","prompt_progress":{"total":16,"cache":15,"processed":15,"time_ms":0}}\n\n'
        b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],'
        b'"object":"chat.completion.chunk","prompt_progress":{"total":16,"cache":15,"processed":16,"time_ms":1}}\n\n'
        b": keep-alive\n\n"
        b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],'
        b'"object":"chat.completion.chunk"}\n\n'
        b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" "}}],'
        b'"object":"chat.completion.chunk","timings":{"cache_n":15,"prompt_n":1,"predicted_n":2}}\n\n'
        b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"object":"chat.completion.chunk",'
        b'"timings":{"cache_n":15,"prompt_n":1,"predicted_n":2},'
        b'"__verbose":{"stop_type":"word","stopping_word":"we we"}}\n\n'
        b"data: [DONE]\n\n"
    )
    decoder = SseDecoder()
    upstream = decoder.feed(raw) + decoder.finish()
    events = encode(upstream, stops=("we we",))
    assert [e["type"] for e in events[:4]] == ["message_start", "ping", "ping", "ping"]
    message = check_grammar(events)
    assert message["content"] == [{"type": "text", "text": " "}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "we we")
    assert message["usage"]["input_tokens"] == 1 and message["usage"]["cache_read_input_tokens"] == 15
