"""llama-server's own dialect, the pure parts: the /props and /slots views, response_fields, the infill checks and
chain, and errors in llama-server's shape."""

from __future__ import annotations

import json

import pytest

from slotkeeper.cache.chain import common_messages, infill_chain, message_chain
from slotkeeper.dialects import llama
from slotkeeper.errors import BadRequest, NotFound, Overloaded, UpstreamError, UpstreamUnavailable
from slotkeeper.web.errors import Dialect, dialect_of, error_body

MARKER = "SECRET-PROMPT-OF-ANOTHER-SESSION"

# What llama-server's /props answers (this project's build), plus what older builds put in default_generation_settings
# (slot 0's own state, its prompt included) and a field no build has yet.
PROPS = {
    "default_generation_settings": {
        "id": 0, "id_task": 12, "n_ctx": 8192, "is_processing": False, "prompt": f"<|im_start|>user\n{MARKER}",
        "next_token": {"n_remain": 3}, "generated": MARKER,
        "params": {"temperature": 0.8, "top_k": 40, "n_predict": -1, "samplers": ["top_k", "temperature"],
                   "grammar": f'root ::= "{MARKER}"', "stop": [MARKER], "generation_prompt": MARKER,
                   "preserved_tokens": [MARKER]},
    },
    "total_slots": 2, "model_alias": "tiny", "model_path": "/models/tiny.gguf", "model_ftype": "F16",
    "modalities": {"vision": False, "video": False, "audio": False}, "endpoint_slots": True,
    "endpoint_props": False, "chat_template": "{{ messages }}", "chat_template_caps": {"supports_tools": False},
    "bos_token": "<s>", "eos_token": "</s>", "build_info": "b1-abc", "is_sleeping": False,
    "last_request_of_slot_1": MARKER,
}


def test_props_view_keeps_what_clients_read_and_drops_prompts() -> None:
    view = llama.props_view(PROPS, 8192)
    assert MARKER not in json.dumps(view)
    for kept in ("total_slots", "modalities", "chat_template", "build_info", "model_path", "model_alias",
                 "chat_template_caps", "endpoint_slots", "endpoint_props"):
        assert view[kept] == PROPS[kept], kept
    assert view["default_generation_settings"]["n_ctx"] == 8192  # llama.vscode
    assert view["n_ctx"] == 8192  # Maki reads it at the top
    params = view["default_generation_settings"]["params"]
    assert params["top_k"] == 40 and params["samplers"] == ["top_k", "temperature"]
    assert not {"grammar", "stop", "generation_prompt", "preserved_tokens"} & set(params)
    assert set(view["default_generation_settings"]) == {"n_ctx", "params"}


def test_props_view_of_a_router_and_of_sparse_props() -> None:
    router = llama.props_view({"role": "router", "n_ctx": 4096, "build_info": "b2"}, 2048)
    assert router == {"role": "router", "n_ctx": 4096, "build_info": "b2",
                      "default_generation_settings": {"n_ctx": 2048}}
    assert llama.props_view({}, 512)["n_ctx"] == 512


def test_slots_view_holds_counts_only() -> None:
    view = llama.slots_view([(0, False, 0), (1, True, 1234)], 4096)
    assert view == [{"id": 0, "n_ctx": 4096, "is_processing": False, "n_tokens": 0},
                    {"id": 1, "n_ctx": 4096, "is_processing": True, "n_tokens": 1234}]


ANSWER = {"content": "x", "stop": True, "tokens_cached": 40, "truncated": False,
          "timings": {"cache_n": 30, "prompt_n": 10, "predicted_n": 1}, "generation_settings": {"n_predict": 4}}


@pytest.mark.parametrize(("fields", "expected"), [
    (["content", "timings/prompt_n", "truncated", "tokens_cached"],
     {"content": "x", "timings/prompt_n": 10, "truncated": False, "tokens_cached": 40}),
    ([""], {}),  # llama.vim's ring warm-up asks for nothing
    (["timings", "missing", "timings/missing", "content/x"], {"timings": ANSWER["timings"]}),
    (["generation_settings/n_predict"], {"generation_settings/n_predict": 4}),
])
def test_select_fields_is_llama_servers_response_fields(fields: list[str], expected: dict) -> None:
    assert llama.select_fields(ANSWER, fields) == expected
    assert llama.select_fields([ANSWER, ANSWER], fields) == [expected, expected]


def test_response_fields_only_when_a_list_of_strings() -> None:
    assert llama.response_fields({"response_fields": ["content"]}) == ["content"]
    for ignored in (None, [], "content", ["content", 1], {"content": 1}):
        assert llama.response_fields({"response_fields": ignored}) is None
    assert llama.select_fields(ANSWER, None) is ANSWER


def test_final_event_filter_rewrites_only_the_final_event() -> None:
    partial = b'data: {"content":"a","stop":false}\n\n'
    final = b"data: " + json.dumps(ANSWER).encode() + b"\n\n"
    stream = partial + final
    out = llama.FinalEventFilter(["content", "timings/cache_n"])
    pieces = [out.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)] + [out.finish()]
    joined = b"".join(pieces)
    assert joined.startswith(partial)
    events = [json.loads(e[5:]) for e in joined.split(b"\n\n") if e]
    assert events == [{"content": "a", "stop": False}, {"content": "x", "timings/cache_n": 30}]
    error = b'data: {"error":{"code":500,"message":"m","type":"server_error"}}\n\n'
    assert llama.FinalEventFilter(["content"]).feed(error) == error


@pytest.mark.parametrize("body", [
    {"input_suffix": ""}, {"input_prefix": ""}, {"input_prefix": 1, "input_suffix": ""},
    {"input_prefix": "", "input_suffix": "", "prompt": 3},
    {"input_prefix": "", "input_suffix": "", "input_extra": {"text": "x"}},
    {"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a.py"}]},
    {"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "x", "filename": 2}]},
])
def test_infill_checks_refuse_what_the_backend_would_fail_on(body: dict) -> None:
    with pytest.raises(BadRequest):
        llama.check_infill_request(body)


def test_infill_checks_accept_llama_vim_shapes() -> None:
    llama.check_infill_request({"input_prefix": "", "input_suffix": "", "prompt": "",
                                "input_extra": [{"text": "x", "time": 1.5, "filename": "a.py"}]})
    llama.check_infill_request({"input_prefix": "a", "input_suffix": "b"})


def test_infill_chain_follows_the_prompt_layout() -> None:
    extra = [{"text": "import os\n", "filename": "a.py"}]
    base = {"input_extra": extra, "input_prefix": "def f():\n", "prompt": "    ret", "input_suffix": "\n"}
    chain = infill_chain(base)
    assert len(chain) == 4 and chain == infill_chain(dict(base))
    assert common_messages(chain, infill_chain({**base, "prompt": "    retu"})) == 2  # typing on the line
    assert common_messages(chain, infill_chain({**base, "input_suffix": "x"})) == 3
    assert common_messages(chain, infill_chain({**base, "input_prefix": "class A:\n"})) == 1  # another place
    warm_up = infill_chain({"input_extra": extra, "input_prefix": "", "input_suffix": "", "prompt": ""})
    assert common_messages(chain, warm_up) == 1
    assert common_messages(chain, infill_chain({**base, "input_extra": []})) == 0
    assert chain[-1].chars > chain[0].chars
    # Never the chain of a chat, whatever its messages hold.
    assert not {link.digest for link in chain} & {link.digest for link in message_chain([extra, "def f():\n"])}


def test_errors_in_llama_servers_shape() -> None:
    assert dialect_of("/infill") is dialect_of("/props") is dialect_of("/slots/0") is Dialect.LLAMA
    assert dialect_of("/v1/completions") is Dialect.OPENAI
    for error, status, kind in [(BadRequest("b"), 400, "invalid_request_error"), (NotFound("n"), 404,
                                "not_found_error"), (Overloaded("no slot available"), 503, "unavailable_error"),
                                (UpstreamUnavailable("down"), 502, "unavailable_error")]:
        assert error_body(Dialect.LLAMA, error) == {"error": {"code": status, "message": error.message,
                                                              "type": kind}}
    own = b'{"error":{"code":501,"message":"Infill is not supported by this model","type":"not_supported_error"}}'
    assert error_body(Dialect.LLAMA, UpstreamError(501, own)) == json.loads(own)
    partial = error_body(Dialect.LLAMA, UpstreamError(400, b'{"error": {"message": "Invalid filename"}}'))
    assert partial == {"error": {"message": "Invalid filename", "code": 400, "type": "invalid_request_error"}}
    text = error_body(Dialect.LLAMA, UpstreamError(404, b"Not Found"))
    assert text == {"error": {"code": 404, "message": "Not Found", "type": "not_found_error"}}
    assert llama.error_event(BadRequest("b")).startswith(b'data: {"error": {"code": 400')
