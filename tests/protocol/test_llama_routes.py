"""llama-server's own routes through slotkeeper, against the recording stand-in: what reaches the backend (slot and
prompt caching decided by slotkeeper, its own fields removed, response_fields applied on our side) and what comes
back (llama-server's error shape, the /slots view)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.protocol.fake_upstream import FakeUpstream
from tests.support import Slotkeeper

INFILL = {"id_slot": 7, "input_prefix": "def f():\n", "input_suffix": "\n", "prompt": "    ret",
          "input_extra": [{"text": "x = 1\n", "time": 12.5, "filename": "a.py"}], "n_predict": 4,
          "cache_prompt": False, "response_fields": ["content", "timings/prompt_n"]}


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[tuple[httpx.Client, FakeUpstream]]:
    upstream = FakeUpstream(tmp_path / "slots").start()
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log",
                        extra_args=("--upstream", upstream.url, "--slot-dir", str(upstream.slot_dir)))
    keeper.start()
    try:
        with httpx.Client(base_url=keeper.url, timeout=30) as client:
            yield client, upstream
    finally:
        keeper.stop()
        upstream.stop()


def test_infill_runs_under_slot_control_in_its_own_session(keeper: tuple[httpx.Client, FakeUpstream]) -> None:
    client, upstream = keeper
    response = client.post("/infill", json=INFILL)
    assert response.status_code == 200, response.text
    assert response.headers["x-slotkeeper-session"] == "infill"
    assert response.json() == {"timings/prompt_n": 3}  # the stand-in answers no `content` at the top
    sent = upstream.requests[-1]
    assert sent.path == "/infill"
    assert sent.body["id_slot"] == 0 and sent.body["cache_prompt"] is True
    assert "response_fields" not in sent.body
    assert {k: v for k, v in sent.body.items() if k not in ("id_slot", "cache_prompt")} == {
        k: v for k, v in INFILL.items() if k not in ("id_slot", "cache_prompt", "response_fields")}

    named = client.post("/infill", json={**INFILL, "session_id": "vim-1"}, headers={"X-Session-Id": "editor"})
    assert named.headers["x-slotkeeper-session"] == "editor"
    assert "session_id" not in upstream.requests[-1].body


def test_completion_without_an_id_is_the_default_session(keeper: tuple[httpx.Client, FakeUpstream]) -> None:
    client, upstream = keeper
    response = client.post("/completion", json={"prompt": "hello", "n_predict": 2, "id_slot": 3})
    assert response.status_code == 200, response.text
    assert response.headers["x-slotkeeper-session"] == "default"
    assert response.json()["timings"]["prompt_n"] == 3
    assert upstream.requests[-1].path == "/completion" and upstream.requests[-1].body["id_slot"] == 0
    with client.stream("POST", "/completion", json={"prompt": "hello", "stream": True}) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert b'"timings"' in stream.read()


def test_routes_without_a_slot_pass_through_without_our_fields(keeper: tuple[httpx.Client, FakeUpstream]) -> None:
    client, upstream = keeper
    for path in ("/tokenize", "/detokenize"):
        response = client.post(path, json={"content": "hi", "session_id": "s", "id_slot": 2, "cache_prompt": True})
        assert response.status_code == 200 and response.json() == {"tokens": [1, 2, 3]}, (path, response.text)
        assert upstream.requests[-1].path == path and upstream.requests[-1].body == {"content": "hi"}
        assert "x-slotkeeper-session" not in response.headers


def test_errors_come_in_llama_servers_shape(keeper: tuple[httpx.Client, FakeUpstream]) -> None:
    client, upstream = keeper
    before = len(upstream.requests)
    for path, body in [("/infill", {"input_suffix": ""}), ("/completion", {"n_predict": 1})]:
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert response.json()["error"]["code"] == 400 and response.json()["error"]["message"]
    bad_json = client.post("/infill", content=b"{nope", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == 400
    refused = client.post("/props", json={})
    assert refused.status_code == 405 and refused.json()["error"]["code"] == 405
    assert refused.headers["allow"] == "GET"
    missing = client.post("/embedding", json={"content": "x"})  # the stand-in has no such route: its 404 text
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert len(upstream.requests) == before  # refused requests never reached the backend


def test_slots_and_props_views(keeper: tuple[httpx.Client, FakeUpstream]) -> None:
    client, _ = keeper
    assert client.get("/slots").json() == [{"id": 0, "n_ctx": 4096, "is_processing": False, "n_tokens": 0}]
    assert client.get("/slots", params={"fail_on_no_slot": "1"}).status_code == 200
    props = client.get("/props", params={"autoload": "false"})
    assert props.status_code == 200
    assert props.json()["total_slots"] == 1 and props.json()["n_ctx"] == 4096
    assert props.json()["default_generation_settings"] == {"n_ctx": 4096}
