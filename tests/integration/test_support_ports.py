"""The test harness against a port taken between choosing and binding it (a test run or benchmark beside this one
on the machine): a server that cannot bind is started again on another port, and a /health answered by whoever
holds the port is never taken for the new server's."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import httpx
import pytest

from tests.support import Backend

pytestmark = pytest.mark.backend


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_backend_whose_port_is_taken_starts_on_another(tmp_path: Path, tiny_model: Path) -> None:
    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=squatter.serve_forever, daemon=True)
    thread.start()
    taken = squatter.server_address[1]
    backend = Backend("binary", tiny_model, tmp_path / "slots", tmp_path / "backend.log", port=taken)
    try:
        backend.start()
        assert backend.port != taken and backend.alive()
        props = httpx.get(f"{backend.url}/props", timeout=10).json()
        assert props["default_generation_settings"]["n_ctx"] > 0  # llama-server itself, not the squatter
    finally:
        backend.stop()
        squatter.shutdown()
