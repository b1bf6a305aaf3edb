"""The HTTP client of the management commands: the few calls they make to a running slotkeeper's API.

slotkeeper's error answers, a refused admin key and an unreachable server all become CommandError.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import httpx

DEFAULT_URL = "http://127.0.0.1:11434"


class CommandError(Exception):
    """A problem the command reports on stderr as `slotkeeper: MESSAGE` before exiting with status 1."""


@dataclass
class AdminClient:
    """The few HTTP calls the commands make, with slotkeeper's errors turned into CommandError."""

    url: str
    admin_key: str | None = None
    timeout: float = 30.0

    def call(self, method: str, path: str, params: dict[str, str] | None = None,
             body: dict[str, Any] | None = None) -> Any:
        try:
            response = httpx.request(method, self.url + path, params=params, json=body, headers=self._headers(),
                                     timeout=self.timeout)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        return self._checked(method, path, response)

    def stream_lines(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST `body` and yield the NDJSON answer's objects as they arrive (no read timeout: prefills are long)."""
        timeout = httpx.Timeout(self.timeout, read=None)
        try:
            with httpx.stream("POST", self.url + path, json=body, headers=self._headers(), timeout=timeout) as response:
                if response.status_code >= 400:
                    response.read()
                    self._checked("POST", path, response)
                for line in response.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc

    def download(self, path: str, params: dict[str, str], out: BinaryIO) -> int:
        """GET `path` into `out`; returns the bytes written."""
        written = 0
        try:
            with httpx.stream("GET", self.url + path, params=params, headers=self._headers(),
                              timeout=httpx.Timeout(self.timeout, read=None)) as response:
                if response.status_code >= 400:
                    response.read()
                    self._checked("GET", path, response)
                for chunk in response.iter_bytes():
                    out.write(chunk)
                    written += len(chunk)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        return written

    def upload(self, path: str, params: dict[str, str], source: BinaryIO) -> Any:
        """POST the contents of `source` in chunks (a bundle can be gigabytes)."""
        def chunks() -> Iterator[bytes]:
            while chunk := source.read(1024 * 1024):
                yield chunk

        try:
            response = httpx.post(self.url + path, params=params, content=chunks(), headers=self._headers(),
                                  timeout=httpx.Timeout(self.timeout, read=None, write=None))
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        return self._checked("POST", path, response)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def _unreachable(self, exc: httpx.TransportError) -> CommandError:
        return CommandError(
            f"cannot reach slotkeeper at {self.url} ({exc or type(exc).__name__}): is `slotkeeper serve` "
            "running there? Give its address with --url or SLOTKEEPER_URL"
        )

    def _checked(self, method: str, path: str, response: httpx.Response) -> Any:
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code == 401:
            raise CommandError(f"{self.url} refused the admin key: give it with --admin-key or SLOTKEEPER_ADMIN_KEY")
        if response.status_code >= 400:
            raise CommandError(_error_message(body) or f"{method} {path} answered HTTP {response.status_code}")
        return body


def _error_message(body: Any) -> str | None:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return None
