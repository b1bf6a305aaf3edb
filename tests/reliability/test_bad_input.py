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
]


@pytest.mark.parametrize(("raw", "fragment"), BAD_BODIES,
                         ids=["truncated", "deep-array", "deep-field", "messages-string", "messages-empty", "null",
                              "string", "id-10kB", "id-nul", "id-surrogate"])
def test_bad_bodies_get_a_clear_400(fake: tuple[Slotkeeper, FakeUpstream, Path], raw: bytes | str,
                                    fragment: str) -> None:
    keeper, upstream, root = fake
    before, count = _files(root), len(upstream.requests)
    with httpx.Client(base_url=keeper.url, timeout=30) as c:
        response = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    assert fragment in response.json()["error"]["message"]
    assert len(upstream.requests) == count and _files(root) == before


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
    saved = next(r for r in rows if r["session"] == session.strip())
    assert re.fullmatch(r"[0-9a-f]{40}-[0-9a-f]{8}\.bin", saved["file"])
    created = _files(root) - before
    # The only new files: the snapshot, in the slot dir, and the index's own journal files.
    assert all(p == f"slots/{saved['file']}" or p.startswith("cache/index.sqlite3") for p in created), created


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
