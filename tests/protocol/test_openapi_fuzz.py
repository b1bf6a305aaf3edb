"""Schemathesis over slotkeeper's own OpenAPI document, in process, with the recording fake standing in for
llama-server: for every operation, requests generated from the schema (valid ones, and ones that break it on purpose)
never get a 5xx, and every answer has a declared status, content type and, for errors, the dialect's error shape.

The served model's name replaces generated ones, so valid Ollama requests get past the model check and reach the
backend instead of all stopping at "model not found".
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.python import asgi

from slotkeeper.config import Settings
from slotkeeper.web.app import create_app
from tests.protocol.fake_upstream import FakeUpstream
from tests.strategies import examples

SERVED_MODEL = "fake"

# Built at import, because schemathesis makes one test per operation while collecting; nothing runs or is written
# until the fixture below starts the backend (the app's lifespan starts with its first request).
_ROOT = Path(tempfile.gettempdir()) / f"slotkeeper-openapi-fuzz-{os.getpid()}"
_UPSTREAM = FakeUpstream(_ROOT / "slots")
# schemathesis's ASGI client sends `Host: testserver`; the guard lets only named hosts through.
_APP = create_app(Settings(upstream=_UPSTREAM.url, slot_dir=_UPSTREAM.slot_dir, cache_dir=_ROOT / "cache",
                           allowed_hosts=(asgi.HOST,), save_idle_seconds=0.05))
# Not schemathesis.pytest.from_fixture: its lazy loader does not run under pytest 9 (it sets Node._nodeid).
schema = schemathesis.openapi.from_dict(_APP.openapi(), config=schemathesis.Config.from_dict({"checks": {
    # 501 is the deliberate answer of the model-store routes slotkeeper does not serve (/api/push, /api/delete...);
    # any other 5xx fails.
    "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "501"]},
    # Routes check more than a schema says (a keep_alive that is no duration, /api/show without a model name...).
    "positive_data_acceptance": {"enabled": False},
    # The request models parse leniently, as pydantic does by default: `false` is taken as 0, `0` as false and
    # "5" as 5, so a schema-violating type is not always refused. Everything else still runs on those requests.
    "negative_data_rejection": {"enabled": False},
    # A 405's Allow header names every method some route takes at the path, and path templates overlap
    # (/api/sessions/{session_id} also matches /api/sessions/current), which this check reads as undocumented.
    "allow_header_conformance": {"enabled": False},
}}))
schema.app = _APP


@pytest.fixture(scope="module", autouse=True)
def _backend() -> Iterator[None]:
    shutil.rmtree(_ROOT, ignore_errors=True)
    _UPSTREAM.start()
    try:
        yield
    finally:
        # schemathesis started the app's lifespan on its own event loop; end it while the backend still answers.
        asgi.shutdown_lifespans()
        _UPSTREAM.stop()
        shutil.rmtree(_ROOT, ignore_errors=True)


def _with_served_model(body: Any) -> None:
    if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"]:
        body["model"] = SERVED_MODEL


# (method, path, status) of every answer, for the test after the fuzzing.
_ANSWERS: Counter[tuple[str, str, int]] = Counter()


@schema.parametrize()
@settings(max_examples=examples(40), deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_breaks_a_promise(case: schemathesis.Case) -> None:
    _with_served_model(case.body)
    response = case.call_and_validate()
    _ANSWERS[case.method.upper(), case.path, response.status_code] += 1


MODEL_ROUTES = [("POST", "/api/chat"), ("POST", "/api/generate"), ("POST", "/v1/chat/completions"),
                ("POST", "/v1/messages")]


def test_the_fuzzing_reached_the_backend() -> None:
    """Runs after the fuzzing (pytest keeps a module's order): generated requests were not all refused at the door."""
    if not _ANSWERS:
        pytest.skip("run together with test_no_request_breaks_a_promise")
    for method, path in MODEL_ROUTES:
        statuses = {status: n for (m, p, status), n in _ANSWERS.items() if (m, p) == (method, path)}
        assert statuses.get(200), (method, path, statuses)
        assert any(400 <= status < 500 for status in statuses), (method, path, statuses)
    assert _UPSTREAM.requests
