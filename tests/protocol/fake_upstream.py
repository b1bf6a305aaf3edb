"""A recording stand-in for llama-server, for protocol tests only (what slotkeeper sends, how it frames errors).

It never stands in for cache behaviour: restores and reuse are proven against real servers in tests/integration.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from slotkeeper.upstream.launcher import free_port


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeUpstream:
    slot_dir: Path
    port: int = field(default_factory=free_port)
    requests: list[Recorded] = field(default_factory=list)
    # Streams: how many chunks to send before breaking the connection (None: finish normally).
    break_stream_after: int | None = None
    # The id of the last task the slot ran, as llama-server's /slots shows it (none before the first): without it, the
    # slot of a turn read by slotkeeper's watch looked like a restarted server's (found as a test that failed on CI).
    last_task: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> Starlette:
        async def props(_: Request) -> Response:
            return JSONResponse({"total_slots": 1, "model_alias": "fake", "model_path": "/nonexistent/fake.gguf",
                                 "build_info": "fake", "default_generation_settings": {"n_ctx": 4096}})

        async def slots(_: Request) -> Response:
            slot: dict[str, Any] = {"id": 0, "n_ctx": 4096, "is_processing": False}
            if self.last_task is not None:
                slot["id_task"] = self.last_task
            return JSONResponse([slot])

        async def models(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "fake", "meta": {"n_params": 1}}]})

        async def slot_action(request: Request) -> Response:
            body = json.loads(await request.body() or b"{}")
            action = request.query_params["action"]
            name = body.get("filename", "")
            if action in ("save", "restore") and (".." in name or "/" in name):
                return JSONResponse({"error": {"code": 400, "message": "Invalid filename"}}, status_code=400)
            if action == "save":
                (self.slot_dir / name).write_bytes(b"x" * 64)
                return JSONResponse({"id_slot": 0, "filename": name, "n_saved": 10, "n_written": 64,
                                     "timings": {"save_ms": 0.1}})
            if action == "restore":
                return JSONResponse({"id_slot": 0, "filename": name, "n_restored": 10, "n_read": 64,
                                     "timings": {"restore_ms": 0.1}})
            return JSONResponse({"id_slot": 0, "n_erased": 0})

        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            self.requests.append(Recorded(request.url.path, dict(request.headers), body))
            self.last_task = 0 if self.last_task is None else self.last_task + 1
            if body.get("messages") == "fail":
                return JSONResponse({"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}},
                                    status_code=400)
            if not body.get("stream"):
                return JSONResponse({"choices": [{"message": {"role": "assistant", "content": "ok"}}],
                                     "timings": {"cache_n": 0, "prompt_n": 3, "predicted_n": 1}})

            async def events() -> Any:
                for i in range(5):
                    if self.break_stream_after is not None and i == self.break_stream_after:
                        raise RuntimeError("upstream dies mid-stream")
                    yield f'data: {{"choices":[{{"delta":{{"content":"t{i}"}}}}]}}\n\n'.encode()
                    await asyncio.sleep(0.01)
                yield b'data: {"choices":[],"timings":{"cache_n":0,"prompt_n":3,"predicted_n":5}}\n\n'
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def native(request: Request) -> Response:
            # llama-server's /tokenize and /detokenize: recorded, and answered with a token list. (No /apply-template:
            # without it, warm-ups of system prompts go to the chat route, which the protocol tests count on.)
            body = json.loads(await request.body())
            self.requests.append(Recorded(request.url.path, dict(request.headers), body))
            return JSONResponse({"tokens": [1, 2, 3]})

        async def health(_: Request) -> Response:
            return JSONResponse({"status": "ok"})

        return Starlette(routes=[
            Route("/health", health), Route("/props", props), Route("/slots", slots), Route("/v1/models", models),
            Route("/slots/{slot_id}", slot_action, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", chat, methods=["POST"]),
            *(Route(path, chat, methods=["POST"]) for path in ("/infill", "/completion", "/completions")),
            *(Route(path, native, methods=["POST"]) for path in ("/tokenize", "/detokenize")),
        ])

    def start(self) -> FakeUpstream:
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        config = uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="error")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
