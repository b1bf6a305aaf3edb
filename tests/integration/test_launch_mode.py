"""Launch mode against the real llama-server binary: `slotkeeper serve ... -- llama-server ARGS` starts it with the
options slotkeeper needs, restarts it when it is killed, saves the slots and stops it on SIGTERM, and never leaves it
running after slotkeeper is gone, even after a kill -9 or a process-group SIGTERM + SIGKILL as llama-swap sends."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from slotkeeper.config import Settings
from tests.support import (
    ANSWER_SLACK,
    REPO,
    Conversation,
    Slotkeeper,
    free_port,
    llama_server_binary,
    saved_state_bytes,
    timings,
    wait_until,
    words,
)

pytestmark = pytest.mark.backend


# -- helpers -----------------------------------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def servers_for(slot_dir: Path) -> list[int]:
    """Live processes whose command line carries `--slot-save-path slot_dir`: the llama-servers of one test."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--slot-save-path" in argv and str(slot_dir).encode() in argv and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def ram_dir_for(slot_dir: Path) -> Path:
    """The RAM dir slotkeeper gives a launched llama-server as --slot-save-path for snapshots kept in `slot_dir`."""
    ram = Settings(launch_command=("llama-server",), slot_dir=slot_dir).effective_ram_dir()
    assert ram is not None
    return ram


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")


def backend_info(keeper: Slotkeeper) -> dict[str, Any]:
    response = httpx.get(f"{keeper.url}/api/backend", timeout=10)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Slotkeeper]]:
    """Start `slotkeeper serve [options] -- llama-server ARGS`; every slotkeeper is stopped (and checked to leave no
    llama-server behind) when the test ends."""
    keepers: list[Slotkeeper] = []

    def start(*llama_args: str, options: tuple[str, ...] = (), own_group: bool = False) -> Slotkeeper:
        keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log", own_group=own_group,
                            extra_args=(*options, "--", str(llama_server_binary()), *llama_args, "-t", "2"))
        keepers.append(keeper)
        return keeper.start()

    yield start
    for keeper in keepers:
        keeper.stop()
    leftovers = servers_for(ram_dir_for(tmp_path / "cache" / "slots" / "launch"))
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"llama-server outlived slotkeeper: {leftovers}"


# -- (a) it serves, with the options slotkeeper added ------------------------------------------------------------------


def test_launch_serves_the_openai_client_with_the_options_it_added(launch, tiny_model: Path, tmp_path: Path) -> None:
    keeper = launch("-m", str(tiny_model), "-c", "4096", "-np", "2", "--alias", "tiny-launch,other")
    slot_dir = tmp_path / "cache" / "slots" / "launch"
    info = backend_info(keeper)
    assert (info["mode"], info["slots"], info["ctx_per_slot"], info["slot_dir"]) == ("launch", 2, 2048, str(slot_dir))
    assert stat.S_IMODE(slot_dir.stat().st_mode) == 0o700
    server = info["server"]
    pid, port = server["pid"], int(info["url"].rsplit(":", 1)[1])
    assert (server["name"], server["running"], server["restarts"]) == ("llama-server", True, 0)
    # The user's words first, then what slotkeeper adds: loopback, a free port, and, as the directory to save
    # into, the RAM dir in front of the slot dir under its cache dir.
    ram_dir = ram_dir_for(slot_dir)
    assert cmdline(pid)[-6:] == ["--host", "127.0.0.1", "--port", str(port), "--slot-save-path", str(ram_dir)]
    assert info["url"] == f"http://127.0.0.1:{port}"
    # Its own session and process group: a Ctrl-C or a group signal meant for slotkeeper does not reach it.
    assert keeper.process is not None
    assert os.getsid(pid) == pid == os.getpgid(pid)
    assert os.getsid(pid) != os.getsid(keeper.process.pid)

    client = openai.OpenAI(base_url=f"{keeper.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-launch"]  # the first --alias names the model
    for session, seed in (("alice", 1), ("bob", 2), ("alice", 1)):
        answer = client.chat.completions.create(
            model="tiny-launch", messages=[{"role": "user", "content": words(300, seed)}],
            max_tokens=4, temperature=0, extra_headers={"X-Session-Id": session},
        )
        assert answer.usage is not None and answer.usage.completion_tokens >= 1
    log = keeper.log_text()
    assert "prompt cache in RAM (--cache-ram, 8192 MiB by default)" in log  # no --cache-ram 0 in this command
    assert f"added --host 127.0.0.1 --port {port} --slot-save-path {ram_dir}" in log
    assert f"RAM dir {ram_dir}: the backend saves there" in log
    server_log = tmp_path / "cache" / "llama-server.log"
    assert "--- slotkeeper" in server_log.read_text() and server["log"] == str(server_log)

    assert keeper.stop() in (0, -signal.SIGTERM)
    assert not alive(pid)
    rows = {row["session_id"]: row for row in keeper.index_rows()}
    assert set(rows) == {"alice", "bob"}  # saved through the RAM dir into the slot dir
    assert all(len(saved_state_bytes(slot_dir, row)) == row["n_bytes"] for row in rows.values())
    assert not ram_dir.exists()  # a clean exit empties the RAM dir: everything in it is on disk


def test_a_slot_save_path_in_the_command_is_the_slot_dir(launch, tiny_model: Path, tmp_path: Path) -> None:
    own = tmp_path / "own-slots"
    own.mkdir()
    keeper = launch("-m", str(tiny_model), "-c", "2048", "-np", "1", "--cache-ram", "0", f"--slot-save-path={own}")
    info = backend_info(keeper)
    assert info["slot_dir"] == str(own)
    # Given as --slot-save-path=DIR (which llama-server itself refuses): it is where the snapshots are kept, and
    # llama-server gets the RAM dir in front of it instead, once.
    argv = cmdline(info["server"]["pid"])
    assert argv.count("--slot-save-path") == 1 and argv[argv.index("--slot-save-path") + 1] == str(ram_dir_for(own))
    assert "prompt cache in RAM" not in keeper.log_text()
    keeper.stop()


def test_without_a_ram_dir_the_command_s_own_slot_save_path_is_used(launch, tiny_model: Path,
                                                                     tmp_path: Path) -> None:
    own = tmp_path / "own-slots"
    keeper = launch("-m", str(tiny_model), "-c", "2048", "-np", "1", "--cache-ram", "0", "--slot-save-path", str(own),
                    options=("--ram-budget", "0"))
    argv = cmdline(backend_info(keeper)["server"]["pid"])
    assert argv.count("--slot-save-path") == 1 and argv[argv.index("--slot-save-path") + 1] == str(own)
    assert "RAM dir" not in keeper.log_text()
    keeper.stop()


def test_a_server_that_cannot_start_is_explained(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
    base = [sys.executable, "-m", "slotkeeper.cli", "serve", "--port", str(free_port()), "--cache-dir", str(cache),
            "--"]
    bad_model = subprocess.run([*base, str(llama_server_binary()), "-m", str(tmp_path / "missing.gguf")],
                               capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False)
    assert bad_model.returncode != 0  # uvicorn exits with 3 when the app fails to start
    assert f"llama-server exited with code 1 before it was ready; its output is in {cache}/llama-server.log" in (
        bad_model.stderr)
    assert "missing.gguf" in bad_model.stderr.split("before it was ready", 1)[1]  # the log's last lines
    no_binary = subprocess.run([*base, str(tmp_path / "no-such-llama-server"), "-m", "x.gguf"],
                               capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False)
    assert no_binary.returncode != 0
    assert "cannot start llama-server" in no_binary.stderr and "No such file or directory" in no_binary.stderr


# -- (b) slotkeeper killed: llama-server goes too ----------------------------------------------------------------------


def test_kill_9_of_slotkeeper_takes_llama_server_down(launch, tiny_model: Path) -> None:
    keeper = launch("-m", str(tiny_model), "-c", "2048", "-np", "1", "--cache-ram", "0")
    pid = backend_info(keeper)["server"]["pid"]
    started = time.monotonic()
    keeper.stop(signal.SIGKILL)
    assert wait_until(lambda: not alive(pid), timeout=5), "llama-server outlived a kill -9 of slotkeeper"
    print(f"llama-server gone {time.monotonic() - started:.2f} s after kill -9 of slotkeeper")


def test_llama_swap_stop_sequence_saves_then_leaves_nothing(launch, tiny_model: Path) -> None:
    """llama-swap signals the whole process group: SIGTERM, then SIGKILL after its unloadTimeout. llama-server is in
    a group of its own, so it keeps serving while slotkeeper saves; if the SIGKILL comes first, it dies with us."""
    keeper = launch("-m", str(tiny_model), "-c", "4096", "-np", "1", "--cache-ram", "0", own_group=True)
    assert keeper.process is not None
    with httpx.Client(base_url=keeper.url, timeout=120) as client:
        Conversation(client, "swapped", size=400).turn()
    pid = backend_info(keeper)["server"]["pid"]
    os.killpg(keeper.process.pid, signal.SIGTERM)  # generous unloadTimeout: the save finishes
    assert keeper.process.wait(30) in (0, -signal.SIGTERM)
    assert keeper.row("swapped") is not None
    assert not alive(pid)

    keeper = launch("-m", str(tiny_model), "-c", "8192", "-np", "1", "--cache-ram", "0", own_group=True)
    assert keeper.process is not None
    pid = backend_info(keeper)["server"]["pid"]
    streaming = _stream_in_background(keeper, "cut", max_tokens=6000)
    assert wait_until(lambda: streaming.chunks >= 5, timeout=30)
    os.killpg(keeper.process.pid, signal.SIGTERM)
    time.sleep(0.5)  # a short unloadTimeout: slotkeeper is still waiting for the stream
    os.killpg(keeper.process.pid, signal.SIGKILL)
    keeper.process.wait(10)
    assert wait_until(lambda: not alive(pid), timeout=5), "llama-server survived llama-swap's SIGKILL of slotkeeper"


# -- (c) llama-server killed: restarted, requests in flight get a clean error ------------------------------------------


# Greedy decoding: a random model that samples may draw its end-of-text token within a few dozen tokens, and the
# request would end before the kill (the tiny model's greedy answer to "go on" runs the full 3,000 tokens).
def _openai(n: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "go on"}], "max_tokens": n, "temperature": 0}


def _anthropic(n: int) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": n, "messages": [{"role": "user", "content": "go on"}], "temperature": 0,
            "ignore_eos": True}


def _ollama(n: int) -> dict[str, Any]:
    return {"model": "tiny", "stream": False, "messages": [{"role": "user", "content": "go on"}],
            "options": {"num_predict": n, "temperature": 0}}


# dialect, path, body of n tokens, "is this that dialect's error shape?"
IN_FLIGHT: list[tuple[str, str, Callable[[int], dict[str, Any]], Callable[[dict[str, Any]], bool]]] = [
    ("openai", "/v1/chat/completions", _openai,
     lambda body: body["error"]["type"] == "upstream_unavailable" and body["error"]["code"] == 502),
    ("anthropic", "/v1/messages", _anthropic,
     lambda body: body["type"] == "error" and body["error"]["type"] == "api_error" and bool(body["error"]["message"])),
    ("ollama", "/api/chat", _ollama, lambda body: set(body) == {"error"} and isinstance(body["error"], str)),
]


def test_killed_llama_server_is_restarted_and_in_flight_requests_fail_cleanly(launch, tiny_model: Path) -> None:
    keeper = launch("-m", str(tiny_model), "-c", "8192", "-np", "1", "--cache-ram", "0",
                    options=("--save-idle-seconds", "0.2"))
    client = httpx.Client(base_url=keeper.url, timeout=120)
    conv = Conversation(client, "survivor", size=600)
    conv.turn()
    assert wait_until(lambda: keeper.row("survivor") is not None)
    saved = keeper.row("survivor")
    restart_seconds, reach_seconds = [], []
    for n, (dialect, path, body_of, is_error_shape) in enumerate(IN_FLIGHT, start=1):
        info = backend_info(keeper)
        old_pid, backend_url = info["server"]["pid"], info["url"]
        result: dict[str, Any] = {}
        long_body = body_of(3000)

        def call(path: str = path, body: dict[str, Any] = long_body, result: dict[str, Any] = result) -> None:
            response = httpx.post(f"{keeper.url}{path}", json=body, headers={"X-Session-Id": "doomed"}, timeout=60)
            result.update(status=response.status_code, body=response.json())

        thread = threading.Thread(target=call)
        thread.start()
        t_start = time.monotonic()
        reached = wait_until(lambda url=backend_url, t=thread: _processing(url) or not t.is_alive(), timeout=30)
        assert reached and thread.is_alive(), (f"{dialect}: the request never reached llama-server, or ended first: "
                                               f"{result}\n{keeper.log_text()[-3000:]}")
        killed = time.monotonic()
        reach_seconds.append(killed - t_start)
        os.kill(old_pid, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), f"{dialect}: the request in flight hung"
        assert result["status"] == 502, (dialect, result)
        assert is_error_shape(result["body"]), (dialect, result)

        def restarted(old: int = old_pid, n: int = n) -> bool:
            server = backend_info(keeper)["server"]
            return server["pid"] != old and server["restarts"] == n and client.get("/health").status_code == 200

        assert wait_until(restarted, timeout=60, interval=0.1), f"{dialect}: llama-server was not restarted"
        restart_seconds.append(time.monotonic() - killed)
        assert backend_info(keeper)["server"]["last_exit"] == "signal SIGKILL"
        after = client.post(path, json=body_of(4), headers={"X-Session-Id": f"after-{dialect}"})
        assert after.status_code == 200, (dialect, after.text)
    print("seconds from kill -9 to a healthy llama-server:", [round(s, 2) for s in restart_seconds],
          "; from sending to llama-server working on it:", [round(s, 2) for s in reach_seconds])
    log = keeper.log_text()
    assert log.count("exited with signal SIGKILL") == 3
    assert log.count("llama-server is back") == 3
    metrics = client.get("/metrics").text
    assert "slotkeeper_backend_restarts_total 3.0" in metrics
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
    doctor = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "doctor", "--url", keeper.url], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    server_line = next(line for line in doctor.stdout.splitlines() if line[6:].startswith("server"))
    assert server_line.startswith("warn") and "restarted 3 time(s)" in server_line, doctor.stdout
    # Nothing the dead server held is trusted: the conversation comes back from disk, with its whole prefix.
    resumed = conv.turn()
    assert resumed.headers["x-slotkeeper-cache"] == "restored"
    assert saved is not None and timings(resumed)["cache_n"] >= saved["n_tokens"] - ANSWER_SLACK
    client.close()


def _processing(backend_url: str) -> bool:
    try:
        slots = httpx.get(f"{backend_url}/slots", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    return any(slot.get("is_processing") for slot in slots)


# -- (d) SIGTERM while a stream runs: bounded exit, the session saved, nothing left ------------------------------------


class _Stream:
    def __init__(self) -> None:
        self.chunks = 0
        self.thread: threading.Thread | None = None


def _stream_in_background(keeper: Slotkeeper, session: str, max_tokens: int) -> _Stream:
    """A slow reader of a long streamed answer, so the stream is still running when slotkeeper is told to stop."""
    stream = _Stream()

    def read() -> None:
        body = {"messages": [{"role": "user", "content": words(300, 3)}], "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}  # a random model may draw its end-of-text token at any moment
        try:
            with httpx.stream("POST", f"{keeper.url}/v1/chat/completions", json=body, timeout=60,
                              headers={"X-Session-Id": session}) as response:
                for _ in response.iter_raw():
                    stream.chunks += 1
                    time.sleep(0.02)
        except httpx.HTTPError:
            pass  # cut at shutdown

    stream.thread = threading.Thread(target=read, daemon=True)
    stream.thread.start()
    return stream


def test_sigterm_during_a_stream_exits_in_bounded_time_and_saves_it(launch, tiny_model: Path, tmp_path: Path) -> None:
    bound = 6.0
    keeper = launch("-m", str(tiny_model), "-c", "8192", "-np", "1", "--cache-ram", "0",
                    options=("--shutdown-timeout", str(bound)))
    assert keeper.process is not None
    pid = backend_info(keeper)["server"]["pid"]
    streaming = _stream_in_background(keeper, "streamer", max_tokens=6000)  # about 20 s of generation here
    assert wait_until(lambda: streaming.chunks >= 5, timeout=30)
    started = time.monotonic()
    keeper.process.send_signal(signal.SIGTERM)
    code = keeper.process.wait(60)
    elapsed = time.monotonic() - started
    print(f"slotkeeper exited {elapsed:.2f} s after SIGTERM (shutdown_timeout {bound:.0f} s), code {code}")
    assert code in (0, -signal.SIGTERM)
    assert elapsed < bound + 4, elapsed  # the bound, plus interpreter exit
    assert elapsed >= 1.0, elapsed  # the stream did get its third of the bound (2 s) to finish
    row = keeper.row("streamer")
    assert row is not None and row["n_tokens"] > 0  # the prompt, plus what was generated before the cut
    assert not alive(pid)
    assert not servers_for(ram_dir_for(tmp_path / "cache" / "slots" / "launch"))
    log = keeper.log_text()
    assert "shutdown: saved 1 changed slot(s)" in log
    assert "llama-server (pid" in log and "stopped (code 0)" in log
