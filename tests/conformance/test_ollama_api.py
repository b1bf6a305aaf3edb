"""Checklist 8.1 (Ollama) over plain HTTP against slotkeeper on a real llama-server: shapes, statuses, framing,
options, errors. Assertions are on counts, shapes, headers and statuses, never on the random model's text."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest

from tests.support import Slotkeeper, turn_log, wait_until, words

pytestmark = pytest.mark.backend

MODEL = "tiny"
SERVED = "tiny:latest"
N_CTX_SLOT = 8192
METRICS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
           "eval_duration")


@pytest.fixture
def client(keeper: Slotkeeper) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keeper.url, timeout=120) as c:
        yield c


def session() -> dict[str, str]:
    return {"X-Session-Id": f"conf-{uuid.uuid4().hex[:12]}"}


def user(text: str = "Tell me about the weather.") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def lines_of(response: httpx.Response) -> list[dict[str, Any]]:
    text = response.text
    assert text.endswith("\n")
    return [json.loads(line) for line in text.split("\n")[:-1]]


def chat_body(**extra: Any) -> dict[str, Any]:
    # Greedy, so that no early end-of-text makes a count differ between runs.
    return {"model": MODEL, "messages": user(), "options": {"num_predict": 4, "temperature": 0}, **extra}


def turns_seen(keeper: Slotkeeper) -> int:
    return keeper.log_text().count("INFO slotkeeper.turn:")


# -- discovery routes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_root_says_ollama_is_running(client: httpx.Client, method: str) -> None:
    response = client.request(method, "/")
    assert response.status_code == 200
    if method == "GET":
        assert response.text == "Ollama is running"


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_version_is_dotted_integers(client: httpx.Client, method: str) -> None:
    response = client.request(method, "/api/version")
    assert response.status_code == 200
    if method == "GET":
        version = response.json()["version"]
        assert re.fullmatch(r"\d+(\.\d+)*", version)
        # OpenWebUI's own parse of the version string.
        assert all(isinstance(n, int) for n in tuple(map(int, re.sub(r"^v|-.*", "", version).split("."))))


def test_tags_lists_the_served_model(client: httpx.Client) -> None:
    response = client.get("/api/tags")
    assert response.status_code == 200
    [entry] = response.json()["models"]
    assert entry["name"] == entry["model"] == SERVED
    datetime.fromisoformat(entry["modified_at"])
    assert isinstance(entry["size"], int) and entry["size"] > 0
    assert isinstance(entry["digest"], str) and len(entry["digest"]) == 64
    details = entry["details"]
    assert set(details) >= {"parent_model", "format", "family", "families", "parameter_size", "quantization_level"}
    assert details["format"] == "gguf" and details["family"] == "llama" and details["families"] == ["llama"]
    assert client.head("/api/tags").status_code == 200


@pytest.mark.parametrize("field", ["model", "name"])
@pytest.mark.parametrize("name", [MODEL, SERVED])
def test_show_accepts_bare_and_tagged_names_and_the_deprecated_field(client: httpx.Client, name: str,
                                                                     field: str) -> None:
    response = client.post("/api/show", json={field: name})
    assert response.status_code == 200
    body = response.json()
    assert body["model_info"]["general.architecture"] == "llama"
    assert body["model_info"]["llama.context_length"] == N_CTX_SLOT
    assert f"num_ctx {N_CTX_SLOT}" in body["parameters"].splitlines()
    assert isinstance(body["template"], str) and "im_start" in body["template"]
    assert "completion" in body["capabilities"]
    assert "vision" not in body["capabilities"] and "tools" not in body["capabilities"]  # no mmproj, no tool template
    assert body["details"]["format"] == "gguf"
    datetime.fromisoformat(body["modified_at"])


def test_maki_reads_its_context_window_from_show(client: httpx.Client) -> None:
    info = client.post("/api/show", json={"model": MODEL}).json()
    arch = info["model_info"]["general.architecture"]
    assert info["model_info"][f"{arch}.context_length"] == N_CTX_SLOT


@pytest.mark.parametrize("route", ["/api/show", "/api/chat", "/api/generate", "/api/embed", "/api/embeddings"])
def test_unknown_model_is_404_without_reaching_the_backend(client: httpx.Client, keeper: Slotkeeper,
                                                           route: str) -> None:
    before = turns_seen(keeper)
    body = {"model": "llama3:8b", "messages": user(), "prompt": "hi", "input": "hi"}
    response = client.post(route, json=body)
    assert response.status_code == 404
    assert response.json() == {"error": "model 'llama3:8b' not found"}
    assert turns_seen(keeper) == before


def test_ps_lists_the_loaded_model(client: httpx.Client) -> None:
    [entry] = client.get("/api/ps").json()["models"]
    assert set(entry) >= {"name", "model", "size", "digest", "details", "expires_at", "size_vram", "context_length"}
    assert entry["name"] == entry["model"] == SERVED
    assert entry["context_length"] == N_CTX_SLOT
    assert datetime.fromisoformat(entry["expires_at"]) > datetime.fromisoformat(client.get("/api/tags").json()[
        "models"][0]["modified_at"])


# -- /api/chat --------------------------------------------------------------------------------------------------------


def test_chat_streams_ndjson_by_default(client: httpx.Client, keeper: Slotkeeper) -> None:
    headers = session()
    response = client.post("/api/chat", json=chat_body(), headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    assert "data:" not in response.text and "[DONE]" not in response.text
    lines = lines_of(response)
    *partial, final = lines
    assert partial, "at least one content line before the final one"
    for line in partial:
        assert set(line) == {"model", "created_at", "message", "done"}
        assert line["done"] is False and line["model"] == MODEL
        assert line["message"]["role"] == "assistant" and isinstance(line["message"]["content"], str)
        datetime.fromisoformat(line["created_at"])
    assert final["done"] is True and final["done_reason"] in ("stop", "length")
    assert final["message"] == {"role": "assistant", "content": ""}
    for name in METRICS:
        assert isinstance(final[name], int) and final[name] >= 0, name
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"]
    # Ollama's mapping of llama-server's timings, checked against slotkeeper's own log line for this request.
    assert wait_until(lambda: turn_log(keeper, headers["X-Session-Id"]))
    [logged] = turn_log(keeper, headers["X-Session-Id"])
    assert final["prompt_eval_count"] == int(logged["cache_n"]) + int(logged["prompt_n"])
    assert final["eval_count"] == 4 and 1 <= len(partial) <= 4  # a split UTF-8 character waits for its rest


def test_chat_without_streaming_is_one_object(client: httpx.Client) -> None:
    response = client.post("/api/chat", json=chat_body(stream=False), headers=session())
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    body = response.json()
    assert body["done"] is True and body["model"] == MODEL
    assert body["message"]["role"] == "assistant" and isinstance(body["message"]["content"], str)
    assert all(isinstance(body[name], int) for name in METRICS)
    assert response.headers["x-slotkeeper-cache"] in ("hot", "cold", "restored")


def test_num_predict_limits_the_answer(client: httpx.Client) -> None:
    body = client.post("/api/chat", json=chat_body(stream=False, options={"num_predict": 5, "temperature": 0}),
                       headers=session()).json()
    assert body["eval_count"] <= 5 and body["done_reason"] == "length"


def test_root_level_num_predict_is_accepted(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": user(), "num_predict": 3, "stream": False, "options": {"temperature": 0}}
    answer = client.post("/api/chat", json=body, headers=session()).json()
    assert answer["eval_count"] == 3 and answer["done_reason"] == "length"


def test_stop_is_honoured(client: httpx.Client) -> None:
    options: dict[str, Any] = {"num_predict": 12, "temperature": 0, "seed": 1}
    first = client.post("/api/chat", json=chat_body(stream=False, options=options), headers=session()).json()
    text = first["message"]["content"]
    stop = next((ch for ch in text[1:] if ch.isascii() and ch.isprintable() and not ch.isspace()), None)
    assert stop is not None, repr(text)
    second = client.post("/api/chat", json=chat_body(stream=False, options={**options, "stop": [stop]}),
                         headers=session()).json()
    assert stop not in second["message"]["content"]
    assert second["done_reason"] == "stop" and second["eval_count"] < first["eval_count"]


def test_temperature_zero_with_seed_is_deterministic(client: httpx.Client) -> None:
    body = chat_body(stream=False, options={"num_predict": 8, "temperature": 0, "seed": 42})
    answers = []
    for _ in range(2):
        assert client.post("/api/sessions/clear").status_code == 200  # the same (empty) slot state both times
        answers.append(client.post("/api/chat", json=body, headers=session()).json()["message"]["content"])
    assert answers[0] == answers[1]


def test_unknown_and_launch_time_options_are_accepted_and_noted(client: httpx.Client) -> None:
    options = {"num_predict": 2, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "tfs_z": 1.0,
               "num_gpu": 99, "num_thread": 4, "penalize_newline": True, "num_ctx": 4096, "use_mmap": True}
    response = client.post("/api/chat", json=chat_body(stream=False, options=options), headers=session())
    assert response.status_code == 200
    noted = response.headers["x-slotkeeper-ignored-options"].split(",")
    assert set(noted) == {"num_ctx", "num_gpu", "num_thread", "penalize_newline", "tfs_z", "use_mmap"}


def test_num_predict_minus_two_is_accepted(client: httpx.Client) -> None:
    # -2 ("fill the context") would run to 8192 tokens: read the start of the stream, then hang up.
    with client.stream("POST", "/api/chat", json=chat_body(options={"num_predict": -2, "temperature": 0}),
                       headers=session()) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = json.loads(next(lines))
    assert first["done"] is False


@pytest.mark.parametrize("think", [False, True])
def test_think_is_accepted_and_a_model_without_reasoning_sends_no_thinking(client: httpx.Client,
                                                                           think: bool) -> None:
    response = client.post("/api/chat", json=chat_body(stream=False, think=think), headers=session())
    assert response.status_code == 200
    assert "thinking" not in response.json()["message"]


def test_format_json_on_raw_generate_gives_json(client: httpx.Client) -> None:
    prompt = "<|im_start|>user\nGive me an object<|im_end|>\n<|im_start|>assistant\n"
    body = {"model": MODEL, "prompt": prompt, "raw": True, "format": "json", "stream": False,
            "options": {"temperature": 0, "num_predict": 200}}
    answer = client.post("/api/generate", json=body, headers=session()).json()
    assert answer["done_reason"] == "stop"
    assert isinstance(json.loads(answer["response"]), dict)


def test_format_schema_on_raw_generate_validates(client: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    prompt = "<|im_start|>user\nA number<|im_end|>\n<|im_start|>assistant\n"
    body = {"model": MODEL, "prompt": prompt, "raw": True, "format": schema, "stream": False,
            "options": {"temperature": 0, "num_predict": 200}}
    answer = client.post("/api/generate", json=body, headers=session()).json()
    assert answer["done_reason"] == "stop"
    parsed = json.loads(answer["response"])
    assert set(parsed) == {"n"} and isinstance(parsed["n"], int)


@pytest.mark.parametrize("fmt", ["json", {"type": "object"}])
def test_format_on_chat_reaches_the_backend_as_a_response_format(client: httpx.Client, fmt: Any) -> None:
    """This llama-server build cannot build a grammar for the tiny model's chat template ("Failed to initialize
    samplers"); whatever it answers must come back in Ollama's shape, and JSON when it succeeds."""
    response = client.post("/api/chat", json=chat_body(stream=False, format=fmt, options={"num_predict": 50}),
                           headers=session())
    if response.status_code == 200 and response.json()["done_reason"] == "stop":
        json.loads(response.json()["message"]["content"])
    else:
        assert response.status_code in (200, 400)
        assert response.status_code == 200 or isinstance(response.json()["error"], str)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tools_are_accepted_by_a_model_without_tool_support(client: httpx.Client) -> None:
    response = client.post("/api/chat", json=chat_body(stream=False, tools=TOOLS), headers=session())
    assert response.status_code == 200
    assert response.json()["done_reason"] in ("stop", "length")


def test_tool_call_follow_up_with_object_arguments(client: httpx.Client) -> None:
    messages = [*user("Weather in Paris?"),
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "22 degrees", "tool_name": "get_weather"}]
    response = client.post("/api/chat", json=chat_body(messages=messages, tools=TOOLS, stream=False),
                           headers=session())
    assert response.status_code == 200, response.text


def test_images_without_a_projector_are_a_clear_400(client: httpx.Client, keeper: Slotkeeper) -> None:
    before = turns_seen(keeper)
    messages = [{"role": "user", "content": "what is this?", "images": ["iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB"]}]
    response = client.post("/api/chat", json=chat_body(messages=messages), headers=session())
    assert response.status_code == 400
    assert "cannot read images" in response.json()["error"]
    assert turns_seen(keeper) == before


@pytest.mark.parametrize(("extra", "reason"), [({}, "load"), ({"keep_alive": 0}, "unload"),
                                               ({"keep_alive": "0s"}, "unload"), ({"stream": False}, "load")])
def test_empty_messages_load_or_unload(client: httpx.Client, keeper: Slotkeeper, extra: dict[str, Any],
                                       reason: str) -> None:
    before = turns_seen(keeper)
    response = client.post("/api/chat", json={"model": SERVED, "messages": [], **extra})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["done"] is True and body["done_reason"] == reason
    assert body["message"] == {"role": "assistant", "content": ""} and body["model"] == SERVED
    assert turns_seen(keeper) == before


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(b"", "empty"), (b"{", "not valid JSON"), (b"[]", "must be a JSON object"),
     (b'{"messages": []}', "'model' is required"),
     (b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}', "'messages.0.content'"),
     (b'{"model": "tiny", "messages": [], "options": {"temperature": "warm"}}', "'options.temperature'"),
     (b'{"model": "tiny", "messages": [], "keep_alive": "soon"}', "keep_alive")],
    ids=["empty", "truncated", "array", "no-model", "content-int", "temperature-string", "bad-keep-alive"],
)
def test_bad_requests_are_400_with_a_readable_error(client: httpx.Client, content: bytes, fragment: str) -> None:
    response = client.post("/api/chat", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert fragment in response.json()["error"]


@pytest.mark.parametrize("stream", [True, False])
def test_backend_error_before_the_first_byte_keeps_its_status(client: httpx.Client, stream: bool) -> None:
    body = chat_body(messages=user(words(20000, 3)), stream=stream)
    response = client.post("/api/chat", json=body, headers=session())
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    assert "exceeds the available context size" in response.json()["error"]


@pytest.mark.parametrize("name", [MODEL, SERVED])
def test_model_name_is_echoed_as_requested(client: httpx.Client, name: str) -> None:
    lines = lines_of(client.post("/api/chat", json=chat_body(model=name), headers=session()))
    assert {line["model"] for line in lines} == {name}


def test_client_disconnect_cancels_the_backend(client: httpx.Client, keeper: Slotkeeper) -> None:
    assert keeper.upstream is not None
    body = chat_body(options={"num_predict": 4000, "temperature": 0})
    with client.stream("POST", "/api/chat", json=body,
                       headers={**session(), "X-Conversation-Id": "must-not-reach-llama-server"}) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    with httpx.Client(base_url=keeper.upstream.url, timeout=10) as backend:
        assert wait_until(lambda: not backend.get("/slots").json()[0]["is_processing"], timeout=10)
    after = client.post("/api/chat", json=chat_body(stream=False), headers=session())
    assert after.status_code == 200


# -- /api/generate ----------------------------------------------------------------------------------------------------


def test_generate_streams_response_lines(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "system": "You tell stories.", "options": {
        "num_predict": 3, "temperature": 0}}
    lines = lines_of(client.post("/api/generate", json=body, headers=session()))
    *partial, final = lines
    assert partial and all(set(line) == {"model", "created_at", "response", "done"} for line in partial)
    assert final["done"] is True and final["response"] == "" and final["done_reason"] == "length"
    assert all(isinstance(final[name], int) for name in METRICS)
    assert final["eval_count"] == 3
    assert "context" not in final  # token ids are not available through the chat route (see docs/ollama.md)


def test_generate_raw_goes_untemplated(client: httpx.Client, keeper: Slotkeeper) -> None:
    headers = session()
    body = {"model": MODEL, "prompt": "abc", "raw": True, "stream": False, "options": {"num_predict": 2,
                                                                                         "temperature": 0}}
    answer = client.post("/api/generate", json=body, headers=headers).json()
    assert answer["done"] is True and 1 <= answer["eval_count"] <= 2 and "context" not in answer
    assert wait_until(lambda: turn_log(keeper, headers["X-Session-Id"]))
    [logged] = turn_log(keeper, headers["X-Session-Id"])
    # "abc" untemplated is a handful of tokens; through the chat template it would be more than ten.
    assert answer["prompt_eval_count"] == int(logged["cache_n"]) + int(logged["prompt_n"]) <= 5


def test_generate_templated_prompt_is_longer_than_raw(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "abc", "stream": False, "options": {"num_predict": 1}}
    templated = client.post("/api/generate", json=body, headers=session()).json()["prompt_eval_count"]
    raw = client.post("/api/generate", json={**body, "raw": True}, headers=session()).json()["prompt_eval_count"]
    assert templated > raw


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [({"raw": True, "template": "{{ .Prompt }}"}, "raw mode"), ({"raw": True, "system": "s"}, "raw mode"),
     ({"suffix": "end"}, "suffix"), ({"context": [1, 2, 3]}, "context")],
    ids=["raw-template", "raw-system", "suffix", "context"],
)
def test_generate_rejects_what_it_cannot_do(client: httpx.Client, extra: dict[str, Any], fragment: str) -> None:
    response = client.post("/api/generate", json={"model": MODEL, "prompt": "x", **extra})
    assert response.status_code == 400 and fragment in response.json()["error"]


@pytest.mark.parametrize(("extra", "reason"), [({}, "load"), ({"keep_alive": 0}, "unload")])
def test_generate_empty_prompt_loads_or_unloads(client: httpx.Client, extra: dict[str, Any], reason: str) -> None:
    response = client.post("/api/generate", json={"model": MODEL, "prompt": "", **extra})
    assert response.headers["content-type"].startswith("application/json")
    assert response.json() == {"model": MODEL, "created_at": response.json()["created_at"], "response": "",
                               "done": True, "done_reason": reason}


# -- embeddings, model store, method hygiene --------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "body"), [("/api/embed", {"input": "hello"}), ("/api/embed", {"input": ["a"]}),
                                             ("/api/embeddings", {"prompt": "hello"})])
def test_embeddings_without_an_embedding_backend_are_a_clear_error(client: httpx.Client, route: str,
                                                                   body: dict[str, Any]) -> None:
    response = client.post(route, json={"model": MODEL, **body})
    assert response.status_code == 501
    assert "embeddings" in response.json()["error"]


def test_pull_of_the_served_model_succeeds(client: httpx.Client) -> None:
    assert lines_of(client.post("/api/pull", json={"model": SERVED}))[-1] == {"status": "success"}
    response = client.post("/api/pull", json={"model": MODEL, "stream": False})
    assert response.json() == {"status": "success"}


def test_pull_of_another_model_is_an_error(client: httpx.Client) -> None:
    response = client.post("/api/pull", json={"model": "llama3:8b"})
    assert response.status_code == 404 and "llama3:8b" in response.json()["error"]


@pytest.mark.parametrize(("method", "route", "body"), [
    ("POST", "/api/push", {"model": MODEL}), ("POST", "/api/create", {"model": "x", "from": MODEL}),
    ("POST", "/api/copy", {"source": MODEL, "destination": "y"}), ("DELETE", "/api/delete", {"model": MODEL}),
    ("POST", "/api/blobs/sha256:00", {}),
])
def test_model_store_routes_are_not_supported(client: httpx.Client, method: str, route: str,
                                              body: dict[str, Any]) -> None:
    response = client.request(method, route, json=body)
    assert response.status_code == 501
    assert "not supported" in response.json()["error"]


def test_blob_check_says_absent(client: httpx.Client) -> None:
    assert client.head("/api/blobs/sha256:00").status_code == 404


@pytest.mark.parametrize(("method", "route"), [("GET", "/api/chat"), ("GET", "/api/generate"),
                                               ("POST", "/api/tags"), ("PUT", "/api/show"), ("POST", "/api/ps")])
def test_wrong_method_is_405(client: httpx.Client, method: str, route: str) -> None:
    response = client.request(method, route)
    assert response.status_code == 405 and "not allowed" in response.json()["error"]


def test_unknown_api_path_is_404_in_ollama_shape(client: httpx.Client) -> None:
    response = client.get("/api/nothing-here")
    assert response.status_code == 404 and isinstance(response.json()["error"], str)


def test_session_api_is_not_shadowed(client: httpx.Client) -> None:
    assert client.get("/api/sessions").status_code == 200
    assert client.get("/api/sessions/current").status_code == 200
