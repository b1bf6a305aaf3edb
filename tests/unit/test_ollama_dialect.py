"""Table-driven tests for the Ollama dialect: request validation, options, messages, upstream bodies, answers, the
NDJSON stream encoder (one named test per streaming edge case), model descriptions and embeddings."""

from __future__ import annotations

import base64
import json
from typing import Any

import ollama as ollama_client
import pytest
from ollama import _types as ollama_types

from slotkeeper.dialects import ollama
from slotkeeper.dialects.framing import KEEPALIVE
from slotkeeper.dialects.ollama import (
    AnswerShape,
    ChatMessage,
    ChatRequest,
    GenerateRequest,
    Metrics,
    Piece,
    StreamEncoder,
)
from slotkeeper.errors import BadRequest, NotFound, NotSupported, SlotkeeperError, UpstreamError, UpstreamUnavailable
from slotkeeper.types import BackendInfo

NOW = "2026-01-02T03:04:05.000006Z"


def chat(**fields: Any) -> ChatRequest:
    return ollama.parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def gen(**fields: Any) -> GenerateRequest:
    return ollama.parse(GenerateRequest, {"model": "m", "prompt": "hi", **fields})


# ---------------------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "error",
    [BadRequest("bad"), NotFound("model 'x' not found"), UpstreamUnavailable("down"), SlotkeeperError("boom"),
     UpstreamError(400, b'{"error":{"code":400,"message":"too long","type":"exceed_context_size_error"}}'),
     UpstreamError(503, b"not json"), NotSupported("no")],
    ids=["bad-request", "not-found", "unavailable", "generic", "upstream-json", "upstream-text", "not-supported"],
)
def test_error_body_is_a_plain_string(error: SlotkeeperError) -> None:
    body = ollama.error_body(error)
    assert body == {"error": error.message}
    assert isinstance(body["error"], str) and body["error"]


def test_upstream_error_message_is_the_backends_own() -> None:
    error = UpstreamError(400, b'{"error":{"code":400,"message":"too long","type":"exceed_context_size_error"}}')
    assert ollama.error_body(error) == {"error": "too long"}
    assert error.status_code == 400


def test_error_line_is_one_ndjson_line() -> None:
    line = ollama.error_line(UpstreamUnavailable("the backend broke the connection"))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"error": "the backend broke the connection"}


def test_not_supported_is_501() -> None:
    assert NotSupported("x").status_code == 501


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"a": 1}, b'{"a":1}\n'),
        ({"t": "caf\u00e9"}, '{"t":"caf\u00e9"}\n'.encode()),
        ({"t": "two\nlines"}, b'{"t":"two\\nlines"}\n'),
        ({}, b"{}\n"),
    ],
    ids=["plain", "non-ascii-kept", "newline-escaped", "empty"],
)
def test_ndjson(obj: dict[str, Any], expected: bytes) -> None:
    assert ollama.ndjson(obj) == expected


# ---------------------------------------------------------------------------------------------------------------------
# request validation


@pytest.mark.parametrize(
    ("model", "body", "fragment"),
    [
        (ChatRequest, {"messages": []}, "'model' is required"),
        (ChatRequest, {"model": ""}, "'model': String should have at least 1 character"),
        (ChatRequest, {"model": 5}, "'model': Input should be a valid string"),
        (ChatRequest, {"model": "m", "messages": "hi"}, "'messages': Input should be a valid list"),
        (ChatRequest, {"model": "m", "messages": [{"content": "hi"}]}, "'messages.0.role' is required"),
        (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": 3}]},
         "'messages.0.content': Input should be a valid string"),
        (ChatRequest, {"model": "m", "messages": [{"role": "user", "images": "abc"}]},
         "'messages.0.images': Input should be a valid list"),
        (ChatRequest, {"model": "m", "options": {"temperature": "hot"}}, "'options.temperature'"),
        (ChatRequest, {"model": "m", "options": {"num_predict": 1.5}}, "'options.num_predict'"),
        (ChatRequest, {"model": "m", "options": {"seed": "x"}}, "'options.seed'"),
        (ChatRequest, {"model": "m", "options": {"stop": 5}}, "'options.stop'"),
        (ChatRequest, {"model": "m", "options": "fast"}, "'options': Input should be a valid dictionary"),
        (ChatRequest, {"model": "m", "stream": "maybe"}, "'stream': Input should be a valid boolean"),
        (ChatRequest, {"model": "m", "format": "yaml"}, "'format'"),
        (ChatRequest, {"model": "m", "format": 5}, "'format'"),
        (ChatRequest, {"model": "m", "think": "extreme"}, "'think'"),
        (ChatRequest, {"model": "m", "top_logprobs": 21}, "'top_logprobs'"),
        (ChatRequest, {"model": "m", "tools": {"a": 1}}, "'tools'"),
        (ChatRequest, {"model": "m", "num_predict": "ten"}, "'num_predict'"),
        (ChatRequest, {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
         "'messages.0.tool_calls.0.function.name' is required"),
        (GenerateRequest, {"model": "m", "prompt": ["a"]}, "'prompt': Input should be a valid string"),
        (GenerateRequest, {"model": "m", "context": ["a"]}, "'context.0'"),
        (GenerateRequest, {"model": "m", "raw": "sometimes"}, "'raw'"),
        (ollama.EmbedRequest, {"model": "m"}, "'input' is required"),
        (ollama.EmbedRequest, {"model": "m", "input": 5}, "'input'"),
    ],
    ids=["model-missing", "model-empty", "model-int", "messages-string", "role-missing", "content-int",
         "images-string", "temperature-string", "num-predict-float", "seed-string", "stop-int", "options-string",
         "stream-word", "format-yaml", "format-int", "think-unknown-level", "top-logprobs-too-high", "tools-object",
         "root-num-predict-word", "tool-call-without-name", "prompt-list", "context-strings", "raw-word",
         "embed-input-missing", "embed-input-int"],
)
def test_bad_requests_get_a_readable_400(model: type[Any], body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(BadRequest) as info:
        ollama.parse(model, body)
    message = info.value.message
    assert fragment in message
    assert message.startswith("invalid request: ") and "\n" not in message
    assert info.value.status_code == 400


def test_many_problems_are_listed_in_one_line_and_capped() -> None:
    body = {"model": 1, "stream": "x", "raw": "y", "prompt": 2, "system": 3, "suffix": 4, "template": 5}
    with pytest.raises(BadRequest) as info:
        ollama.parse(GenerateRequest, body)
    assert info.value.message.count("; ") == 5 and info.value.message.endswith("; ...")


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},
        {"model": "m", "messages": []},
        {"model": "m", "messages": [{"role": "user", "content": None}]},
        {"model": "m", "messages": [{"role": "user", "content": "x", "brand_new_field": 1}], "future": True},
        {"model": "m", "options": {"mirostat": 2, "tfs_z": 1.0, "num_gpu": 99, "penalize_newline": True}},
        {"model": "m", "format": "json"}, {"model": "m", "format": ""}, {"model": "m", "format": {"type": "object"}},
        {"model": "m", "think": True}, {"model": "m", "think": "high"}, {"model": "m", "keep_alive": "5m"},
        {"model": "m", "keep_alive": 300}, {"model": "m", "keep_alive": -1},
        {"model": "m", "options": {"temperature": 0}},
        {"model": "m", "options": {"stop": "one"}},
        {"model": "m", "metadata": {"chat_id": "c"}, "template": "{{ .Prompt }}"},
    ],
    ids=["minimal", "empty-messages", "null-content", "unknown-fields", "unknown-options", "format-json",
         "format-empty", "format-schema", "think-bool", "think-level", "keep-alive-duration", "keep-alive-int",
         "keep-alive-forever", "int-temperature", "stop-string", "openwebui-extras"],
)
def test_good_chat_requests_parse(body: dict[str, Any]) -> None:
    assert ollama.parse(ChatRequest, body).model == "m"


def test_defaults() -> None:
    req = ollama.parse(ChatRequest, {"model": "m"})
    assert req.stream is True and req.messages == [] and req.options.num_predict is None
    g = ollama.parse(GenerateRequest, {"model": "m"})
    assert g.prompt == "" and g.raw is False and g.stream is True


@pytest.mark.parametrize("stream", [True, False])
def test_bodies_built_by_the_official_client_parse(stream: bool) -> None:
    request = ollama_types.ChatRequest(
        model="tiny", stream=stream, messages=[ollama_client.Message(role="user", content="hi")],
        options=ollama_client.Options(num_predict=3, temperature=0, stop=["x"]), format="json", think=False,
        keep_alive="5m",
    ).model_dump(exclude_none=True)
    parsed = ollama.parse(ChatRequest, request)
    assert parsed.stream is stream and parsed.options.num_predict == 3 and parsed.options.stop == ["x"]


# ---------------------------------------------------------------------------------------------------------------------
# model names


@pytest.mark.parametrize(
    ("model_id", "expected"),
    [("tiny", "tiny:latest"), ("qwen3:8b", "qwen3:8b"), ("hf.co/org/repo:Q4_K_M", "hf.co/org/repo:Q4_K_M"),
     ("org/repo", "org/repo:latest"), ("localhost:5000/repo", "localhost:5000/repo:latest"),
     ("tiny:latest", "tiny:latest")],
    ids=["bare", "tagged", "tagged-path", "path", "registry-port", "already-latest"],
)
def test_advertised_name(model_id: str, expected: str) -> None:
    assert ollama.advertised_name(model_id) == expected


@pytest.mark.parametrize(
    ("requested", "model_id", "served"),
    [("tiny", "tiny", True), ("tiny:latest", "tiny", True), ("tiny:7b", "tiny", False), ("Tiny", "tiny", False),
     ("other", "tiny", False), ("", "tiny", False), ("qwen3:8b", "qwen3:8b", True), ("qwen3", "qwen3:8b", False),
     ("qwen3:8b:latest", "qwen3:8b", True), ("tiny:latest:latest", "tiny", False)],
    ids=["bare", "latest", "other-tag", "case", "other", "empty", "tagged-exact", "tagged-bare", "tagged-latest",
         "double-latest"],
)
def test_is_served(requested: str, model_id: str, served: bool) -> None:
    assert ollama.is_served(requested, model_id) is served


def test_model_not_found_message() -> None:
    error = ollama.model_not_found("x")
    assert error.status_code == 404 and ollama.error_body(error) == {"error": "model 'x' not found"}
    assert "tiny:latest" in ollama.model_not_found("x", "tiny:latest").message


# ---------------------------------------------------------------------------------------------------------------------
# keep_alive


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), ("", None), (0, 0.0), (0.0, 0.0), ("0", 0.0), ("0s", 0.0), ("0m", 0.0), ("5m", 300.0),
     ("1h30m", 5400.0), ("300ms", 0.3), ("1.5h", 5400.0), ("-1", -1.0), (-1, -1.0), ("-1m", -60.0), (" 10m ", 600.0),
     (300, 300.0), ("300", 300.0), ("2h0m0s", 7200.0), ("+5s", 5.0)],
    ids=["none", "empty", "int-zero", "float-zero", "string-zero", "zero-seconds", "zero-minutes", "minutes",
         "compound", "milliseconds", "fractional-hours", "string-minus-one", "int-minus-one", "negative-duration",
         "padded", "int-seconds", "string-seconds", "go-style", "plus-sign"],
)
def test_keep_alive_seconds(value: Any, seconds: float | None) -> None:
    result = ollama.keep_alive_seconds(value)
    assert result is None if seconds is None else result == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["5 minutes", "m", "5x", "forever", "5m garbage", "--5m", "1d"])
def test_bad_keep_alive_is_a_400(value: str) -> None:
    with pytest.raises(BadRequest, match="keep_alive"):
        ollama.keep_alive_seconds(value)


@pytest.mark.parametrize(("keep_alive", "unloads"), [(0, True), ("0", True), ("0s", True), (None, False),
                                                     ("5m", False), (-1, False)])
def test_unloads(keep_alive: Any, unloads: bool) -> None:
    assert ollama.unloads(chat(keep_alive=keep_alive)) is unloads


# ---------------------------------------------------------------------------------------------------------------------
# options


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"num_predict": 5}, {"n_predict": 5}),
        ({"num_predict": -1}, {"n_predict": -1}),
        ({"num_predict": -2}, {"n_predict": -1}),
        ({"num_predict": 0}, {"n_predict": 0}),
        ({"num_keep": 4}, {"n_keep": 4}),
        ({"temperature": 0}, {"temperature": 0.0}),
        ({"top_k": 40, "top_p": 0.9, "min_p": 0.05}, {"top_k": 40, "top_p": 0.9, "min_p": 0.05}),
        ({"typical_p": 0.5}, {"typical_p": 0.5}),
        ({"repeat_last_n": 64, "repeat_penalty": 1.1}, {"repeat_last_n": 64, "repeat_penalty": 1.1}),
        ({"presence_penalty": 0.5, "frequency_penalty": 0.2}, {"presence_penalty": 0.5, "frequency_penalty": 0.2}),
        ({"seed": 42}, {"seed": 42}),
        ({"stop": ["a", "b"]}, {"stop": ["a", "b"]}),
        ({"stop": "a"}, {"stop": ["a"]}),
        ({"mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1}, {"mirostat": 2, "mirostat_tau": 5.0,
                                                                    "mirostat_eta": 0.1}),
        ({}, {}),
        ({"num_ctx": 4096}, {}),
        ({"tfs_z": 1.0, "penalize_newline": True, "num_gpu": 99, "num_thread": 8}, {}),
    ],
    ids=["num-predict", "num-predict-infinite", "num-predict-fill-context", "num-predict-zero", "num-keep",
         "temperature", "top-k-p-min-p", "typical-p", "repeat", "penalties", "seed", "stop-list", "stop-string",
         "mirostat", "none", "num-ctx-not-forwarded", "unknown-not-forwarded"],
)
def test_sampling_fields(options: dict[str, Any], expected: dict[str, Any]) -> None:
    assert ollama.sampling(chat(options=options)).fields == expected


@pytest.mark.parametrize(
    ("options", "ignored"),
    [({"num_ctx": 4096}, ("num_ctx",)), ({"num_gpu": 1, "tfs_z": 1.0}, ("num_gpu", "tfs_z")),
     ({"num_ctx": 1, "zzz": 1, "aaa": 2}, ("num_ctx", "aaa", "zzz")), ({"temperature": 1}, ()), ({}, ())],
    ids=["num-ctx", "unknown-sorted", "launch-first-then-unknown", "known-only", "none"],
)
def test_ignored_options_are_reported(options: dict[str, Any], ignored: tuple[str, ...]) -> None:
    assert ollama.sampling(chat(options=options)).ignored == ignored


@pytest.mark.parametrize(
    ("root", "options", "n_predict"),
    [(7, {}, 7), (7, {"num_predict": 3}, 3), (-2, {}, -1), (None, {}, None)],
    ids=["root-only", "options-win", "root-fill-context", "neither"],
)
def test_root_level_num_predict(root: int | None, options: dict[str, Any], n_predict: int | None) -> None:
    fields = ollama.sampling(chat(num_predict=root, options=options)).fields
    assert fields.get("n_predict") == n_predict


def test_sampling_checks_keep_alive() -> None:
    with pytest.raises(BadRequest, match="keep_alive"):
        ollama.sampling(chat(keep_alive="later"))


def test_launch_time_options_are_known() -> None:
    assert {"num_ctx", "num_gpu", "num_thread", "num_batch", "use_mmap"} <= ollama.LAUNCH_TIME_OPTIONS


# ---------------------------------------------------------------------------------------------------------------------
# messages


PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 20).decode()
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\0" * 20).decode()
GIF = base64.b64encode(b"GIF89a" + b"\0" * 20).decode()
WEBP = base64.b64encode(b"RIFF\0\0\0\0WEBPVP8 " + b"\0" * 20).decode()
BMP = base64.b64encode(b"BM" + b"\0" * 20).decode()
UNKNOWN = base64.b64encode(b"\x00\x01\x02\x03" * 8).decode()


@pytest.mark.parametrize(
    ("image", "url"),
    [(PNG, f"data:image/png;base64,{PNG}"), (JPEG, f"data:image/jpeg;base64,{JPEG}"),
     (GIF, f"data:image/gif;base64,{GIF}"), (WEBP, f"data:image/webp;base64,{WEBP}"),
     (BMP, f"data:image/bmp;base64,{BMP}"), (UNKNOWN, f"data:image/jpeg;base64,{UNKNOWN}"),
     ("data:image/png;base64,AAAA", "data:image/png;base64,AAAA"), ("!!", "data:image/jpeg;base64,!!")],
    ids=["png", "jpeg", "gif", "webp", "bmp", "unknown-defaults-to-jpeg", "data-url-kept", "not-base64"],
)
def test_image_url(image: str, url: str) -> None:
    assert ollama.image_url(image) == url


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"role": "user", "content": "hi"}, {"role": "user", "content": "hi"}),
        ({"role": "USER", "content": "hi"}, {"role": "user", "content": "hi"}),
        ({"role": "system", "content": None}, {"role": "system", "content": ""}),
        ({"role": "user", "content": "look", "images": [PNG]},
         {"role": "user", "content": [{"type": "text", "text": "look"},
                                      {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}),
        ({"role": "user", "content": "", "images": [JPEG]},
         {"role": "user", "content": [{"type": "image_url",
                                       "image_url": {"url": f"data:image/jpeg;base64,{JPEG}"}}]}),
        ({"role": "assistant", "content": "4", "thinking": "2+2"},
         {"role": "assistant", "content": "4", "reasoning_content": "2+2"}),
        ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}),
        ({"role": "assistant", "tool_calls": [{"id": "c9", "function": {"name": "f", "arguments": '{"a":1}'}}]},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c9", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}, {"function": {"name": "g",
                                                                                          "arguments": {}}}]},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "call_1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}),
        ({"role": "tool", "content": "22C", "tool_name": "weather"},
         {"role": "tool", "content": "22C", "name": "weather"}),
        ({"role": "tool", "content": "22C", "tool_name": "weather", "tool_call_id": "c9"},
         {"role": "tool", "content": "22C", "tool_call_id": "c9", "name": "weather"}),
        ({"role": "assistant", "content": "caf\u00e9", "tool_calls": [
            {"function": {"name": "f", "arguments": {"city": "Z\u00fcrich", "n": [1, 2]}}}]},
         {"role": "assistant", "content": "caf\u00e9", "tool_calls": [
             {"id": "call_0", "type": "function",
              "function": {"name": "f", "arguments": '{"city": "Z\u00fcrich", "n": [1, 2]}'}}]}),
    ],
    ids=["user", "role-lowercased", "null-content", "images-become-parts", "image-without-text", "thinking",
         "tool-call-object-arguments", "tool-call-string-arguments-kept", "tool-calls-numbered",
         "tool-result-with-name", "tool-result-with-id", "non-ascii-arguments"],
)
def test_upstream_message(message: dict[str, Any], expected: dict[str, Any]) -> None:
    assert ollama.upstream_message(ChatMessage.model_validate(message)) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [('{"a": 1}', {"a": 1}), ("", {}), (None, {}), ("{}", {}), ('{"n": {"m": [1]}}', {"n": {"m": [1]}}),
     ("not json", {"_raw_arguments": "not json"}), ("[1, 2]", {"_raw_arguments": "[1, 2]"}),
     ('"s"', {"_raw_arguments": '"s"'}), ({"already": "object"}, {"already": "object"}),
     ('{"a": 1', {"_raw_arguments": '{"a": 1'})],
    ids=["object", "empty", "none", "empty-object", "nested", "not-json", "array", "string", "mapping", "truncated"],
)
def test_arguments_object(text: Any, expected: dict[str, Any]) -> None:
    assert ollama.arguments_object(text) == expected


@pytest.mark.parametrize("args", [{"a": 1}, {}, {"s": "x\ny", "l": [1, None, True]}, {"u": "\u2615"}])
def test_arguments_round_trip(args: dict[str, Any]) -> None:
    assert ollama.arguments_object(ollama.arguments_text(args)) == args


# ---------------------------------------------------------------------------------------------------------------------
# upstream bodies


def test_chat_body_minimal() -> None:
    req = chat()
    assert ollama.chat_body(req, ollama.sampling(req)) == {"messages": [{"role": "user", "content": "hi"}],
                                                           "stream": True}


def test_chat_body_never_carries_model_or_ollama_fields() -> None:
    req = chat(keep_alive="5m", options={"num_ctx": 99}, template="x", session_id="s", stream=False)
    body = ollama.chat_body(req, ollama.sampling(req))
    assert set(body) == {"messages", "stream"} and body["stream"] is False


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"format": "json"}, {"response_format": {"type": "json_object"}}),
        ({"format": {"type": "object", "properties": {"a": {"type": "integer"}}}},
         {"response_format": {"type": "json_schema", "json_schema": {"name": "schema", "schema": {
             "type": "object", "properties": {"a": {"type": "integer"}}}}}}),
        ({"format": ""}, {}),
        ({"think": True}, {"chat_template_kwargs": {"enable_thinking": True}}),
        ({"think": False}, {"chat_template_kwargs": {"enable_thinking": False}}),
        ({"think": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}),
        ({"think": "high"}, {"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "high"}}),
        ({"logprobs": True}, {"logprobs": True, "top_logprobs": 1}),
        ({"logprobs": True, "top_logprobs": 5}, {"logprobs": True, "top_logprobs": 5}),
        ({"logprobs": False}, {}),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
         {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
        ({"tools": []}, {}),
        ({"options": {"num_predict": 4, "seed": 1}}, {"n_predict": 4, "seed": 1}),
    ],
    ids=["format-json", "format-schema", "format-empty", "think-on", "think-off", "think-none", "think-level",
         "logprobs", "top-logprobs", "logprobs-off", "tools-pass-through", "no-tools", "options"],
)
def test_chat_body_extras(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    req = chat(**fields)
    body = ollama.chat_body(req, ollama.sampling(req))
    assert {k: v for k, v in body.items() if k not in ("messages", "stream")} == expected


def test_generate_templated_is_a_chat_with_system() -> None:
    req = gen(system="be brief", options={"num_predict": 2}, stream=False)
    path, body = ollama.generate_body(req, ollama.sampling(req))
    assert path == "/v1/chat/completions"
    assert body == {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                    "stream": False, "n_predict": 2}


def test_generate_templated_without_system() -> None:
    req = gen()
    assert ollama.generate_body(req, ollama.sampling(req))[1]["messages"] == [{"role": "user", "content": "hi"}]


def test_generate_templated_with_images_and_think() -> None:
    req = gen(images=[PNG], think=False, format="json")
    _, body = ollama.generate_body(req, ollama.sampling(req))
    assert body["messages"][0]["content"][1]["type"] == "image_url"
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(
    ("fields", "extra"),
    [({}, {}), ({"format": "json"}, {"json_schema": {"type": "object"}}),
     ({"format": {"type": "array"}}, {"json_schema": {"type": "array"}}),
     ({"options": {"num_predict": -2, "stop": "\n"}}, {"n_predict": -1, "stop": ["\n"]})],
    ids=["plain", "format-json", "format-schema", "options"],
)
def test_generate_raw_goes_to_completion_untemplated(fields: dict[str, Any], extra: dict[str, Any]) -> None:
    req = gen(raw=True, prompt="<|im_start|>user\nhi", **fields)
    path, body = ollama.generate_body(req, ollama.sampling(req))
    assert path == "/completion"
    assert body == {"prompt": "<|im_start|>user\nhi", "stream": True, **extra}


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [({"raw": True, "template": "{{ .Prompt }}"}, "raw mode"), ({"raw": True, "system": "s"}, "raw mode"),
     ({"raw": True, "context": [1, 2]}, "raw mode"), ({"suffix": "}"}, "suffix"), ({"context": [1, 2, 3]}, "context"),
     ({"raw": True, "images": [PNG]}, "images")],
    ids=["raw-template", "raw-system", "raw-context", "suffix", "context", "raw-images"],
)
def test_check_generate_rejects(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(BadRequest, match=fragment):
        ollama.check_generate(gen(**fields))


@pytest.mark.parametrize("fields", [{}, {"raw": True}, {"system": "s"}, {"context": []}, {"suffix": ""},
                                    {"template": "t"}], ids=["plain", "raw", "system", "empty-context",
                                                             "empty-suffix", "template-without-raw"])
def test_check_generate_accepts(fields: dict[str, Any]) -> None:
    ollama.check_generate(gen(**fields))


@pytest.mark.parametrize(
    ("request_", "vision", "ok"),
    [(chat(), False, True), (chat(messages=[{"role": "user", "content": "x", "images": [PNG]}]), False, False),
     (chat(messages=[{"role": "user", "content": "x", "images": [PNG]}]), True, True),
     (gen(images=[PNG]), False, False), (gen(images=[]), False, True)],
    ids=["no-images", "chat-images-no-vision", "chat-images-vision", "generate-images-no-vision", "empty-images"],
)
def test_check_images(request_: ChatRequest | GenerateRequest, vision: bool, ok: bool) -> None:
    if ok:
        ollama.check_images(ollama.all_images(request_), vision)
    else:
        with pytest.raises(BadRequest, match="cannot read images"):
            ollama.check_images(ollama.all_images(request_), vision)


# ---------------------------------------------------------------------------------------------------------------------
# metrics and answers

TIMINGS = {"cache_n": 100, "prompt_n": 20, "prompt_ms": 12.5, "predicted_n": 7, "predicted_ms": 3.25}


@pytest.mark.parametrize(
    ("timings", "expected"),
    [
        (TIMINGS, {"prompt_eval_count": 120, "prompt_eval_duration": 12_500_000, "eval_count": 7,
                   "eval_duration": 3_250_000}),
        (None, {"prompt_eval_count": 0, "prompt_eval_duration": 0, "eval_count": 0, "eval_duration": 0}),
        ({"prompt_n": 5}, {"prompt_eval_count": 5, "prompt_eval_duration": 0, "eval_count": 0, "eval_duration": 0}),
        ({"cache_n": 9, "prompt_n": 0, "prompt_ms": 0.0004}, {"prompt_eval_count": 9, "prompt_eval_duration": 400,
                                                              "eval_count": 0, "eval_duration": 0}),
    ],
    ids=["full", "none", "partial", "sub-microsecond"],
)
def test_metrics_mapping(timings: dict[str, Any] | None, expected: dict[str, int]) -> None:
    fields = Metrics.of(timings, total_ns=5, load_ns=2).fields()
    assert fields == {"total_duration": 5, "load_duration": 2, **expected}
    assert all(isinstance(v, int) for v in fields.values())


@pytest.mark.parametrize(
    ("finish", "stop_type", "reason"),
    [("stop", None, "stop"), ("length", None, "length"), ("tool_calls", None, "stop"), (None, None, "stop"),
     (None, "limit", "length"), (None, "eos", "stop"), (None, "word", "stop"), (None, "none", "stop")],
    ids=["stop", "length", "tool-calls", "none", "limit", "eos", "word", "none-type"],
)
def test_done_reason(finish: str | None, stop_type: str | None, reason: str) -> None:
    assert ollama.done_reason(finish, stop_type) == reason


@pytest.mark.parametrize(
    ("kind", "unload", "expected"),
    [("chat", False, {"message": {"role": "assistant", "content": ""}, "done_reason": "load"}),
     ("chat", True, {"message": {"role": "assistant", "content": ""}, "done_reason": "unload"}),
     ("generate", False, {"response": "", "done_reason": "load"}),
     ("generate", True, {"response": "", "done_reason": "unload"})],
    ids=["chat-load", "chat-unload", "generate-load", "generate-unload"],
)
def test_load_answer(kind: Any, unload: bool, expected: dict[str, Any]) -> None:
    assert ollama.load_answer(kind, "m:latest", NOW, unload) == {"model": "m:latest", "created_at": NOW,
                                                                  "done": True, **expected}


def _chat_data(message: dict[str, Any], finish: str = "stop", **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish,
                         **extra}], "timings": TIMINGS}


@pytest.mark.parametrize(
    ("kind", "data", "expected"),
    [
        ("chat", _chat_data({"content": "hello"}),
         {"message": {"role": "assistant", "content": "hello"}, "done_reason": "stop"}),
        ("chat", _chat_data({"content": "he"}, "length"),
         {"message": {"role": "assistant", "content": "he"}, "done_reason": "length"}),
        ("chat", _chat_data({"content": None}), {"message": {"role": "assistant", "content": ""},
                                                 "done_reason": "stop"}),
        ("chat", _chat_data({"content": "4", "reasoning_content": "2+2"}),
         {"message": {"role": "assistant", "content": "4", "thinking": "2+2"}, "done_reason": "stop"}),
        ("chat", _chat_data({"content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}, "tool_calls"),
         {"message": {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c1", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}]}, "done_reason": "stop"}),
        ("generate", _chat_data({"content": "text", "reasoning_content": "hm"}),
         {"response": "text", "thinking": "hm", "done_reason": "stop"}),
        ("generate", {"content": "raw text", "stop": True, "stop_type": "limit", "timings": TIMINGS},
         {"response": "raw text", "done_reason": "length"}),
        ("generate", {"content": "raw text", "stop": True, "stop_type": "eos", "timings": TIMINGS},
         {"response": "raw text", "done_reason": "stop"}),
        ("chat", _chat_data({"content": "x"}, logprobs={"content": [
            {"id": 1, "token": "x", "bytes": [120], "logprob": -0.5,
             "top_logprobs": [{"id": 1, "token": "x", "bytes": [120], "logprob": -0.5}]}]}),
         {"message": {"role": "assistant", "content": "x"}, "done_reason": "stop",
          "logprobs": [{"token": "x", "logprob": -0.5, "top_logprobs": [{"token": "x", "logprob": -0.5}]}]}),
    ],
    ids=["chat", "chat-length", "chat-null-content", "chat-thinking", "chat-tool-calls", "generate-chat-route",
         "generate-raw-limit", "generate-raw-eos", "chat-logprobs"],
)
def test_unary_answer(kind: Any, data: dict[str, Any], expected: dict[str, Any]) -> None:
    answer = ollama.unary_answer(AnswerShape(kind, "m"), data, NOW, total_ns=10, load_ns=1)
    metrics = Metrics.of(TIMINGS, 10, 1).fields()
    assert answer == {"model": "m", "created_at": NOW, "done": True, **expected, **metrics}


def test_unary_answer_parses_as_the_official_clients_response() -> None:
    answer = ollama.unary_answer(AnswerShape("chat", "m"), _chat_data({"content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}), NOW, 1, 0)
    parsed = ollama_client.ChatResponse(**answer)
    assert parsed.message.tool_calls is not None and parsed.message.tool_calls[0].function.arguments == {"a": 1}
    generated = ollama_client.GenerateResponse(**ollama.unary_answer(
        AnswerShape("generate", "m"), {"content": "x", "stop_type": "eos"}, NOW, 1, 0))
    assert generated.done and generated.response == "x"


# ---------------------------------------------------------------------------------------------------------------------
# the stream encoder: one test per edge case


def _delta(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "object": "chat.completion.chunk",
            **extra}


def _run(events: list[Any], kind: Any = "chat") -> list[dict[str, Any]]:
    encoder = StreamEncoder(AnswerShape(kind, "m"))
    lines = [line for event in events for line in encoder.feed(event, NOW)]
    return lines + encoder.finish(NOW, total_ns=100, load_ns=0)


def test_stream_first_role_only_delta_sends_nothing() -> None:
    assert StreamEncoder(AnswerShape("chat", "m")).feed(_delta({"role": "assistant", "content": None}), NOW) == []


def test_stream_content_delta_is_one_line() -> None:
    lines = StreamEncoder(AnswerShape("chat", "m")).feed(_delta({"content": "He"}), NOW)
    assert lines == [{"model": "m", "created_at": NOW, "message": {"role": "assistant", "content": "He"},
                      "done": False}]


def test_stream_empty_content_delta_sends_nothing() -> None:
    assert StreamEncoder(AnswerShape("chat", "m")).feed(_delta({"content": ""}), NOW) == []


def test_stream_reasoning_delta_becomes_thinking() -> None:
    [line] = StreamEncoder(AnswerShape("chat", "m")).feed(_delta({"reasoning_content": "hmm"}), NOW)
    assert line["message"] == {"role": "assistant", "content": "", "thinking": "hmm"}


def test_stream_generate_uses_response_and_top_level_thinking() -> None:
    encoder = StreamEncoder(AnswerShape("generate", "m"))
    [text] = encoder.feed(_delta({"content": "a"}), NOW)
    [thought] = encoder.feed(_delta({"reasoning_content": "b"}), NOW)
    assert text == {"model": "m", "created_at": NOW, "response": "a", "done": False}
    assert thought == {"model": "m", "created_at": NOW, "response": "", "thinking": "b", "done": False}


def test_stream_keepalive_comment_sends_nothing() -> None:
    assert StreamEncoder(AnswerShape("chat", "m")).feed(KEEPALIVE, NOW) == []


def test_stream_final_line_has_reason_and_metrics() -> None:
    lines = _run([_delta({"role": "assistant", "content": None}), _delta({"content": "x"}),
                  _delta({}, "length", timings=TIMINGS), ])
    assert [line["done"] for line in lines] == [False, True]
    final = lines[-1]
    assert final["done_reason"] == "length"
    assert final["message"] == {"role": "assistant", "content": ""}
    assert final["prompt_eval_count"] == 120 and final["eval_count"] == 7 and final["total_duration"] == 100


def test_stream_exactly_one_done_line() -> None:
    lines = _run([_delta({"content": "a"}), _delta({"content": "b"}), _delta({}, "stop", timings=TIMINGS)])
    assert sum(1 for line in lines if line["done"]) == 1 and lines[-1]["done"]


def test_stream_usage_chunk_without_choices_is_ignored() -> None:
    lines = _run([_delta({"content": "a"}), _delta({}, "stop", timings=TIMINGS),
                  {"choices": [], "usage": {"prompt_tokens": 1}}])
    assert len(lines) == 2 and lines[-1]["done_reason"] == "stop"


def test_stream_without_finish_reason_ends_with_stop() -> None:
    assert _run([_delta({"content": "a"})])[-1]["done_reason"] == "stop"


def test_stream_without_timings_reports_zero_counts() -> None:
    final = _run([_delta({}, "stop")])[-1]
    assert final["prompt_eval_count"] == 0 and final["eval_count"] == 0


def test_stream_timings_on_every_chunk_keeps_the_last() -> None:
    early = {**TIMINGS, "predicted_n": 1}
    final = _run([_delta({"content": "a"}, timings=early), _delta({}, "stop", timings=TIMINGS)])[-1]
    assert final["eval_count"] == 7


def test_stream_error_event_becomes_an_error_line_and_ends_the_answer() -> None:
    lines = _run([_delta({"content": "a"}), {"error": {"code": 500, "message": "slot died", "type": "server_error"}},
                  _delta({"content": "late"})])
    assert lines == [lines[0], {"error": "slot died"}]


def test_stream_error_event_with_a_string() -> None:
    assert _run([{"error": "plain"}]) == [{"error": "plain"}]


def test_stream_tool_call_fragments_are_sent_whole_at_the_end() -> None:
    events = [
        _delta({"role": "assistant", "content": None}),
        _delta({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]}),
        _delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        _delta({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        _delta({}, "tool_calls", timings=TIMINGS),
    ]
    lines = _run(events)
    assert len(lines) == 2
    assert lines[0]["done"] is False
    assert lines[0]["message"]["tool_calls"] == [
        {"id": "c1", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert lines[1]["done"] and lines[1]["done_reason"] == "stop"
    ollama_client.ChatResponse(**lines[0])  # arguments are an object, as the official client requires


def test_stream_parallel_tool_calls_keep_their_order() -> None:
    events = [
        _delta({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}}]}),
        _delta({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"x":1}'}}]}),
        _delta({}, "tool_calls"),
    ]
    calls = _run(events)[0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert [c["function"]["index"] for c in calls] == [0, 1]


def test_stream_tool_call_with_broken_arguments_keeps_the_text() -> None:
    events = [_delta({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": '{"x":'}}]}),
              _delta({}, "tool_calls")]
    assert _run(events)[0]["message"]["tool_calls"][0]["function"]["arguments"] == {"_raw_arguments": '{"x":'}


def test_stream_content_and_finish_in_one_event() -> None:
    lines = _run([_delta({"content": "end"}, "stop", timings=TIMINGS)])
    assert lines[0]["message"]["content"] == "end" and lines[1]["done"]


def test_stream_logprobs_are_passed_on() -> None:
    logprobs = {"content": [{"token": "a", "logprob": -1.0, "top_logprobs": []}]}
    event = {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None, "logprobs": logprobs}]}
    [line] = StreamEncoder(AnswerShape("chat", "m")).feed(event, NOW)
    assert line["logprobs"] == [{"token": "a", "logprob": -1.0, "top_logprobs": []}]


def test_stream_completion_events_for_raw_generate() -> None:
    events = [{"index": 0, "content": "a", "stop": False}, {"index": 0, "content": "b", "stop": False},
              {"index": 0, "content": "", "stop": True, "stop_type": "limit", "timings": TIMINGS}]
    lines = _run(events, "generate")
    assert [line.get("response") for line in lines] == ["a", "b", ""]
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 7


def test_stream_completion_final_event_with_text_sends_it_first() -> None:
    lines = _run([{"content": "tail", "stop": True, "stop_type": "eos", "timings": TIMINGS}], "generate")
    assert [line["response"] for line in lines] == ["tail", ""] and lines[-1]["done_reason"] == "stop"


def test_stream_completion_stop_word() -> None:
    lines = _run([{"content": "", "stop": True, "stop_type": "word", "stopping_word": "\n"}], "generate")
    assert lines[-1]["done_reason"] == "stop"


def test_stream_progress_events_send_nothing() -> None:
    progress = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}],
                "prompt_progress": {"total": 10, "cache": 0, "processed": 5, "time_ms": 1}}
    assert StreamEncoder(AnswerShape("chat", "m")).feed(progress, NOW) == []


def test_stream_unknown_event_sends_nothing() -> None:
    assert StreamEncoder(AnswerShape("chat", "m")).feed({"something": "else"}, NOW) == []


def test_stream_echoes_the_model_name_as_asked() -> None:
    lines = StreamEncoder(AnswerShape("chat", "tiny:latest")).feed(_delta({"content": "a"}), NOW)
    assert lines[0]["model"] == "tiny:latest"


def test_stream_lines_parse_as_the_official_clients_responses() -> None:
    for line in _run([_delta({"content": "a"}), _delta({"reasoning_content": "b"}), _delta({}, "stop",
                                                                                          timings=TIMINGS)]):
        ollama_client.ChatResponse(**line)
    for line in _run([{"content": "a", "stop": False}, {"content": "", "stop": True, "stop_type": "eos"}],
                     "generate"):
        ollama_client.GenerateResponse(**line)


def test_answer_shape_piece_with_everything() -> None:
    line = AnswerShape("chat", "m").line(Piece("c", "t", [{"function": {"name": "f", "arguments": {}}}],
                                               [{"token": "c", "logprob": 0.0, "top_logprobs": []}]), NOW)
    assert set(line["message"]) == {"role", "content", "thinking", "tool_calls"} and "logprobs" in line


# ---------------------------------------------------------------------------------------------------------------------
# model descriptions

PROPS: dict[str, Any] = {
    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}", "model_ftype": "Q4_K - Medium",
    "chat_template_caps": {"supports_tools": False}, "modalities": {"vision": False}, "eos_token": "<|im_end|>",
}
META: dict[str, Any] = {"n_params": 7_615_616_512, "size": 4_683_073_536, "n_ctx": 8192}


def backend(props: dict[str, Any] | None = None, model_id: str = "qwen") -> BackendInfo:
    return BackendInfo(url="http://x", model_id=model_id, model_path="/m/qwen.gguf", n_slots=2, n_ctx_slot=8192,
                       build_info="b1", fingerprint="abcd", props=PROPS if props is None else props, meta=META)


@pytest.mark.parametrize(
    ("ftype", "level"),
    [("Q4_K - Medium", "Q4_K_M"), ("Q5_K - Small", "Q5_K_S"), ("Q3_K - Large", "Q3_K_L"), ("F16", "F16"),
     ("Q8_0", "Q8_0"), ("", ""), ("IQ2_XS - 2.3125 bpw", "IQ2_XS_2.3125 bpw")],
    ids=["q4km", "q5ks", "q3kl", "f16", "q8", "empty", "other-suffix"],
)
def test_quantization_level(ftype: str, level: str) -> None:
    assert ollama.quantization_level(ftype) == level


@pytest.mark.parametrize(
    ("n", "text"),
    [(7_615_616_512, "7.6B"), (494_032_768, "494.03M"), (3_297_024, "3.30M"), (1_000_000_000, "1.0B"),
     (12_345, "12.35K"), (999, "999"), (0, "0")],
    ids=["7b", "494m", "3m", "1b", "thousands", "small", "zero"],
)
def test_parameter_size(n: int, text: str) -> None:
    assert ollama.parameter_size(n) == text


@pytest.mark.parametrize(
    ("props", "capabilities"),
    [
        (PROPS, ("completion",)),
        ({**PROPS, "chat_template_caps": {"supports_tools": True}}, ("completion", "tools")),
        ({**PROPS, "modalities": {"vision": True}}, ("completion", "vision")),
        ({**PROPS, "chat_template": "{% if enable_thinking %}<think>{% endif %}"}, ("completion", "thinking")),
        ({**PROPS, "chat_template_caps": {"supports_tools": True, "supports_reasoning_effort": True},
          "modalities": {"vision": True}}, ("completion", "tools", "vision", "thinking")),
        ({}, ("completion",)),
    ],
    ids=["text", "tools", "vision", "thinking-template", "everything", "no-props"],
)
def test_capabilities(props: dict[str, Any], capabilities: tuple[str, ...]) -> None:
    assert ollama.model_facts(backend(props), "qwen2", NOW).capabilities == capabilities


def test_tags_entry() -> None:
    entry = ollama.tags_entry(ollama.model_facts(backend(), "qwen2", NOW))
    assert entry["name"] == entry["model"] == "qwen:latest"
    assert entry["modified_at"] == NOW and entry["size"] == 4_683_073_536
    assert len(entry["digest"]) == 64 and int(entry["digest"], 16) >= 0
    assert entry["details"] == {"parent_model": "", "format": "gguf", "family": "qwen2", "families": ["qwen2"],
                                "parameter_size": "7.6B", "quantization_level": "Q4_K_M"}
    ollama_client.ListResponse(models=[entry])


def test_show_answer() -> None:
    answer = ollama.show_answer(ollama.model_facts(backend(), "qwen2", NOW))
    assert answer["model_info"] == {"general.architecture": "qwen2", "general.parameter_count": 7_615_616_512,
                                    "qwen2.context_length": 8192}
    assert answer["parameters"].splitlines() == ["num_ctx 8192", 'stop "<|im_end|>"']
    assert answer["template"] == PROPS["chat_template"] and answer["capabilities"] == ["completion"]
    shown = ollama_client.ShowResponse(**answer)
    assert shown.modelinfo is not None and shown.modelinfo["qwen2.context_length"] == 8192


def test_show_answer_with_unknown_architecture() -> None:
    answer = ollama.show_answer(ollama.model_facts(backend({}), None, NOW))
    assert answer["model_info"]["unknown.context_length"] == 8192
    assert answer["parameters"] == "num_ctx 8192"


def test_ps_entry() -> None:
    entry = ollama.ps_entry(ollama.model_facts(backend(), "qwen2", NOW), "2126-01-01T00:00:00.000000Z")
    assert entry["context_length"] == 8192 and entry["expires_at"].startswith("2126")
    ollama_client.ProcessResponse(models=[entry])


def test_digest_follows_the_fingerprint() -> None:
    a = ollama.model_facts(backend(), "x", NOW).digest
    other = BackendInfo(url="u", model_id="qwen", model_path="", n_slots=1, n_ctx_slot=1, build_info="",
                        fingerprint="other")
    assert a != ollama.model_facts(other, "x", NOW).digest


# ---------------------------------------------------------------------------------------------------------------------
# embeddings


@pytest.mark.parametrize(
    ("fields", "body"),
    [({"input": "a"}, {"input": ["a"]}), ({"input": ["a", "b"]}, {"input": ["a", "b"]}),
     ({"input": "a", "dimensions": 8}, {"input": ["a"], "dimensions": 8})],
    ids=["string", "list", "dimensions"],
)
def test_embed_body(fields: dict[str, Any], body: dict[str, Any]) -> None:
    assert ollama.embed_body(ollama.parse(ollama.EmbedRequest, {"model": "m", **fields})) == body


EMBEDDINGS = {"data": [{"index": 1, "embedding": [0.3, 0.4]}, {"index": 0, "embedding": [0.1, 0.2]}],
              "usage": {"prompt_tokens": 6}}


def test_embed_answer_orders_by_index() -> None:
    assert ollama.embed_answer("m", EMBEDDINGS, 9) == {"model": "m", "embeddings": [[0.1, 0.2], [0.3, 0.4]],
                                                       "total_duration": 9, "load_duration": 0,
                                                       "prompt_eval_count": 6}


@pytest.mark.parametrize(("data", "expected"), [(EMBEDDINGS, {"embedding": [0.1, 0.2]}), ({}, {"embedding": []})],
                         ids=["first", "empty"])
def test_embeddings_answer(data: dict[str, Any], expected: dict[str, Any]) -> None:
    assert ollama.embeddings_answer(data) == expected
