"""One llama.cpp server process started by slotkeeper (a llama-server command, or the embedded xllamacpp server).

It dies with slotkeeper (PR_SET_PDEATHSIG, so even a kill -9 of slotkeeper leaves no server behind), runs in its own
session (a Ctrl-C in the terminal or a process-group SIGTERM from llama-swap reaches slotkeeper only, which saves the
slots and then stops the server itself), and appends its output to a log file whose last lines explain a failed start.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import httpx

log = logging.getLogger("slotkeeper.process")

_PR_SET_PDEATHSIG = 1
LOG_TAIL_LINES = 15


class ServerStartError(Exception):
    """The server process could not be started or did not become ready; the message says why and where its log is."""


def _die_with_us_hook() -> Callable[[], None] | None:
    """A function for the child to run between fork and exec: ask the kernel to SIGKILL it when we die (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # we died before the line above took effect
            os._exit(1)

    return hook


class ServerProcess:
    """A server command run as a child of slotkeeper, serving HTTP at `url` once /health answers 200."""

    def __init__(self, name: str, argv: Sequence[str], url: str, log_path: Path) -> None:
        self.name = name
        self.argv = tuple(argv)
        self.url = url
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # time.monotonic() of the last spawn

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self) -> None:
        """Start the process. Call it from the event loop's thread (or another thread that lives as long as
        slotkeeper), never from a worker thread: the kernel's parent-death signal fires when the *thread* that
        forked the child ends, so a short-lived thread would take the server down with it."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self.log_path.open("ab") as output:
            stamp = datetime.now(UTC).isoformat(timespec="seconds")
            output.write(f"\n--- slotkeeper {stamp}: starting {' '.join(self.argv)}\n".encode())
            output.flush()
            try:
                self.process = subprocess.Popen(
                    self.argv, stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_die_with_us_hook(),
                )
            except OSError as exc:
                raise ServerStartError(f"cannot start {self.name} ({self.argv[0]}): {exc.strerror or exc}") from exc
        self.started_at = time.monotonic()
        log.info("started %s (pid %d), output in %s", self.name, self.process.pid, self.log_path)

    async def wait_ready(self, timeout: float) -> None:
        """Poll /health until it answers 200. Raises ServerStartError, with the log's last lines, if the process
        exits first or is not ready within `timeout` seconds."""
        process = self.process
        assert process is not None
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                code = process.poll()
                if code is not None:
                    raise ServerStartError(
                        f"{self.name} exited with {describe_exit(code)} before it was ready; its output is in "
                        f"{self.log_path}, ending with:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{self.name} did not answer {self.url}/health within {timeout:.0f} s (start_timeout); its "
                        f"output is in {self.log_path}, ending with:\n{self.log_tail()}"
                    )
                await asyncio.sleep(0.1)

    async def wait_exit(self) -> int:
        """Wait until the process has exited and return its exit code (negative: killed by that signal)."""
        process = self.process
        assert process is not None
        woken = False
        while True:
            code = process.poll()
            if code is not None:
                return code
            # The kernel wakes us through a pidfd; without one (an old kernel), or if the child is not reaped yet
            # after the wake-up, poll.
            if woken or not await _wait_pidfd(process.pid):
                await asyncio.sleep(0.1)
            woken = True

    async def stop(self, timeout: float) -> None:
        """SIGTERM, up to `timeout` seconds for it to exit, then SIGKILL. Idempotent."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        self._signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.wait_exit(), max(timeout, 0.1))
        except TimeoutError:
            log.warning("%s (pid %d) did not exit within %.0f s of SIGTERM; killing it", self.name, process.pid,
                        timeout)
            self._signal(signal.SIGKILL)
            await self.wait_exit()
        log.info("%s (pid %d) stopped (%s)", self.name, process.pid, describe_exit(process.returncode))

    def kill(self) -> None:
        """SIGKILL at once, without waiting (for paths that cannot await)."""
        if self.running:
            self._signal(signal.SIGKILL)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 64 * 1024))
                text = fh.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(cannot read the log: {exc.strerror})"
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def _signal(self, sig: signal.Signals) -> None:
        """Signal the server's own process group (it leads one), so helpers it started go too."""
        assert self.process is not None
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code yet"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


async def _wait_pidfd(pid: int) -> bool:
    """Return True when the process has exited, woken by the kernel through a pidfd (Linux 5.3+); False at once when
    there is no pidfd to wait on."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return False
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    try:
        loop.add_reader(fd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)
    return True
