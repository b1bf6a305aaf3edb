"""ServerProcess with small Python children standing in for a server: its own session, the log file, a failed start
explained with the log's last lines, exit codes through the pidfd wait, TERM then KILL, and dying with its parent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slotkeeper.upstream.process import ServerProcess, ServerStartError, describe_exit

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
# Ignores SIGTERM, so only SIGKILL ends it.
STUBBORN = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)"]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(("code", "text"), [(0, "code 0"), (1, "code 1"), (-9, "signal SIGKILL"),
                                            (-15, "signal SIGTERM"), (None, "no exit code yet")])
def test_describe_exit(code: int | None, text: str) -> None:
    assert describe_exit(code) == text


async def test_spawn_in_its_own_session_with_a_log(tmp_path: Path) -> None:
    server = ServerProcess("sleeper", SLEEPER, "http://127.0.0.1:9", tmp_path / "logs" / "server.log")
    server.spawn()
    try:
        assert server.pid is not None and server.running
        assert os.getsid(server.pid) == server.pid != os.getsid(0)
        assert os.getpgid(server.pid) == server.pid
        assert "--- slotkeeper" in (tmp_path / "logs" / "server.log").read_text()
    finally:
        await server.stop(5)
    assert not server.running
    assert server.process is not None and server.process.returncode == -signal.SIGTERM


async def test_stop_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    server = ServerProcess("stubborn", STUBBORN, "http://127.0.0.1:9", tmp_path / "server.log")
    server.spawn()
    deadline = time.monotonic() + 10
    while "ready" not in (tmp_path / "server.log").read_text().splitlines():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    started = time.monotonic()
    await server.stop(0.3)
    assert server.process is not None and server.process.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5


async def test_wait_exit_reports_a_kill(tmp_path: Path) -> None:
    server = ServerProcess("sleeper", SLEEPER, "http://127.0.0.1:9", tmp_path / "server.log")
    server.spawn()
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    assert await server.wait_exit() == -signal.SIGKILL


async def test_a_failed_start_names_the_log_and_shows_its_end(tmp_path: Path) -> None:
    script = ("import sys; print('loading model'); print('error: unable to open model file', file=sys.stderr); "
              "sys.exit(1)")
    server = ServerProcess("llama-server", [sys.executable, "-c", script], "http://127.0.0.1:9",
                           tmp_path / "server.log")
    server.spawn()
    with pytest.raises(ServerStartError) as info:
        await server.wait_ready(30)
    message = str(info.value)
    assert f"llama-server exited with code 1 before it was ready; its output is in {tmp_path}/server.log" in message
    assert "error: unable to open model file" in message


async def test_a_start_that_takes_too_long(tmp_path: Path) -> None:
    server = ServerProcess("llama-server", SLEEPER, "http://127.0.0.1:9", tmp_path / "server.log")
    server.spawn()
    try:
        with pytest.raises(ServerStartError, match=r"did not answer http://127.0.0.1:9/health within 0 s"):
            await server.wait_ready(0.3)
    finally:
        await server.stop(5)


def test_a_missing_program(tmp_path: Path) -> None:
    server = ServerProcess("llama-server", [str(tmp_path / "nope")], "http://127.0.0.1:9", tmp_path / "server.log")
    with pytest.raises(ServerStartError, match=r"cannot start llama-server .*nope.*No such file"):
        server.spawn()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_the_child_dies_with_its_parent(tmp_path: Path) -> None:
    """A parent process spawns a ServerProcess, prints the child's pid, and is killed with SIGKILL."""
    parent_code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from slotkeeper.upstream.process import ServerProcess
        server = ServerProcess("sleeper", {SLEEPER!r}, "http://127.0.0.1:9", Path({str(tmp_path / "s.log")!r}))
        server.spawn()
        print(server.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5
        while alive(child):
            assert time.monotonic() < deadline, "the child outlived its parent's kill -9"
            time.sleep(0.02)
    finally:
        parent.kill()
