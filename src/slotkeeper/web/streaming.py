"""An ASGI streaming response that owns a turn: it forwards chunks, notices a client hang-up at once, and always
closes the backend stream and releases the slot, however the response ends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from slotkeeper.errors import SlotkeeperError
from slotkeeper.service import StreamTurn


class TurnStreamResponse(StreamingResponse):
    def __init__(self, turn: StreamTurn, on_error: Callable[[SlotkeeperError], bytes]) -> None:
        super().__init__(
            turn.chunks(on_error),
            status_code=turn.response.status_code,
            headers={**turn.record.headers(), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            media_type=turn.media_type,
        )
        self.turn = turn

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
