"""The dashboard at `/dashboard`: static HTML, JavaScript and CSS shipped in this package, no build step.

The page polls the JSON endpoints (/api/sessions..., /api/requests/recent, /api/backend) and calls the session
actions (clear, pin, delete, pre-warm).
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from slotkeeper.errors import NotFound

router = APIRouter(prefix="/dashboard", include_in_schema=False)

# The only files served: a fixed list, so no request path ever reaches the file system.
_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}


@router.get("")
async def dashboard_root() -> RedirectResponse:
    return RedirectResponse("/dashboard/", status_code=307)


@router.get("/")
async def dashboard_index() -> Response:
    return _file("index.html")


@router.get("/{name}")
async def dashboard_file(name: str) -> Response:
    return _file(name)


def _file(name: str) -> Response:
    media_type = _FILES.get(name)
    if media_type is None:
        raise NotFound(f"no dashboard file '{name}'")
    body = resources.files(__name__).joinpath(name).read_bytes()
    return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})
