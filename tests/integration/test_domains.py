"""Cache domains on a real server, with the real `openai` and `anthropic` clients and OpenWebUI's forwarded user
header: two users never reuse each other's state (even on one slot, even under the same derived session name), each
user's own turns restore as before, a salt keeps a key's requests apart, a forged or bad input is refused before the
cache sees it, and the session API shows each caller its own domain (docs/domains.md).

One backend and one slotkeeper per backend kind, shared by the tests of this module; each test uses prompts of its
own. Assertions are on counts (timings.cache_n, prompt_n), X-Slotkeeper-Cache, status codes and index rows.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import BACKEND_KINDS, Stack
from tests.support import Slotkeeper, words

OWUI_KEY = "owui-key-0123456789abcdef"
TEAM_KEY = "team-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"
USER_HEADER = "X-OpenWebUI-User-Id"
# Tokens a restore may leave to prefill again (the tail the backend re-evaluates): the tiny model's chat template
# and a few tokens of slack.
SLACK = 64


@pytest.fixture(scope="module", params=BACKEND_KINDS)
def keeper(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           tiny_model: Path) -> Iterator[Slotkeeper]:
    tmp = tmp_path_factory.mktemp(f"domains-{request.param}")
    config = tmp / "slotkeeper.toml"
    config.write_text(f'admin_key = "{ADMIN_KEY}"\nuser_header = "{USER_HEADER}"\n'
                      f'[api_keys]\nopenwebui = "{OWUI_KEY}"\nteam = "{TEAM_KEY}"\n')
    stack = Stack(tmp, request.param, tiny_model)
    try:
        backend = stack.backend(parallel=1, cache_ram=0)  # one slot: every user's turn goes through it
        yield stack.slotkeeper(backend, "--config", str(config))
    finally:
        stack.stop_all()


def sdk(keeper: Slotkeeper, key: str, user: str | None = None) -> openai.OpenAI:
    headers = {USER_HEADER: user} if user is not None else {}
    return openai.OpenAI(base_url=keeper.url + "/v1", api_key=key, default_headers=headers, max_retries=0,
                         timeout=300)


def ask(client: openai.OpenAI, messages: list[dict[str, str]], **extra: Any) -> tuple[str, dict[str, Any]]:
    """One turn; the cache's outcome (X-Slotkeeper-Cache) and the backend's timings."""
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                                           max_tokens=4, temperature=0, **extra)
    timings: dict[str, Any] = raw.http_response.json()["timings"]
    return raw.headers["x-slotkeeper-cache"], timings


def total(timings: dict[str, Any]) -> int:
    return int(timings["cache_n"]) + int(timings["prompt_n"])


def admin(keeper: Slotkeeper) -> httpx.Client:
    return httpx.Client(base_url=keeper.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120)


def as_user(keeper: Slotkeeper, key: str, user: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}", **({USER_HEADER: user} if user is not None else {})}
    return httpx.Client(base_url=keeper.url, headers=headers, timeout=120)


def rows(keeper: Slotkeeper) -> list[dict[str, Any]]:
    return keeper.index_rows({"Authorization": f"Bearer {ADMIN_KEY}"})


def opening(seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You answer briefly. " + words(1400, seed)},
            {"role": "user", "content": words(200, seed + 1)}]


def test_two_users_on_one_slot_never_reuse_each_others_state(keeper: Slotkeeper) -> None:
    alice, bob = sdk(keeper, OWUI_KEY, "alice"), sdk(keeper, OWUI_KEY, "bob")
    first = opening(100)
    outcome, a1 = ask(alice, first)
    assert a1["cache_n"] == 0 and outcome == "cold"
    second = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": words(60, 103)}]
    _, a2 = ask(alice, second)
    assert a2["cache_n"] >= total(a1) - SLACK  # alice's own next turn: hot, as without domains

    # Bob sends alice's first request, word for word, into the slot that holds alice's state: a cold prefill.
    outcome, b1 = ask(bob, first)
    assert (outcome, b1["cache_n"], b1["prompt_n"]) == ("cold", 0, total(a1))
    bob_second = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": words(60, 104)}]
    _, b2 = ask(bob, bob_second)
    assert b2["cache_n"] >= total(b1) - SLACK

    # Alice comes back after bob took the slot: her own state is restored, never bob's.
    outcome, a3 = ask(alice, [*second, {"role": "assistant", "content": "ok"},
                              {"role": "user", "content": words(40, 105)}])
    assert outcome == "restored" and a3["cache_n"] >= total(a2) - SLACK
    # What alice's request journal says of it names no session of bob's (his first turn's name is his alone).
    latest = as_user(keeper, OWUI_KEY, "alice").get("/api/requests/recent", params={"limit": 1}).json()["requests"][0]
    assert "another cache domain" in latest["why_detail"]
    journal = admin(keeper).get("/api/requests/recent").json()["requests"]
    bobs = ({r["session"] for r in journal if r["domain"] == "openwebui/user=bob"}
            - {r["session"] for r in journal if r["domain"] == "openwebui/user=alice"})
    assert bobs and not any(name in latest["why_detail"] or name == latest["restored_from"] for name in bobs)
    # /slots tells how much the slot holds to alice, whose state it is, and nothing to bob.
    assert as_user(keeper, OWUI_KEY, "alice").get("/slots").json()[0]["n_tokens"] > 0
    assert as_user(keeper, OWUI_KEY, "bob").get("/slots").json()[0]["n_tokens"] == 0

    # Both conversations are named alike (same system prompt, opening and first answer): two rows, one per domain.
    named = [r for r in rows(keeper) if r["kind"] == "session" and r["n_tokens"] >= total(a2) - SLACK
             and r["domain"].startswith("openwebui/user=")]
    by_name: dict[str, set[str]] = {}
    for row in named:
        by_name.setdefault(row["session_id"], set()).add(row["domain"])
    assert {"openwebui/user=alice", "openwebui/user=bob"} in by_name.values()


def test_a_salt_keeps_one_keys_requests_apart(keeper: Slotkeeper) -> None:
    team = sdk(keeper, TEAM_KEY)
    first = opening(200)
    _, s1 = ask(team, first, extra_body={"cache_salt": "project-one"})
    assert s1["cache_n"] == 0
    outcome, s2 = ask(team, first, extra_body={"cache_salt": "project-two"})
    assert (outcome, s2["cache_n"]) == ("cold", 0)
    later = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": words(50, 203)}]
    outcome, s3 = ask(team, later, extra_body={"cache_salt": "project-one"})
    assert outcome in ("restored", "prefix") and s3["cache_n"] >= total(s1) - SLACK
    # The salt itself is never stored: its domain holds a hash of it.
    domains = {r["domain"] for r in rows(keeper)}
    assert any(d.startswith("team/salt=") for d in domains) and not any("project" in d for d in domains)


def test_a_forged_user_header_or_a_bad_salt_is_refused_before_the_cache(keeper: Slotkeeper) -> None:
    body = {"model": "tiny", "messages": opening(300), "max_tokens": 2}
    before = len(admin(keeper).get("/api/requests/recent").json()["requests"])
    with httpx.Client(base_url=keeper.url, timeout=60) as plain:
        assert plain.post("/v1/chat/completions", json=body, headers={USER_HEADER: "alice"}).status_code == 401
        assert plain.post("/v1/chat/completions", json=body, headers={
            USER_HEADER: "alice", "Authorization": "Bearer not-a-key"}).status_code == 401
        assert plain.get("/api/sessions", headers={USER_HEADER: "alice"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        ask(sdk(keeper, "wrong-key", "alice"), opening(300))

    alice = sdk(keeper, OWUI_KEY, "alice")
    for salt in ("", "x" * 129, "two words", 42, ["a"]):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(alice, opening(300), extra_body={"cache_salt": salt})
        assert caught.value.status_code == 400 and "cache_salt" in str(caught.value.body)
    claude = anthropic.Anthropic(base_url=keeper.url, api_key=OWUI_KEY, default_headers={USER_HEADER: "alice"},
                                 max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"cache_salt": ""})
    assert refused.value.status_code == 400 and refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        ask(sdk(keeper, OWUI_KEY, "two words"), opening(300))  # a user id that cannot name a domain
    # None of them reached the planner: no turn was recorded.
    assert len(admin(keeper).get("/api/requests/recent").json()["requests"]) == before


def test_the_session_api_shows_each_caller_its_own_domain(keeper: Slotkeeper) -> None:
    alice, bob = sdk(keeper, OWUI_KEY, "alice"), sdk(keeper, OWUI_KEY, "bob")
    first = opening(400)
    for who, seed in ((alice, 401), (bob, 402)):
        ask(who, first)
        ask(who, [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": words(40, seed)}])
    everyone = admin(keeper).get("/api/sessions").json()["sessions"]
    assert {"openwebui/user=alice", "openwebui/user=bob"} <= {s["domain"] for s in everyone}

    for user in ("alice", "bob"):
        mine = as_user(keeper, OWUI_KEY, user).get("/api/sessions").json()["sessions"]
        assert mine and {s["domain"] for s in mine} == {f"openwebui/user={user}"}
        recent = as_user(keeper, OWUI_KEY, user).get("/api/requests/recent").json()
        assert recent["requests"] and {r["domain"] for r in recent["requests"]} == {f"openwebui/user={user}"}
    # The front end's key without a user sees its users' domains; another key sees none of them.
    assert {s["domain"] for s in as_user(keeper, OWUI_KEY).get("/api/sessions").json()["sessions"]} >= {
        "openwebui/user=alice", "openwebui/user=bob"}
    assert not any(s["domain"].startswith("openwebui") for s in
                   as_user(keeper, TEAM_KEY).get("/api/sessions").json()["sessions"])

    # Bob's session, by the name alice's own session has too: alice gets hers, never his.
    bobs = next(s for s in everyone if s["domain"] == "openwebui/user=bob")
    as_alice = as_user(keeper, OWUI_KEY, "alice")
    shown = as_alice.get(f"/api/sessions/{bobs['session']}")
    assert shown.status_code == 404 or shown.json()["domain"] == "openwebui/user=alice"
    assert as_alice.get(f"/api/sessions/{bobs['session']}",
                        params={"domain": "openwebui/user=bob"}).status_code == 404
    assert as_user(keeper, TEAM_KEY).delete(f"/api/sessions/{bobs['session']}").status_code == 404
    assert admin(keeper).get(f"/api/sessions/{bobs['session']}",
                             params={"domain": "openwebui/user=bob"}).json()["domain"] == "openwebui/user=bob"

    # Export carries the domain; another key cannot import it; the admin can, into a domain it names.
    alices = next(s for s in as_alice.get("/api/sessions").json()["sessions"])
    bundle = as_alice.get(f"/api/sessions/{alices['session']}/export")
    assert bundle.status_code == 200
    refused = as_user(keeper, TEAM_KEY).post("/api/sessions/import", params={"as": "copied"},
                                             content=io.BytesIO(bundle.content).read())
    assert refused.status_code == 403
    moved = admin(keeper).post("/api/sessions/import", params={"as": "copied", "domain": "team"},
                               content=bundle.content)
    assert moved.status_code == 200 and moved.json()["domain"] == "team"
    assert [s["session"] for s in as_user(keeper, TEAM_KEY).get("/api/sessions").json()["sessions"]
            if s["session"] == "copied"] == ["copied"]

    # The operator's views are the admin key's.
    for path in ("/metrics", "/api/backend", "/api/sessions/current", "/api/sessions/disk"):
        assert as_user(keeper, OWUI_KEY, "alice").get(path).status_code == 401
        assert admin(keeper).get(path).status_code == 200


def test_a_prompt_shared_on_purpose_is_pre_warmed_into_a_domain(keeper: Slotkeeper, tmp_path: Path) -> None:
    """docs/domains.md's command: the operator pre-warms a system prompt into one user's domain; that user's first
    chat on it starts from it, another user's does not."""
    first = opening(500)
    prompt = tmp_path / "preset.txt"
    prompt.write_text(first[0]["content"])
    run = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "prewarm", "--url", keeper.url, "--admin-key",
                          ADMIN_KEY, "--domain", "openwebui/user=carol", str(prompt)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    system_states = [s for s in admin(keeper).get("/api/sessions", params={"kind": "system"}).json()["sessions"]
                     if s["domain"] == "openwebui/user=carol"]
    assert len(system_states) == 1
    # (From the slot the pre-warm left it in, or restored: either way carol's own, and all of it.)
    _, carol = ask(sdk(keeper, OWUI_KEY, "carol"), first)
    assert carol["cache_n"] >= system_states[0]["tokens"] - SLACK
    outcome, dave = ask(sdk(keeper, OWUI_KEY, "dave"), first)
    assert (outcome, dave["cache_n"]) == ("cold", 0)
    listing = subprocess.run([sys.executable, "-m", "slotkeeper.cli", "sessions", "ls", "--kind", "all", "--url",
                              keeper.url, "--admin-key", ADMIN_KEY], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and "DOMAIN" in listing.stdout and "openwebui/user=carol" in listing.stdout
