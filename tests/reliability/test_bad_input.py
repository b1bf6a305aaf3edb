"""Bad input gets a clear 4xx and writes nothing outside the slot dir: malformed and deeply nested JSON, wrong
types, long and odd session ids; plus a property test over the body parser."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotkeeper.dialects import openai
from slotkeeper.errors import BadRequest
from tests.protocol.fake_upstream import FakeUpstream
from tests.support import Slotkeeper


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Slotkeeper, FakeUpstream, Path]]:
    root = tmp_path_factory.mktemp("bad-input")
    upstream = FakeUpstream(root / "slots").start()
    keeper = Slotkeeper(root / "cache", root / "slotkeeper.log")
    keeper.extra_args = ("--upstream", upstream.url, "--slot-dir", str(upstream.slot_dir))
    keeper.start()
    try:
        yield keeper, upstream, root
    finally:
        keeper.stop()
        upstream.stop()


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.endswith(".log")}


DEEP = b"[" * 100_000 + b"]" * 100_000
BAD_BODIES = [
    (b"{", "not valid JSON"),
    (DEEP, "nested"),
    (b'{"messages": ' + DEEP + b"}", "nested"),
    (b'{"messages": "hello"}', "messages"),
    (b'{"messages": [], "max_tokens": 1}', "messages"),
    (b"null", "JSON object"),
    (b'"just a string"', "JSON object"),
    ('{"messages": [{"role": "user", "content": "x"}], "session_id": "' + "s" * 10_000 + '"}', "256"),
    ('{"messages": [{"role": "user", "content": "x"}], "session_id": "a\\u0000b"}', "control"),
    ('{"messages": [{"role": "user", "content": "x"}], "session_id": "\\ud800"}', "surrogate"),
    # Found by fuzzing: Python's json accepts these, and encoding the body again for the backend failed (a 500).
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "NaN"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": -Infinity}', "NaN"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}', "NaN"),
    (b'{"messages": [{"role": "user", "content": "\\udc00 lone"}]}', "surrogate"),
    (b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 300 + b"]" * 300 + b"}", "nested"),
    (b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 950 + b"]" * 950 + b"}", "nested"),
]


@pytest.mark.parametrize(("raw", "fragment"), BAD_BODIES,
                         ids=["truncated", "deep-array", "deep-field", "messages-string", "messages-empty", "null",
                              "string", "id-10kB", "id-nul", "id-surrogate", "nan", "-infinity", "1e400",
                              "content-surrogate", "depth-300", "depth-950"])
def test_bad_bodies_get_a_clear_400(fake: tuple[Slotkeeper, FakeUpstream, Path], raw: bytes | str,
                                    fragment: str) -> None:
    keeper, upstream, root = fake
    before, count = _files(root), len(upstream.requests)
    with httpx.Client(base_url=keeper.url, timeout=30) as c:
        response = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    assert fragment in response.json()["error"]["message"]
    assert len(upstream.requests) == count and _files(root) == before


CHAT = {"role": "user", "content": "x"}
# One body per dialect route, each with a value the backend could not be sent; the error comes in that dialect.
UNSENDABLE = [
    ("/api/chat", b'{"model": "fake", "stream": false, "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/api/chat", b'{"model": "fake", "options": {"temperature": NaN}, "messages": [{"role": "user", "content": ""}]}'),
    ("/api/generate", b'{"model": "fake", "stream": false, "prompt": "x", "keep_alive": 1e400}'),
    ("/v1/messages", b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/messages", b'{"model": "m", "max_tokens": 5, "top_p": NaN, "messages": [{"role": "user", "content": "x"}]}'),
    ("/v1/embeddings", b'{"input": "\\ud800"}'),
]


@pytest.mark.parametrize(("path", "raw"), UNSENDABLE,
                         ids=["ollama-surrogate", "ollama-nan", "generate-1e400", "anthropic-surrogate",
                              "anthropic-nan", "embeddings-surrogate"])
def test_unsendable_values_get_a_400_in_the_clients_dialect(fake: tuple[Slotkeeper, FakeUpstream, Path], path: str,
                                                            raw: bytes) -> None:
    keeper, upstream, _ = fake
    count = len(upstream.requests)
    with httpx.Client(base_url=keeper.url, timeout=30) as c:
        response = c.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    body = response.json()
    message = (body["error"] if path.startswith("/api/") else body["error"]["message"])
    assert isinstance(message, str) and ("surrogate" in message or "NaN" in message)
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert len(upstream.requests) == count


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_odd_option_names_are_reported_in_a_safe_header(fake: tuple[Slotkeeper, FakeUpstream, Path],
                                                        stream: bool) -> None:
    # Found by fuzzing: an unknown option named with characters a header cannot hold was a 500, and on a stream the
    # turn was never closed, so its slot stayed taken and every later request (and shutdown) waited for it forever.
    keeper, _, _ = fake
    body = {"model": "fake", "stream": stream, "messages": [CHAT],
            "options": {"ключ": 1, "x\r\nX-Injected: yes": 2, "num_ctx": 8}}
    with httpx.Client(base_url=keeper.url, timeout=10) as c:
        response = c.post("/api/chat", json=body, headers={"X-Session-Id": f"odd-options-{stream}"})
        assert response.status_code == 200, response.text[:300]
        names = response.headers["x-slotkeeper-ignored-options"].split(",")
        assert "x-injected" not in response.headers
        assert sorted(names) == sorted(["num_ctx", "%D0%BA%D0%BB%D1%8E%D1%87", "x%0D%0AX-Injected%3A%20yes"])
        # The slot was released: the next request on it is answered at once.
        again = c.post("/api/chat", json={"model": "fake", "stream": False, "messages": [CHAT]})
        assert again.status_code == 200


ROUTING = [
    ("GET", "/v1/nothing", 404, "openai", None),
    ("GET", "/v1/chat/completions", 405, "openai", "POST"),
    ("POST", "/v1/messages/a%0Ab", 404, "anthropic", None),
    ("GET", "/v1/messages", 405, "anthropic", "POST"),
    ("GET", "/api/nothing-here", 404, "ollama", None),
    ("GET", "/api/no%0Athing", 404, "ollama", None),
    ("PUT", "/api/requests/recent", 405, "ollama", "GET"),
    ("PUT", "/api/sessions/current", 405, "openai", "GET, DELETE"),
    ("POST", "/api/tags", 405, "ollama", "GET, HEAD"),
]


@pytest.mark.parametrize(("method", "path", "status", "dialect", "allow"), ROUTING,
                         ids=[f"{m} {p}" for m, p, *_ in ROUTING])
def test_unknown_routes_and_methods_answer_in_the_paths_dialect(
        fake: tuple[Slotkeeper, FakeUpstream, Path], method: str, path: str, status: int, dialect: str,
        allow: str | None) -> None:
    # Found by fuzzing: paths no route matched (a newline in a path parameter) got FastAPI's {"detail": ...}, and a
    # wrong method on some /api routes was a 404, or a 405 without the Allow header RFC 9110 requires.
    keeper, _, _ = fake
    with httpx.Client(base_url=keeper.url, timeout=30) as c:
        response = c.request(method, path)
    assert response.status_code == status
    body = response.json()
    if dialect == "ollama":
        assert isinstance(body["error"], str) and body["error"]
    elif dialect == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] in ("not_found_error", "invalid_request_error")
    else:
        assert body["error"]["message"] and body["error"]["type"]
    assert response.headers.get("allow") == allow


@pytest.mark.parametrize("session", ["../../etc/passwd", "a/b\\c", "..", "ключ-сессии", "😀" * 50, "con", " x "],
                         ids=["traversal", "separators", "dotdot", "cyrillic", "emoji", "reserved", "spaces"])
def test_odd_session_ids_are_just_names(fake: tuple[Slotkeeper, FakeUpstream, Path], session: str) -> None:
    keeper, _, root = fake
    body = {"messages": [{"role": "user", "content": "x"}], "session_id": session}
    before = _files(root)
    with httpx.Client(base_url=keeper.url, timeout=30) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert c.post("/api/sessions/clear").status_code == 200  # forces a save under the odd id
        rows = c.get("/api/sessions").json()["sessions"]
    saved = next((r for r in rows if r["session"] == session.strip()), None)
    # (Once on CI, under load, the row was missing: what the service did is printed to find out why.)
    assert saved is not None, (rows, keeper.log_path.read_text(errors="replace").splitlines()[-40:])
    assert re.fullmatch(r"[0-9a-f]{40}-[0-9a-f]{8}\.bin", saved["file"])
    created = _files(root) - before
    # The only new files: snapshots the index lists, in the slot dir (an earlier test's conversation may be saved
    # when this request takes its slot), and the index's own journal files.
    listed = {f"slots/{r['file']}" for r in rows}
    assert f"slots/{saved['file']}" in created
    assert all(p in listed or p.startswith("cache/index.sqlite3") for p in created), created


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20).map(lambda v: json.dumps(v).encode())))
def test_the_body_parser_either_parses_or_says_why(raw: bytes) -> None:
    try:
        body = openai.parse_body(raw)
        openai.check_chat_request(body)
    except BadRequest as exc:
        assert exc.status_code == 400 and exc.message
    else:
        assert isinstance(body, dict) and isinstance(body["messages"], list) and body["messages"]
