"""A plain round-robin load balancer, the baseline of the scenario `backends`: what teams put in front of several
llama-servers today (a LiteLLM or nginx upstream with no session affinity). Each request goes to the next backend
in turn; bodies and answers pass through unchanged, streamed.

`python -m bench.roundrobin --port P URL [URL ...]`
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

_HOP = {"host", "content-length", "transfer-encoding", "connection"}


def make_app(backends: list[str]) -> Starlette:
    turn = itertools.cycle(backends)
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=httpx.Limits(max_connections=64))

    async def forward(request: Request) -> Response:
        url = next(turn) + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        upstream = await client.send(client.build_request(request.method, url, headers=headers,
                                                          content=await request.body()), stream=True)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        return StreamingResponse(body(), status_code=upstream.status_code, headers=kept)

    async def health(_: Request) -> Response:
        return Response("ok")

    return Starlette(routes=[Route("/health", health), Route("/{path:path}", forward,
                                                               methods=["GET", "POST", "DELETE"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("backends", nargs="+")
    args = parser.parse_args()
    uvicorn.run(make_app([b.rstrip("/") for b in args.backends]), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
