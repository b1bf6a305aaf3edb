"""Damaged or foreign snapshot files never reach the backend: the turn runs cold, succeeds, and the file is moved aside.

A truncated file would abort llama-server (GGML_ASSERT) and a same-shape foreign model's file would restore silently
wrong, so each case checks the backend is still up and nothing was restored.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from slotkeeper.upstream.launcher import free_port
from tests.conftest import Stack
from tests.support import (
    REPO,
    Backend,
    Conversation,
    Slotkeeper,
    llama_server_binary,
    saved_state_bytes,
    timings,
    wait_healthy,
)

pytestmark = pytest.mark.backend


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated-half":
        path.write_bytes(data[: len(data) // 2])
    elif how == "truncated-1-byte":
        path.write_bytes(data[:-1])
    elif how == "zero-length":
        path.write_bytes(b"")
    elif how == "random-same-size":
        path.write_bytes(os.urandom(len(data)))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated-half", "truncated-1-byte", "zero-length", "random-same-size",
                                 "foreign-model"])
def test_bad_snapshot_is_quarantined_and_the_turn_runs_cold(stack: Stack, client_for, foreign_model: Path,
                                                            how: str) -> None:
    backend = stack.backend(cache_ram=0)
    # Saved as one whole file, as every snapshot was before the block store (and still is with --block-tokens 0):
    # a file damaged in these ways is checked and refused by the slotkeeper that keeps states as blocks. Damaged
    # blocks and tails have their own tests (tests/unit/test_blockstore.py, test_background_commits.py).
    keeper = stack.slotkeeper(backend, "--block-tokens", "0")
    conv = Conversation(client_for(keeper), "victim", size=600)
    conv.turn()
    keeper.stop()
    row = keeper.row("victim")
    assert row is not None
    path = stack.slot_dir / row["filename"]
    backend.stop()  # a fresh backend has an empty slot, so any reuse could only come from a restore
    if how == "foreign-model":
        backend = stack.backend(model=foreign_model, cache_ram=0)  # same file name and shapes, other weights
    else:
        _damage(path, how)
        backend = stack.backend(cache_ram=0)

    keeper = stack.slotkeeper(backend)
    conv.client = client_for(keeper)
    response = conv.turn()
    assert response.status_code == 200
    assert response.headers["x-slotkeeper-cache"] == "cold"
    assert timings(response)["cache_n"] == 0
    assert backend.alive()
    if how == "foreign-model":
        # Not bad, only made for another backend: kept (until this session's next save replaces it), never restored.
        assert "was made by another model or slot layout" in keeper.log_text()
        assert path.exists() and not (stack.slot_dir / "quarantine").exists()
        return
    assert keeper.row("victim") is None
    assert not path.exists()
    assert [p.name.split(".")[0] for p in (stack.slot_dir / "quarantine").iterdir()] == [path.name.split(".")[0]]
    log = keeper.log_text()
    assert "quarantined" in log
    expected = "size" if "trunc" in how or "zero" in how else "checksum mismatch"
    assert expected in log


def test_session_endpoints(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(cache_ram=0))
    client = client_for(keeper)
    Conversation(client, "first", size=400).turn()
    Conversation(client, "second", size=400, seed=3).turn()  # saves "first"

    listing = client.get("/api/sessions").json()
    assert [s["session"] for s in listing["sessions"]] == ["first"]
    entry = listing["sessions"][0]
    row = keeper.row("first")
    assert row is not None and entry["stored_as"] == "blocks" and entry["tail_bytes"] == row["tail_bytes"] > 0
    assert entry["bytes"] == len(saved_state_bytes(stack.slot_dir, row)) and entry["tokens"] > 0

    current = client.get("/api/sessions/current").json()
    assert current["session"] == "second"
    assert current["slots"][0] == {"id": 0, "session": "second", "model": "tiny", "dirty": True, "busy": False,
                                   "n_tokens": current["slots"][0]["n_tokens"]}
    assert client.get("/api/sessions/second").json()["hot_in_slot"] == 0
    assert client.get("/api/sessions/first").json()["hot_in_slot"] is None

    cleared = client.post("/api/sessions/clear").json()
    assert cleared == {"erased_slots": [0], "session": "default"}
    assert client.get("/api/sessions/current").json()["session"] is None
    assert {s["session"] for s in client.get("/api/sessions").json()["sessions"]} == {"first", "second"}
    with httpx.Client(base_url=stack_backend_url(keeper)) as direct:
        assert direct.get("/slots").json()[0].get("n_prompt_tokens", 0) == 0

    before = _tree(stack.tmp)
    for bad in ["nope", "..%2Fx", "..%2F..%2Fcache%2Findex.sqlite3", "%2Fetc%2Fpasswd"]:
        response = client.delete(f"/api/sessions/{bad}")
        assert response.status_code == 404, (bad, response.text)
        assert "not found" in response.json()["error"]["message"]
    assert _tree(stack.tmp) == before

    deleted = client.delete("/api/sessions/first")
    assert deleted.status_code == 200 and deleted.json()["deleted"] == "first"
    assert not (stack.slot_dir / entry["file"]).exists()
    assert client.get("/api/sessions/first").status_code == 404
    assert client.delete("/api/sessions/first").status_code == 404


def stack_backend_url(keeper: Slotkeeper) -> str:
    assert keeper.upstream is not None
    return keeper.upstream.url


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file() and
            not p.name.endswith((".log", "-wal", "-shm"))}


def test_backend_without_slot_save_path_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    port = free_port()
    server = subprocess.Popen([str(llama_server_binary()), "-m", str(tiny_model), "--host", "127.0.0.1", "--port",
                               str(port), "-c", "2048", "--parallel", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, 60)
        result = subprocess.run(
            [sys.executable, "-m", "slotkeeper.cli", "serve", "--port", str(free_port()), "--cache-dir",
             str(tmp_path / "cache"), "--upstream", f"http://127.0.0.1:{port}", "--slot-dir", str(tmp_path / "s")],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    assert result.returncode != 0
    assert "--slot-save-path" in result.stderr


def test_wrong_slot_dir_is_refused(stack: Stack, tmp_path: Path) -> None:
    backend = stack.backend()
    elsewhere = tmp_path / "not-the-slot-dir"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "slotkeeper.cli", "serve", "--port", str(free_port()), "--cache-dir",
         str(tmp_path / "cache2"), "--upstream", backend.url, "--slot-dir", str(elsewhere)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert result.returncode != 0
    assert "did not appear in" in result.stderr


def test_backend_killed_mid_stream_gives_an_error_event(stack: Stack, client_for) -> None:
    backend: Backend = stack.backend()
    keeper = stack.slotkeeper(backend)
    body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=keeper.url, timeout=60) as client, client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "doomed"}
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        backend.stop(signal.SIGKILL)
        rest = list(lines)
    errors = [line for line in rest if line.startswith("data: {\"error\"")]
    assert len(errors) == 1 and "data: [DONE]" not in rest
    # Nothing is saved from a slot whose state is unknown, and slotkeeper itself stays up.
    assert keeper.row("doomed") is None
    assert keeper.process is not None and keeper.process.poll() is None
    health = client_for(keeper).get("/health")
    assert health.status_code == 503
