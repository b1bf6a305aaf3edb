"""Cache domains without a server: what a domain is made of and who sees it (domains.py), the guard that names the
caller, the index that keeps one name per domain, the pool that erases a slot another domain's tokens are in, and the
settings that refuse what would leak (docs/domains.md). The real-server proof is tests/integration/test_domains.py.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from slotkeeper.cache.blocks import block_scope
from slotkeeper.cache.chain import message_chain
from slotkeeper.cache.index import SnapshotIndex
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.slots import TurnEnd
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import SnapshotStore
from slotkeeper.config import Settings
from slotkeeper.domains import Caller, checked_domain, checked_user, key_domain, salted, sees
from slotkeeper.errors import BadRequest, UpstreamError
from slotkeeper.serving.identity import resolve_session
from slotkeeper.types import CacheOutcome, IdSource, SessionKey, SnapshotKind
from slotkeeper.web.security import Guard, Keys, caller
from tests.unit.test_pool import FP, FakeClient

# -- what a domain is made of, and who sees it -------------------------------------------------------------------


def test_a_domain_is_the_key_then_the_user_then_the_salt() -> None:
    assert key_domain(None, None) == "" and key_domain("team", None) == "team"
    assert key_domain("owui", "42") == "owui/user=42" and key_domain(None, "42") == "user=42"
    salted_once = salted("owui/user=42", {"cache_salt": "s3cret"})
    assert salted_once.startswith("owui/user=42/salt=") and "s3cret" not in salted_once
    assert salted_once == salted("owui/user=42", {"cache_salt": "s3cret"})
    assert salted_once != salted("owui/user=42", {"cache_salt": "other"})
    assert salted("", {"cache_salt": "x"}).startswith("salt=") and salted("team", {}) == "team"


@pytest.mark.parametrize("salt", ["", " ", "a b", "x" * 129, 7, None, ["a"], {"a": 1}, "é", "a\nb"])
def test_a_salt_that_cannot_be_one_is_a_bad_request(salt: Any) -> None:
    with pytest.raises(BadRequest, match="cache_salt must be"):
        salted("team", {"cache_salt": salt})


@pytest.mark.parametrize("user", ["", "a b", "a/b", "x" * 129, "é"])
def test_a_forwarded_user_that_cannot_name_a_domain_is_a_bad_request(user: str) -> None:
    with pytest.raises(BadRequest, match="X-User"):
        checked_user(user, "X-User")


def test_a_caller_sees_its_domain_and_those_below_it() -> None:
    owui, alice = Caller("owui"), Caller("owui/user=alice")
    assert sees(owui, "owui") and sees(owui, "owui/user=alice") and sees(owui, "owui/salt=ab")
    assert not sees(owui, "owuix") and not sees(owui, "") and not sees(owui, "team")
    assert sees(alice, "owui/user=alice") and not sees(alice, "owui/user=bob") and not sees(alice, "owui")
    assert not sees(alice, "owui/user=alicex")
    plain = Caller("")  # the API key without a name: its own users and salts, never a named key's
    assert sees(plain, "") and sees(plain, "user=bob") and sees(plain, "salt=ab") and not sees(plain, "team")
    assert all(sees(Caller(admin=True), d) for d in ("", "team", "owui/user=x"))


@pytest.mark.parametrize("domain", ["", "team", "owui/user=42", "owui/user=42/salt=0123456789abcdef", "user=7"])
def test_domains_slotkeeper_makes_are_domains(domain: str) -> None:
    assert checked_domain(domain) == domain


@pytest.mark.parametrize("domain", ["/", "team/", "a b", "team/team", "user=", "x=1", "-bad", "team/other=1"])
def test_anything_else_is_not_a_domain(domain: str) -> None:
    with pytest.raises(BadRequest, match="is not a cache domain"):
        checked_domain(domain)


def test_the_same_request_is_another_session_in_another_domain() -> None:
    said = {"opening": {"role": "user", "content": "hi"}, "reply": {"role": "assistant", "content": "hello"}}
    ours = resolve_session("m", {}, {}, [], domain="owui/user=a", **said)
    theirs = resolve_session("m", {}, {}, [], domain="owui/user=b", **said)
    assert ours.session_id == theirs.session_id and ours != theirs
    assert ours.file_stem(FP) != theirs.file_stem(FP)
    assert resolve_session("m", {}, {}, [], **said).domain == ""


def test_a_blocks_prefix_is_taken_under_its_domain() -> None:
    assert block_scope(FP, "") == FP and block_scope(FP, "a") != block_scope(FP, "b")


# -- the guard names the caller ----------------------------------------------------------------------------------


async def _call(guard: Guard, path: str, headers: dict[str, str]) -> tuple[int, Caller | None]:
    seen: list[Caller] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(caller(scope))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    status: list[int] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    scope = {"type": "http", "path": path, "method": "GET", "headers": [
        (k.lower().encode(), v.encode()) for k, v in {"host": "127.0.0.1", **headers}.items()]}
    wrapped = Guard(app, bind_host="127.0.0.1", keys=guard.keys)
    await wrapped(scope, receive, send)
    return status[0], seen[0] if seen else None


KEYS = Keys(api_key="plain", admin_key="admin", named=(("owui", "k-owui"), ("team", "k-team")),
            user_header="X-OpenWebUI-User-Id")
GUARD = Guard(None, bind_host="127.0.0.1", keys=KEYS)  # type: ignore[arg-type]


async def test_the_guard_names_the_domain_of_the_key_and_the_forwarded_user() -> None:
    bearer = {"authorization": "Bearer k-owui"}
    assert await _call(GUARD, "/v1/models", bearer) == (200, Caller("owui"))
    assert await _call(GUARD, "/v1/models", {**bearer, "x-openwebui-user-id": "42"}) == (200, Caller("owui/user=42"))
    assert await _call(GUARD, "/v1/models", {"x-api-key": "plain"}) == (200, Caller(""))
    assert await _call(GUARD, "/api/sessions", {"x-api-key": "admin"}) == (200, Caller(admin=True))
    assert await _call(GUARD, "/api/sessions", {"x-api-key": "k-team"}) == (200, Caller("team"))


async def test_the_guard_refuses_a_forged_user_and_gives_operator_views_to_the_admin_only() -> None:
    assert (await _call(GUARD, "/v1/models", {"x-openwebui-user-id": "42"}))[0] == 401  # a header without a key
    assert (await _call(GUARD, "/v1/models", {"x-api-key": "k-owui", "x-openwebui-user-id": "a b"}))[0] == 400
    for path in ("/metrics", "/api/backend", "/api/sessions/current", "/api/sessions/disk", "/api/sessions/clear"):
        assert (await _call(GUARD, path, {"x-api-key": "k-owui"}))[0] == 401
        assert (await _call(GUARD, path, {"x-api-key": "admin"}))[0] == 200
    # Without domains nothing changes: no key, everyone manages everything.
    assert await _call(Guard(None, bind_host="127.0.0.1"), "/metrics", {}) == (200, Caller(admin=True))  # type: ignore[arg-type]


# -- the index keeps one name per domain ---------------------------------------------------------------------------


def test_an_index_from_before_domains_keeps_its_rows_in_the_one_domain(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE snapshots (model TEXT NOT NULL, session_id TEXT NOT NULL, kind TEXT NOT NULL DEFAULT 'session',
            filename TEXT NOT NULL UNIQUE, fingerprint TEXT NOT NULL, n_tokens INTEGER NOT NULL,
            n_bytes INTEGER NOT NULL, checksum TEXT NOT NULL, created REAL NOT NULL, last_used REAL NOT NULL,
            hits INTEGER NOT NULL DEFAULT 0, pinned INTEGER NOT NULL DEFAULT 0, n_prompt INTEGER NOT NULL DEFAULT 0,
            n_blocks INTEGER NOT NULL DEFAULT -1, fence INTEGER NOT NULL DEFAULT 0, stamp INTEGER NOT NULL DEFAULT 0,
            tail_bytes INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (model, session_id, kind));
        INSERT INTO snapshots (model, session_id, filename, fingerprint, n_tokens, n_bytes, checksum, created,
            last_used) VALUES ('m', 'chat-1', 'a.bin', 'fp', 10, 100, 'c', 1, 1);
    """)
    db.commit()
    db.close()
    index = SnapshotIndex(path)
    try:
        old = index.get(SessionKey("m", "chat-1"))
        assert old is not None and old.domain == "" and old.filename == "a.bin"
        theirs = SessionKey("m", "chat-1", IdSource.MESSAGES, "owui/user=b")
        assert index.get(theirs) is None
        index.replace(theirs, SnapshotKind.SESSION, "b.bin", "fp", 20, 200, "d", message_chain([{"role": "user"}]))
        assert index.get(SessionKey("m", "chat-1")).filename == "a.bin"  # type: ignore[union-attr]
        assert index.get(theirs).filename == "b.bin"  # type: ignore[union-attr]
        digest = message_chain([{"role": "user"}])[0].digest
        assert [s.filename for s in index.prefix_candidates(digest, "m", "fp", "owui/user=b")] == ["b.bin"]
        assert index.prefix_candidates(digest, "m", "fp", "") == []
    finally:
        index.close()


# -- the pool erases a slot that holds another domain's tokens ----------------------------------------------------


def _pool(client: FakeClient, store: SnapshotStore, domains: bool) -> SlotPool:
    return SlotPool(1, client, Snapshots(store), FP, 4096, save_idle_seconds=-1,  # type: ignore[arg-type]
                    domains=domains)


async def test_a_slot_is_erased_before_another_domains_request_and_only_then(store: SnapshotStore,
                                                                            slot_dir: Path) -> None:
    client = FakeClient(slot_dir)
    pool = _pool(client, store, domains=True)
    chain = message_chain([{"role": "user", "content": "same words"}])
    alice, bob = (SessionKey("m", "chat", IdSource.MESSAGES, d) for d in ("o/user=a", "o/user=b"))
    lease = await pool.acquire(alice, chain)  # at start the slot's content is of no known domain
    assert [c[1] for c in client.calls] == ["erase"]
    lease.release(TurnEnd.COMPLETED, 10)
    client.calls.clear()
    lease = await pool.acquire(alice, chain)
    assert client.calls == [] and lease.cache.outcome is CacheOutcome.HOT
    lease.release(TurnEnd.COMPLETED, 12)
    client.slot_tokens[0] = list(range(12))
    lease = await pool.acquire(bob, chain)  # the same messages, under the same name, of another user
    assert [c[1] for c in client.calls] == ["save", "erase"]  # alice's state is kept, then the slot emptied
    assert lease.cache.outcome is CacheOutcome.COLD and pool.slots[0].domain == "o/user=b"
    lease.release(TurnEnd.COMPLETED, 12)


async def test_a_failed_erase_fails_the_turn_rather_than_run_over_another_domains_tokens(
        store: SnapshotStore, slot_dir: Path) -> None:
    class Refusing(FakeClient):
        async def slot_action(self, slot_id: int, action: str, filename: str | None = None) -> Any:
            if action == "erase":
                raise UpstreamError(500, b'{"error": "no"}')
            return await super().slot_action(slot_id, action, filename)

    pool = _pool(Refusing(slot_dir), store, domains=True)
    with pytest.raises(UpstreamError):
        await pool.acquire(SessionKey("m", "chat", IdSource.HEADER, "a"))
    assert not pool.slots[0].busy and pool.slots[0].domain is None


async def test_without_domains_nothing_is_erased(store: SnapshotStore, slot_dir: Path) -> None:
    client = FakeClient(slot_dir)
    pool = _pool(client, store, domains=False)
    for name in ("a", "b", "a"):
        lease = await pool.acquire(SessionKey("m", name, IdSource.HEADER))
        lease.release(TurnEnd.COMPLETED, 10)
    assert client.actions("erase") == []


# -- the settings refuse what would leak ----------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "message"), [
    ({"user_header": "X-OpenWebUI-User-Id"}, "needs an API key"),
    ({"api_keys": {"bad name": "k"}}, "cannot name a cache domain"),
    ({"api_keys": {"a": "k", "b": "k"}}, "each name and each key"),
    ({"api_keys": {"a": "k"}, "api_key": "k"}, "nor be the api_key"),
    ({"api_keys": {"a": "k"}, "model": "/m.gguf", "cache_ram_mib": 512}, "prompt cache in RAM"),
    ({"api_keys": {"a": "k"}, "launch_command": ["llama-server", "-m", "/m.gguf"]}, "add --cache-ram 0"),
    ({"api_keys": {"a": "k"}, "upstream": "http://h:1", "slot_dir": "/s", "shared_store": "s3://b/p"},
     "not carried to the shared store"),
])
def test_settings_that_would_leak_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.build({}, {}, values)


def test_domains_start_the_embedded_server_without_its_ram_cache(tmp_path: Path) -> None:
    from slotkeeper.upstream.launcher import embedded_argv
    settings = Settings.build({}, {}, {"api_keys": {"a": "k"}, "model": "/m.gguf"})
    argv = embedded_argv(settings, Path("/m.gguf"), 1, tmp_path)
    assert argv[argv.index("--cache-ram") + 1] == "0"
    launch = Settings.build({}, {}, {"api_keys": {"a": "k"},
                                     "launch_command": ["llama-server", "-m", "/m.gguf", "--cache-ram", "0"]})
    assert launch.domains


def test_the_session_commands_name_a_domain_for_the_admin() -> None:
    from slotkeeper.cli.commandline import _parser
    from slotkeeper.cli.manage import _model_param
    parser = _parser()
    for argv in (["sessions", "show", "chat"], ["sessions", "rm", "chat"], ["sessions", "pin", "chat"],
                 ["sessions", "explain", "chat"], ["sessions", "export", "chat"], ["export", "chat"]):
        args = parser.parse_args([*argv, "--domain", "openwebui/user=42"])
        assert _model_param(args) == {"domain": "openwebui/user=42"}
        assert _model_param(parser.parse_args(argv)) is None
    assert _model_param(parser.parse_args(["import", "b.tar", "--domain", "team"])) == {"domain": "team"}


async def test_a_key_of_any_characters_is_refused_not_a_server_error() -> None:
    assert (await _call(GUARD, "/v1/models", {"x-api-key": "k-\u00e9"}))[0] == 401
    assert (await _call(Guard(None, bind_host="127.0.0.1", keys=Keys(api_key="k")), "/v1/models",  # type: ignore[arg-type]
                        {"x-api-key": "\u00e9"}))[0] == 401


def test_a_model_on_several_backends_places_two_domains_sessions_of_one_name_apart() -> None:
    ours, theirs = (SessionKey("m", "chat", IdSource.MESSAGES, d) for d in ("a", "b"))
    assert ours.scoped_id != theirs.scoped_id and SessionKey("m", "chat").scoped_id == "chat"
