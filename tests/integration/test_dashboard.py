"""The dashboard in headless Chromium (Debian's chromium, driven by Playwright) over a real llama-server.

The page must load, show sessions made through the API, send the admin key, delete a session's file, clear one
slot, pre-warm a system prompt, pin and delete its snapshot, show the disk budget, and with several models act on
the one chosen in its selector.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Stack
from tests.support import Conversation, wait_until, words

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
    snapshot = stack.slot_dir / (row["filename"] + (".tail" if row["tail_bytes"] else ""))  # its file, or tail
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
    # Why each was prefilled: in the requests table, and as the chart of reasons over time with its legend.
    assert page.locator("#requests tbody tr td.why").all_inner_texts() == ["new-session", "new-session"]
    assert page.locator('#reasons-legend [data-reason="new-session"]').inner_text() == "new-session 2"
    assert page.locator("#reasons-chart rect").count() >= 1
    assert page.locator('#summary div[data-metric="saves"] dd').inner_text() == "1"

    session_row.locator("button.delete").click()
    page.locator('#sessions tbody tr[data-session="dash a/1"]').wait_for(state="detached", timeout=15000)
    assert wait_until(lambda: not snapshot.exists(), timeout=5)
    assert keeper.row("dash a/1") is None
    assert page.inner_text("#action").startswith("deleted dash a/1 (")
    assert errors == []


def test_dashboard_clears_one_slot_and_prewarms_a_system_prompt(stack: Stack, client_for, browser: Any) -> None:
    from playwright.sync_api import expect

    keeper = stack.slotkeeper(stack.backend(parallel=2, cache_ram=0), "--admin-key", "sesame", "--disk-budget", "256M")
    client = client_for(keeper)
    client.headers["Authorization"] = "Bearer sesame"
    Conversation(client, "steer-a", size=300, seed=1).turn()
    Conversation(client, "steer-b", size=300, seed=2).turn()
    held = {s["session"]: s["id"] for s in client.get("/api/sessions/current").json()["slots"]}
    slot_a, slot_b = held["steer-a"], held["steer-b"]

    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("dialog", lambda dialog: dialog.accept())
    page.add_init_script("localStorage.setItem('slotkeeper.adminKey', 'sesame')")
    page.goto(keeper.url + "/dashboard")
    expect(page.locator("#disk-text")).to_contain_text("0 B used of budget 256.0 MiB (0 evicted)")
    expect(page.locator("#disk-line .bar")).to_be_visible()

    # Clearing slot B's row saves B and erases that slot only: A stays in its slot, unsaved.
    row_b = page.locator(f'#slots tbody tr[data-slot="{slot_b}"]')
    expect(row_b.locator("td.session")).to_have_text("steer-b")
    row_b.locator("button.clear").click()
    expect(row_b.locator("td.session")).to_have_text("(empty)")
    expect(page.locator("#action")).to_have_text(f"erased slot {slot_b} (held steer-b, saved first if it had changed)")
    slots = {s["id"]: s for s in client.get("/api/sessions/current").json()["slots"]}
    assert slots[slot_b]["session"] is None and slots[slot_b]["n_tokens"] == 0
    assert slots[slot_a]["session"] == "steer-a" and slots[slot_a]["dirty"]
    assert keeper.row("steer-b") is not None and keeper.row("steer-a") is None
    expect(page.locator(f'#slots tbody tr[data-slot="{slot_a}"] td.session')).to_have_text("steer-a")
    expect(page.locator("#disk-text")).to_contain_text(" used of budget 256.0 MiB (0 evicted)")
    expect(page.locator("#disk-text")).not_to_contain_text("0 B used")
    assert page.eval_on_selector("#disk-bar", "bar => parseFloat(bar.style.width)") > 0

    # A pre-warm from the page makes a system snapshot, listed in the index and in the page's table.
    page.fill("#prewarm-system", "You are the dashboard's test assistant. " + words(400, 9))
    page.click("#prewarm-button")
    result = page.locator("#prewarm-result")
    expect(result).to_contain_text("saved as a system snapshot", timeout=30000)
    key = result.get_attribute("data-system")
    [system] = client.get("/api/sessions", params={"kind": "system"}).json()["sessions"]
    assert system["session"] == key and system["kind"] == "system" and not system["pinned"]
    row = page.locator(f'#systems tbody tr[data-system="{key}"]')
    expect(row.locator("td").nth(0)).to_have_text(key[:12])
    assert row.locator("td").nth(2).inner_text() == str(system["tokens"])
    assert client.get("/api/sessions/current").json()["slots"][slot_a]["session"] == "steer-a"

    # Pin it from the page, then delete it from the page.
    row.locator("button.pin").click()
    expect(row.locator("td.pinned")).to_have_text("yes")
    assert client.get("/api/sessions", params={"kind": "system"}).json()["sessions"][0]["pinned"] is True
    expect(row.locator("button.pin")).to_have_text("unpin")
    row.locator("button.delete").click()
    row.wait_for(state="detached", timeout=15000)
    assert client.get("/api/sessions", params={"kind": "system"}).json()["sessions"] == []
    assert page.inner_text("#action").startswith(f"deleted system prompt {key[:12]} (")

    # A session's pin toggle works the same way. The page's polls keep what did not change (its "last used" text is
    # patched in place), so a click that lands while one re-renders still reaches its button.
    session_row = page.locator('#sessions tbody tr[data-session="steer-b"]')
    pin = session_row.locator("button.pin").element_handle()
    page.wait_for_timeout(2500)  # more than one poll (POLL_MS)
    assert pin.evaluate("b => b.isConnected")
    session_row.locator("button.pin").click()
    expect(session_row.locator("td.pinned")).to_have_text("yes")
    assert client.get("/api/sessions/steer-b").json()["pinned"] is True
    assert errors == []


def test_dashboard_with_several_models(two_backends: Any, client_for, browser: Any) -> None:
    from playwright.sync_api import expect

    keeper = two_backends
    client = client_for(keeper)
    for model, session in (("alpha", "on-alpha"), ("beta", "on-beta")):
        response = client.post("/v1/chat/completions", headers={"X-Session-Id": session}, json={
            "model": model, "messages": [{"role": "user", "content": words(300, 1)}], "max_tokens": 2})
        assert response.status_code == 200, response.text

    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto(keeper.url + "/dashboard")
    expect(page.locator("#model-choice")).to_be_visible()
    assert page.locator("#model option").all_inner_texts() == ["alpha", "beta"]
    slot = page.locator('#slots tbody tr[data-slot="0"]')
    expect(slot.locator("td.session")).to_have_text("on-alpha")
    expect(page.locator("#requests tbody tr")).to_have_count(2)  # every model's requests

    # The selector switches the per-backend parts; clearing a slot then acts on that backend's slot.
    page.select_option("#model", "beta")
    expect(slot.locator("td.session")).to_have_text("on-beta")
    expect(page.locator("#backend")).to_contain_text("beta at ")
    slot.locator("button.clear").click()
    expect(slot.locator("td.session")).to_have_text("(empty)")
    current = client.get("/api/sessions/current", params={"model": "beta"}).json()
    assert current["slots"][0]["session"] is None
    assert client.get("/api/sessions/current").json()["slots"][0]["session"] == "on-alpha"
    expect(page.locator('#sessions tbody tr[data-session="on-beta"] td').nth(1)).to_have_text("beta")
    assert errors == []
