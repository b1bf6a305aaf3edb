"""`slotkeeper serve` with no backend given: it generates the tiny model, runs llama.cpp's embedded server as a
child, keeps sessions across a restart, and never leaves the child running after it stops or is killed."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from slotkeeper.config import Settings
from tests.support import ANSWER_SLACK, Conversation, Slotkeeper, timings, wait_until

pytestmark = pytest.mark.backend


def _embedded_children(cache_dir: Path) -> list[str]:
    """The embedded servers of the slotkeeper using `cache_dir`: they save into its RAM dir."""
    ram_dir = Settings(cache_dir=cache_dir).effective_ram_dir()
    out = subprocess.run(["pgrep", "-f", f"slotkeeper.upstream.embedded .*--slot-dir {ram_dir} "],
                         capture_output=True, text=True)
    return out.stdout.split()


def test_embedded_default_model_sessions_survive_restart(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    keeper = Slotkeeper(cache, tmp_path / "slotkeeper.log", extra_args=("--cache-ram", "0")).start()
    try:
        assert "no model given: using the generated tiny random-weight test model" in keeper.log_text()
        assert (cache / "models").is_dir() and len(_embedded_children(cache)) == 1
        with httpx.Client(base_url=keeper.url, timeout=120) as client:
            assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-random-llama-1234"
            a = Conversation(client, "a", size=500)
            b = Conversation(client, "b", size=500, seed=7)
            a.turn()
            b.turn()
            restored = a.turn()
            assert restored.headers["x-slotkeeper-cache"] == "restored"
        assert keeper.stop() in (0, -signal.SIGTERM)
        assert wait_until(lambda: not _embedded_children(cache), timeout=10)

        keeper = Slotkeeper(cache, tmp_path / "slotkeeper.log", extra_args=("--cache-ram", "0")).start()
        row = keeper.row("a")
        assert row is not None
        with httpx.Client(base_url=keeper.url, timeout=120) as client:
            a.client = client
            resumed = a.turn()
        assert resumed.headers["x-slotkeeper-cache"] == "restored"
        assert timings(resumed)["cache_n"] >= row["n_tokens"] - ANSWER_SLACK
    finally:
        keeper.stop()


def test_kill_9_of_slotkeeper_takes_the_embedded_server_down(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    keeper = Slotkeeper(cache, tmp_path / "slotkeeper.log").start()
    try:
        assert len(_embedded_children(cache)) == 1
        keeper.stop(signal.SIGKILL)
        assert wait_until(lambda: not _embedded_children(cache), timeout=10), "the embedded server outlived us"
    finally:
        keeper.stop()


def test_a_killed_embedded_server_is_restarted(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    keeper = Slotkeeper(cache, tmp_path / "slotkeeper.log", extra_args=("--cache-ram", "0")).start()
    try:
        with httpx.Client(base_url=keeper.url, timeout=120) as client:
            first = client.get("/api/backend").json()["server"]
            assert (first["name"], first["restarts"]) == ("the embedded server", 0)
            assert _embedded_children(cache) == [str(first["pid"])]
            subprocess.run(["kill", "-9", str(first["pid"])], check=True)

            def restarted() -> bool:
                server = client.get("/api/backend").json()["server"]
                return server["restarts"] == 1 and server["pid"] != first["pid"] and server["running"]

            assert wait_until(restarted, timeout=60, interval=0.2)
            assert client.get("/health").status_code == 200
            answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 2})
            assert answer.status_code == 200
        assert "the embedded server is back" in keeper.log_text()
    finally:
        keeper.stop()
    assert wait_until(lambda: not _embedded_children(cache), timeout=10)
