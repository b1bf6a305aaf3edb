"""A session that moves between two backends of one model (its owner drained), on the dense, recurrent, hybrid and
sliding-window models and both kinds of server: its snapshot is copied to the new backend and restored there, and
the next-token probabilities match a fresh prefill of the same prompt. The client sends back answers that differ
from what was generated."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.test_model_restores import (  # noqa: F401 (the models fixture)
    Session,
    assert_same_distribution,
    models,
    top_logprobs,
)
from tests.support import Backend, Slotkeeper, backends_config, chat, timings, words

pytestmark = pytest.mark.backend


@dataclass
class Pair:
    keeper: Slotkeeper
    backends: list[Backend]

    def by_url(self, url: str) -> Backend:
        return next(b for b in self.backends if b.url == url)


@pytest.fixture
def pair(tmp_path: Path, backend_kind: str, arch: str, models: dict[str, Path]) -> Iterator[Pair]:  # noqa: F811
    backends = [Backend(backend_kind, models[arch], tmp_path / f"slots-{i}", tmp_path / f"backend-{i}.log")
                for i in range(2)]
    config = backends_config(tmp_path / "slotkeeper.toml", arch, backends)
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log",
                        extra_args=("--config", str(config), "--save-idle-seconds", "0.3"))
    try:
        for backend in backends:
            backend.start()
        yield Pair(keeper.start(timeout=120), backends)
    finally:
        keeper.stop()
        for backend in backends:
            backend.stop()


@pytest.mark.parametrize("arch", ["llama", "mamba", "jamba", "lfm2", "gemma3"])
def test_a_moved_session_is_restored_on_its_new_backend_without_changing_the_answer(arch: str, pair: Pair) -> None:
    with httpx.Client(base_url=pair.keeper.url, timeout=120) as client:
        session = Session(client, "moving", "You are a moving assistant. " + words(300, 7), 23)
        session.turn()
        session.answer()
        response = chat(client, session.messages, "moving", max_tokens=2)
        assert response.status_code == 200
        owner = response.headers["x-slotkeeper-backend"]
        session.last_prompt = timings(response)["cache_n"] + timings(response)["prompt_n"]
        session.answer()
        drained = client.post("/api/backend/drain", json={"backend": owner, "draining": True})
        assert drained.status_code == 200, drained.text

        body = {"logprobs": True, "top_logprobs": 5, "grammar": "root ::= [a-z]+"}
        moved = chat(client, session.messages, "moving", max_tokens=1, **body)
        assert moved.status_code == 200, moved.text
        other = moved.headers["x-slotkeeper-backend"]
        assert other != owner
        fresh = httpx.post(other + "/v1/chat/completions", timeout=120, json={
            "messages": session.messages, "max_tokens": 1, "temperature": 0, "cache_prompt": False, **body})
        assert_same_distribution(top_logprobs(moved), top_logprobs(fresh), f"{arch} moved between backends")
        log = pair.keeper.log_text()
        assert "moves to" in log and "owner draining" in log
        assert f"came from {owner} to {other}" in log  # its snapshot was copied over
        if arch == "llama" or pair.backends[0].kind == "embedded":  # where the build and architecture allow it
            assert moved.headers["x-slotkeeper-cache"] == "restored"
            assert timings(moved)["cache_n"] >= session.last_prompt - 8, (timings(moved), session.last_prompt)
