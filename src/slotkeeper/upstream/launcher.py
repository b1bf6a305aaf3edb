"""Starting and stopping a backend process: the embedded xllamacpp server, supervised as a child of slotkeeper.

The child gets a free loopback port, must answer /health before we go on, and is stopped (TERM, then KILL) with us.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

log = logging.getLogger("slotkeeper.launcher")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """Poll GET /health until it answers 200; fail early if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the backend exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the backend at {url} was not ready after {timeout:.0f} s")


class EmbeddedBackend:
    """llama.cpp's server from the xllamacpp package, in a child process on a free loopback port."""

    def __init__(self, model: Path, slot_dir: Path, *, ctx_size: int, parallel: int, cache_ram_mib: int | None,
                 alias: str | None = None, log_path: Path | None = None) -> None:
        self.model = model
        self.slot_dir = slot_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._argv = [
            sys.executable, "-m", "slotkeeper.upstream.embedded", "--model", str(model), "--port", str(self.port),
            "--slot-dir", str(slot_dir), "--ctx-size", str(ctx_size), "--parallel", str(parallel),
        ]
        if cache_ram_mib is not None:
            self._argv += ["--cache-ram", str(cache_ram_mib)]
        if alias:
            self._argv += ["--alias", alias]
        self._log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        log.info("starting the embedded llama.cpp server (xllamacpp) for %s on %s", self.model, self.url)
        output = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=output,
                                            stderr=subprocess.STDOUT)
        finally:
            if output is not subprocess.DEVNULL:
                output.close()  # type: ignore[union-attr]
        wait_healthy(self.url, self.process, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
