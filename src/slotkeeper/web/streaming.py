"""An ASGI streaming response that owns a turn: it forwards chunks, notices a client hang-up at once, and always
closes the backend stream and releases the slot, however the response ends."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from slotkeeper.errors import SlotkeeperError
from slotkeeper.serving.service import StreamTurn


class TurnStreamResponse(StreamingResponse):
    """Streams `body` (the backend's bytes, or a dialect's re-framing of them) for one leased turn."""

    def __init__(self, turn: StreamTurn, body: AsyncIterator[bytes], media_type: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        # Nothing may fail between opening the turn and returning this response: only running it closes the turn,
        # and a turn never closed holds its slot for good. So extra headers come in here, already header-safe.
        super().__init__(
            body,
            status_code=turn.status_code,
            headers={**turn.record.headers(), **(headers or {}), "Cache-Control": "no-cache",
                     "X-Accel-Buffering": "no"},
            media_type=media_type or turn.media_type,
        )
        self.turn = turn

    @classmethod
    def passthrough(cls, turn: StreamTurn, on_error: Callable[[SlotkeeperError], bytes]) -> TurnStreamResponse:
        """The backend's own SSE bytes, unchanged, with `on_error` framing a broken connection."""
        return cls(turn, turn.chunks(on_error))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(watch_disconnect)
                with contextlib.suppress(OSError):  # the client went away while we were writing
                    await self.stream_response(send)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.turn.close()

