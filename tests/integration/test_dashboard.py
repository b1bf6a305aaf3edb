"""The dashboard in headless Chromium (Debian's chromium, driven by Playwright) over a real llama-server.

The page must load, show sessions made through the API, send the admin key, and delete a session's file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Stack
from tests.support import Conversation, wait_until

pytestmark = pytest.mark.backend

CHROMIUM = os.environ.get("SLOTKEEPER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def backend_kind() -> str:
    """The page talks to slotkeeper only, so one backend kind is enough."""
    return "binary"


@pytest.fixture
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed (pip install -e '.[dev]')")
    if not os.path.exists(CHROMIUM):
        _missing(f"no Chromium at {CHROMIUM} (apt-get install chromium; scripts/test.sh does it as root)")
    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            yield instance
        finally:
            instance.close()


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)  # CI installs both: a missing browser there is a broken set-up, not a skip
    pytest.skip(reason)


def test_dashboard_shows_and_deletes_sessions(stack: Stack, client_for, browser: Any) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0), "--admin-key", "sesame")
    client = client_for(keeper)
    client.headers["Authorization"] = "Bearer sesame"
    Conversation(client, "dash a/1", size=400, seed=1).turn()
    Conversation(client, "dash-b", size=300, seed=2).turn()  # switching saves "dash a/1"
    row = keeper.row("dash a/1")
    assert row is not None
    snapshot = stack.slot_dir / row["filename"]
    assert snapshot.is_file()

    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto(keeper.url + "/dashboard")
    assert page.title() == "slotkeeper"
    # Without the key the API calls are refused, and the page says so.
    page.wait_for_selector("#status.error")
    assert "401" in page.inner_text("#status")

    page.fill("#admin-key", "sesame")
    page.dispatch_event("#admin-key", "change")
    session_row = page.locator('#sessions tbody tr[data-session="dash a/1"]')
    session_row.wait_for(timeout=15000)
    cells = session_row.locator("td").all_inner_texts()
    assert cells[0] == "dash a/1" and cells[1] == "tiny" and cells[2] == str(row["n_tokens"])
    assert page.locator('#slots tbody tr[data-slot="0"] td').nth(1).inner_text() == "dash-b"
    assert page.locator("#requests tbody tr").count() == 2
    assert page.locator('#summary div[data-metric="saves"] dd').inner_text() == "1"

    session_row.locator("button.delete").click()
    page.locator('#sessions tbody tr[data-session="dash a/1"]').wait_for(state="detached", timeout=15000)
    assert wait_until(lambda: not snapshot.exists(), timeout=5)
    assert keeper.row("dash a/1") is None
    assert page.inner_text("#action").startswith("deleted dash a/1 (")
    assert errors == []
