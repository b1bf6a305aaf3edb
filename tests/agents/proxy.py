"""The recording proxy the agents talk to, and the refusing forward proxy their other traffic is pointed at.

`RecordingProxy` listens on a loopback port and forwards every request to a target (slotkeeper or llama-server),
streaming the answer back as it comes. It changes one thing: the output length. Generation routes get their limit
(`max_tokens`, `max_output_tokens`, `max_completion_tokens`, Ollama's `options.num_predict`, llama-server's
`n_predict`) capped at `cap`, and one added where the client set none, because llama-server's own `-n` does not bound
a request that asks for more, and a random-weight model rarely stops by itself. Every request is recorded: its path,
headers and JSON body as the client sent it, which limits were capped, and from the answer (one JSON document or a
stream of server-sent events) the status, llama-server's `timings`, the API's `usage` and any error.

`RefusingProxy` is what HTTP_PROXY / HTTPS_PROXY point at in the agents' environment: it answers 403 to every
request (a CONNECT for https) and notes the target, so an agent that tries to reach the internet fails at once and the
attempt is on record.

Both run on an asyncio loop in a thread of their own, so the test drives the agents with plain subprocess calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

CAP = 48
# Headers that describe one hop, not the message: never copied across the proxy.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "host", "content-length"})
# What the answer of each generation route is limited by, when the client sets nothing (llama-server takes all three
# OpenAI names on its chat route).
DEFAULT_LIMIT = {"/v1/chat/completions": "max_tokens", "/chat/completions": "max_tokens",
                 "/v1/completions": "max_tokens", "/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens",
                 "/responses": "max_output_tokens", "/completion": "n_predict", "/completions": "n_predict"}
LIMIT_FIELDS = ("max_tokens", "max_output_tokens", "max_completion_tokens", "n_predict")
KEPT_RESPONSE_BYTES = 256 * 1024


@dataclass
class Record:
    """One request through the proxy, as the client sent it, and what its answer reported."""

    index: int
    turn: str
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # the parsed JSON body as the client sent it (before capping); None if none or not JSON
    capped: dict[str, list[Any]] = field(default_factory=dict)  # field -> [the client's value, the value sent]
    started: float = 0.0
    ended: float = 0.0
    status: int = 0
    stream: bool = False
    content_type: str = ""
    response_headers: dict[str, str] = field(default_factory=dict)  # slotkeeper's X-Slotkeeper-* only
    timings: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    error: str = ""  # an error body (status >= 400) or an error event inside a stream
    end: str = ""  # completed | client-gone | upstream-failed
    response_text: str = ""  # the answer's first KEPT_RESPONSE_BYTES bytes

    @property
    def prompt_n(self) -> int | None:
        """Prompt tokens the backend evaluated for this request, from its timings (else from the usage)."""
        if self.timings and "prompt_n" in self.timings:
            return int(self.timings["prompt_n"])
        return _usage_counts(self.usage)[0]

    @property
    def cache_n(self) -> int | None:
        """Prompt tokens the backend took from its cache, from its timings (else from the usage)."""
        if self.timings and "cache_n" in self.timings:
            return int(self.timings["cache_n"])
        return _usage_counts(self.usage)[1]

    @property
    def failed(self) -> bool:
        return self.status >= 400 or self.end == "upstream-failed"

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["prompt_n"], data["cache_n"] = self.prompt_n, self.cache_n
        return data


def _usage_counts(usage: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """(evaluated, cached) prompt tokens from a usage object of any of the three APIs."""
    if not usage:
        return None, None
    if "cache_read_input_tokens" in usage or ("input_tokens" in usage and "input_tokens_details" not in usage):
        return usage.get("input_tokens"), usage.get("cache_read_input_tokens", 0)  # Anthropic: input is uncached
    total = usage.get("input_tokens", usage.get("prompt_tokens"))
    details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens", 0) or 0)
    return (None if total is None else int(total) - cached), cached


def cap_body(path: str, body: dict[str, Any], cap: int) -> dict[str, list[Any]]:
    """Cap the body's output limits at `cap` in place (adding the route's own where none is set); returns what
    changed."""
    changed: dict[str, list[Any]] = {}
    route = path.split("?", 1)[0]
    for name in LIMIT_FIELDS:
        value = body.get(name)
        if name in body and (not isinstance(value, int) or value < 0 or value > cap):
            changed[name] = [value, cap]
            body[name] = cap
    options = body.get("options")
    if route in ("/api/chat", "/api/generate"):
        options = body.setdefault("options", {}) if options is None else options
        if isinstance(options, dict):
            value = options.get("num_predict")
            if not isinstance(value, int) or value < 0 or value > cap:
                changed["options.num_predict"] = [value, cap]
                options["num_predict"] = cap
    elif route in DEFAULT_LIMIT and not any(name in body for name in LIMIT_FIELDS):
        changed[DEFAULT_LIMIT[route]] = [None, cap]
        body[DEFAULT_LIMIT[route]] = cap
    return changed


def _events(text: str) -> list[Any]:
    """The JSON payloads of a server-sent-event stream's `data:` lines."""
    out = []
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == "[DONE]":
            continue
        try:
            out.append(json.loads(payload))
        except json.JSONDecodeError:
            continue
    return out


def read_answer(record: Record, raw: bytes) -> None:
    """Fill in the record's timings, usage and error from the answer's bytes."""
    text = raw.decode("utf-8", errors="replace")
    record.response_text = raw[:KEPT_RESPONSE_BYTES].decode("utf-8", errors="replace")
    if "text/event-stream" in record.content_type or text.lstrip().startswith(("data:", "event:")):
        documents = _events(text)
    else:
        try:
            documents = [json.loads(text)] if text.strip() else []
        except json.JSONDecodeError:
            documents = []
    for doc in documents:
        if not isinstance(doc, dict):
            continue
        for holder in (doc, doc.get("message"), doc.get("response")):
            if not isinstance(holder, dict):
                continue
            if isinstance(holder.get("timings"), dict):
                record.timings = holder["timings"]
            usage = holder.get("usage")
            if isinstance(usage, dict) and usage:
                record.usage = {**(record.usage or {}), **usage}
        kind = doc.get("type")
        if "error" in doc or kind in ("error", "response.failed"):
            record.error = record.error or json.dumps(doc)[:2000]
    if record.status >= 400 and not record.error:
        record.error = text[:2000]


class RecordingProxy:
    """A recording, output-capping proxy in front of `target` (a base URL), on a free loopback port."""

    def __init__(self, target: str, cap: int = CAP) -> None:
        self.target = target.rstrip("/")
        self.cap = cap
        self.records: list[Record] = []
        self.turn = ""
        self.port = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="recording-proxy", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RecordingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> RecordingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_turn(self, label: str) -> None:
        with self._lock:
            self.turn = label

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until every recorded request has ended (an agent that was stopped may leave one behind)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(r.ended for r in self.snapshot()):
                return True
            time.sleep(0.05)
        return False

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=900), auto_decompress=False)
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        path = request.path_qs
        with self._lock:
            record = Record(index=len(self.records), turn=self.turn, method=request.method, path=path,
                            headers={k: v for k, v in request.headers.items()}, body=None, started=time.time())
            self.records.append(record)
        body_bytes = raw
        if raw:
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                body = None
            if isinstance(body, dict):
                record.body = json.loads(raw)  # an untouched copy
                record.stream = bool(body.get("stream"))
                if request.method == "POST":
                    record.capped = cap_body(path, body, self.cap)
                    if record.capped:
                        body_bytes = json.dumps(body).encode()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_BY_HOP and k.lower() != "accept-encoding"}
        assert self._session is not None
        response = web.StreamResponse()
        kept = bytearray()
        try:
            async with self._session.request(request.method, self.target + path, headers=headers, data=body_bytes,
                                             allow_redirects=False) as upstream:
                record.status = upstream.status
                record.content_type = upstream.headers.get("Content-Type", "")
                record.response_headers = {k: v for k, v in upstream.headers.items()
                                           if k.lower().startswith("x-slotkeeper")}
                response.set_status(upstream.status, upstream.reason)
                for name, value in upstream.headers.items():
                    if name.lower() not in HOP_BY_HOP:
                        response.headers.add(name, value)
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    kept += chunk
                    try:
                        await response.write(chunk)
                    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                        # The agent hung up (some do once they have read the last event): leaving this block closes
                        # the upstream connection too, as the agent's own hang-up would have.
                        record.end = "client-gone"
                        return response
                try:
                    await response.write_eof()
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    record.end = "client-gone"
                    return response
                record.end = "completed"
        except asyncio.CancelledError:
            record.end = record.end or "client-gone"
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            record.end = "upstream-failed"
            record.error = f"{type(exc).__name__}: {exc}"
            if not response.prepared:
                record.status = record.status or 502
                return web.Response(status=502, text=record.error)
        finally:
            read_answer(record, bytes(kept))
            record.ended = time.time()
        return response


class RefusingProxy:
    """A forward proxy that refuses everything (403) and notes what was asked for; runs on `loop`."""

    def __init__(self) -> None:
        self.attempts: list[dict[str, Any]] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            self.attempts.append({"time": time.time(), "request": line.decode("latin-1").strip()[:300]})
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()


class Proxies(RecordingProxy):
    """The recording proxy and, on the same loop, the refusing one (`outbound`)."""

    def __init__(self, target: str, cap: int = CAP) -> None:
        super().__init__(target, cap)
        self.outbound = RefusingProxy()

    async def _start(self) -> None:
        await super()._start()
        await self.outbound.start()

    async def _stop(self) -> None:
        await self.outbound.stop()
        await super()._stop()
