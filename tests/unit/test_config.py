"""Table-driven tests for Settings.build: CLI > SLOTKEEPER_* environment > defaults, conversion and validation."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.config import BackendSpec, Settings

ATTACH = {"upstream": "http://127.0.0.1:8080", "slot_dir": "/srv/slots"}
SECRET = {"SLOTKEEPER_REPLICA_SECRET": "s" * 16}  # what --directory needs


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A known HOME and XDG_CACHE_HOME, and no stray SLOTKEEPER_* variables from the real environment."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for name in list(os.environ):
        if name.startswith("SLOTKEEPER_"):
            monkeypatch.delenv(name)
    return tmp_path / "home"


# ---------------------------------------------------------------------------------------------------------------------
# Precedence


PRECEDENCE_ROWS: list[tuple[str, Any, dict[str, str], Any]] = [
    ("port", 9000, {"SLOTKEEPER_PORT": "9001"}, 9000),
    ("port", None, {"SLOTKEEPER_PORT": "9001"}, 9001),
    ("port", None, {}, 11434),
    ("port", None, {"SLOTKEEPER_PORT": ""}, 11434),
    ("host", "0.0.0.0", {"SLOTKEEPER_HOST": "10.0.0.1"}, "0.0.0.0"),
    ("host", None, {"SLOTKEEPER_HOST": "10.0.0.1"}, "10.0.0.1"),
    ("host", None, {}, "127.0.0.1"),
    ("api_key", "k1", {"SLOTKEEPER_API_KEY": "k2"}, "k1"),
    ("api_key", None, {"SLOTKEEPER_API_KEY": "k2"}, "k2"),
    ("api_key", None, {}, None),
    ("admin_key", "a1", {"SLOTKEEPER_ADMIN_KEY": "a2"}, "a1"),
    ("admin_key", None, {"SLOTKEEPER_ADMIN_KEY": "a2"}, "a2"),
    ("admin_key", None, {}, None),
    ("allowed_hosts", ("box.lan",), {"SLOTKEEPER_ALLOWED_HOSTS": "a.lan,b.lan"}, ("box.lan",)),
    ("allowed_hosts", None, {"SLOTKEEPER_ALLOWED_HOSTS": "a.lan, b.lan"}, ("a.lan", "b.lan")),
    ("allowed_hosts", None, {}, ()),
    ("api_keys", None, {"SLOTKEEPER_API_KEYS": "alice=ka, bob=kb"}, (("alice", "ka"), ("bob", "kb"))),
    ("api_keys", None, {}, ()),
    ("user_header", "X-OpenWebUI-User-Id", {"SLOTKEEPER_USER_HEADER": "X-User", "SLOTKEEPER_API_KEY": "k"},
     "X-OpenWebUI-User-Id"),
    ("user_header", None, {"SLOTKEEPER_USER_HEADER": "X-User", "SLOTKEEPER_API_KEY": "k"}, "X-User"),
    ("user_header", None, {}, None),
    ("max_body_bytes", 1000, {"SLOTKEEPER_MAX_BODY_BYTES": "2000"}, 1000),
    ("max_body_bytes", None, {"SLOTKEEPER_MAX_BODY_BYTES": "2000"}, 2000),
    ("max_body_bytes", None, {}, 32 * 1024 * 1024),
    ("min_restore_tokens", 10, {"SLOTKEEPER_MIN_RESTORE_TOKENS": "20"}, 10),
    ("min_restore_tokens", None, {"SLOTKEEPER_MIN_RESTORE_TOKENS": "20"}, 20),
    ("min_restore_tokens", None, {}, None),  # measured (cache/costs.py)
    ("block_tokens", 64, {"SLOTKEEPER_BLOCK_TOKENS": "256"}, 64),
    ("block_tokens", None, {"SLOTKEEPER_BLOCK_TOKENS": "256"}, 256),
    ("block_tokens", None, {}, 64),
    ("max_queue", 5, {"SLOTKEEPER_MAX_QUEUE": "6"}, 5),
    ("max_queue", None, {"SLOTKEEPER_MAX_QUEUE": "6"}, 6),
    ("max_queue", None, {}, 64),
    ("ctx_size", 4096, {"SLOTKEEPER_CTX_SIZE": "2048"}, 4096),
    ("ctx_size", None, {"SLOTKEEPER_CTX_SIZE": "2048"}, 2048),
    ("ctx_size", None, {}, 8192),
    ("parallel", 4, {"SLOTKEEPER_PARALLEL": "2"}, 4),
    ("parallel", None, {"SLOTKEEPER_PARALLEL": "2"}, 2),
    ("parallel", None, {}, 1),
    ("cache_ram_mib", 0, {"SLOTKEEPER_CACHE_RAM_MIB": "512"}, 0),
    ("cache_ram_mib", None, {"SLOTKEEPER_CACHE_RAM_MIB": "512"}, 512),
    ("cache_ram_mib", None, {}, None),
    ("model_alias", "cli-name", {"SLOTKEEPER_MODEL_ALIAS": "env-name"}, "cli-name"),
    ("model_alias", None, {"SLOTKEEPER_MODEL_ALIAS": "env-name"}, "env-name"),
    ("save_idle_seconds", 5.0, {"SLOTKEEPER_SAVE_IDLE_SECONDS": "7.5"}, 5.0),
    ("save_idle_seconds", None, {"SLOTKEEPER_SAVE_IDLE_SECONDS": "7.5"}, 7.5),
    ("save_idle_seconds", None, {"SLOTKEEPER_SAVE_IDLE_SECONDS": "-1"}, -1.0),
    ("save_idle_seconds", None, {}, 2.0),
    ("slot_op_timeout", None, {"SLOTKEEPER_SLOT_OP_TIMEOUT": "30"}, 30.0),
    ("upstream_read_timeout", None, {"SLOTKEEPER_UPSTREAM_READ_TIMEOUT": "60"}, 60.0),
    ("backend_wait_seconds", 5.0, {"SLOTKEEPER_BACKEND_WAIT_SECONDS": "7"}, 5.0),
    ("backend_wait_seconds", None, {"SLOTKEEPER_BACKEND_WAIT_SECONDS": "0"}, 0.0),
    ("backend_wait_seconds", None, {}, 30.0),
    ("side_task_hold_seconds", 0.5, {"SLOTKEEPER_SIDE_TASK_HOLD_SECONDS": "1"}, 0.5),
    ("side_task_hold_seconds", None, {"SLOTKEEPER_SIDE_TASK_HOLD_SECONDS": "0"}, 0.0),
    ("side_task_hold_seconds", None, {}, 0.25),
    ("max_loaded", 2, {"SLOTKEEPER_MAX_LOADED": "3"}, 2),
    ("max_loaded", None, {"SLOTKEEPER_MAX_LOADED": "3"}, 3),
    ("max_loaded", None, {}, 0),
    ("swap_wait_seconds", 10.0, {"SLOTKEEPER_SWAP_WAIT_SECONDS": "20"}, 10.0),
    ("swap_wait_seconds", None, {"SLOTKEEPER_SWAP_WAIT_SECONDS": "20"}, 20.0),
    ("swap_wait_seconds", None, {}, 300.0),
    ("keep_alive", "5m", {"SLOTKEEPER_KEEP_ALIVE": "1h"}, 300.0),
    ("keep_alive", None, {"SLOTKEEPER_KEEP_ALIVE": "1h"}, 3600.0),
    ("keep_alive", None, {"SLOTKEEPER_KEEP_ALIVE": "-1"}, -1.0),
    ("keep_alive", None, {}, -1.0),
    ("load_factor", 1.5, {"SLOTKEEPER_LOAD_FACTOR": "2"}, 1.5),
    ("load_factor", None, {"SLOTKEEPER_LOAD_FACTOR": "2"}, 2.0),
    ("load_factor", None, {}, 1.25),
    ("shared_store", "s3://a/p", {"SLOTKEEPER_SHARED_STORE": "s3://b"}, "s3://a/p"),
    ("shared_store", None, {"SLOTKEEPER_SHARED_STORE": "s3://b"}, "s3://b"),
    ("shared_store", None, {}, None),
    ("shared_endpoint", "http://s3:9000/", {"SLOTKEEPER_SHARED_ENDPOINT": "http://x"}, "http://s3:9000"),
    ("shared_endpoint", None, {}, None),
    ("shared_budget", "2T", {"SLOTKEEPER_SHARED_BUDGET": "1G"}, 2 * 1024**4),
    ("shared_budget", None, {"SLOTKEEPER_SHARED_BUDGET": "1G"}, 1024**3),
    ("shared_budget", None, {}, 0),
    ("directory", "redis://r:6379/0", {"SLOTKEEPER_DIRECTORY": "redis://x", **SECRET}, "redis://r:6379/0"),
    ("directory", None, {"SLOTKEEPER_DIRECTORY": "redis://x:1/2", **SECRET}, "redis://x:1/2"),
    ("directory", None, {}, None),
    ("replica_secret", "c" * 16, {"SLOTKEEPER_REPLICA_SECRET": "e" * 16}, "c" * 16),
    ("replica_secret", None, {"SLOTKEEPER_REPLICA_SECRET": "e" * 16}, "e" * 16),
    ("replica_secret", None, {}, None),
    ("replicas", ["http://a:1/", "http://b:2,http://c:3"], {"SLOTKEEPER_REPLICAS": "http://e:1"},
     ("http://a:1", "http://b:2", "http://c:3")),
    ("replicas", None, {"SLOTKEEPER_REPLICAS": "http://e:1, http://10.0.0.*:11434"},
     ("http://e:1", "http://10.0.0.*:11434")),
    ("replicas", None, {}, ()),
    ("replica_url", "http://a:11434/", {"SLOTKEEPER_REPLICA_URL": "http://b:1"}, "http://a:11434"),
    ("replica_url", None, {"SLOTKEEPER_REPLICA_URL": "http://b:1"}, "http://b:1"),
    ("replica_url", None, {}, None),
    ("log_level", "debug", {"SLOTKEEPER_LOG_LEVEL": "error"}, "debug"),
    ("log_level", None, {"SLOTKEEPER_LOG_LEVEL": "error"}, "error"),
    ("log_level", None, {}, "info"),
    ("log_json", True, {"SLOTKEEPER_LOG_JSON": "false"}, True),
    ("log_json", None, {"SLOTKEEPER_LOG_JSON": "1"}, True),
    ("log_json", None, {"SLOTKEEPER_LOG_JSON": "no"}, False),
    ("log_json", None, {}, False),
    ("system_snapshots", False, {"SLOTKEEPER_SYSTEM_SNAPSHOTS": "true"}, False),
    ("system_snapshots", None, {"SLOTKEEPER_SYSTEM_SNAPSHOTS": "off"}, False),
    ("system_snapshots", None, {}, True),
    ("keep_attribution_block", True, {"SLOTKEEPER_KEEP_ATTRIBUTION_BLOCK": "false"}, True),
    ("keep_attribution_block", None, {"SLOTKEEPER_KEEP_ATTRIBUTION_BLOCK": "1"}, True),
    ("keep_attribution_block", None, {}, False),
    ("disk_budget", "2G", {"SLOTKEEPER_DISK_BUDGET": "1G"}, 2 * 1024**3),
    ("disk_budget", None, {"SLOTKEEPER_DISK_BUDGET": "500MiB"}, 500 * 1024**2),
    ("disk_budget", None, {}, 0),
    ("ram_budget", "2G", {"SLOTKEEPER_RAM_BUDGET": "1G"}, 2 * 1024**3),
    ("ram_budget", None, {"SLOTKEEPER_RAM_BUDGET": "0"}, 0),
    ("ram_budget", None, {}, None),
    ("ram_dir", "/dev/shm/a", {"SLOTKEEPER_RAM_DIR": "/dev/shm/b"}, Path("/dev/shm/a")),
    ("ram_dir", None, {}, None),
    ("max_snapshot_age", "7d", {"SLOTKEEPER_MAX_SNAPSHOT_AGE": "1h"}, 7 * 86400.0),
    ("max_snapshot_age", None, {"SLOTKEEPER_MAX_SNAPSHOT_AGE": "90"}, 90.0),
    ("max_snapshot_age", None, {}, 0.0),
    ("max_system_snapshots", 1, {"SLOTKEEPER_MAX_SYSTEM_SNAPSHOTS": "3"}, 1),
    ("max_system_snapshots", None, {"SLOTKEEPER_MAX_SYSTEM_SNAPSHOTS": "3"}, 3),
    ("max_system_snapshots", None, {}, 0),
    ("session_headers", ["X-Cli"], {"SLOTKEEPER_SESSION_HEADERS": "X-Env"}, ("X-Cli",)),
    ("session_headers", None, {"SLOTKEEPER_SESSION_HEADERS": "X-Env"}, ("X-Env",)),
    ("session_headers", (), {"SLOTKEEPER_SESSION_HEADERS": "X-Env"}, ("X-Env",)),
    ("session_headers", None, {}, ()),
    ("model", "/cli/m.gguf", {"SLOTKEEPER_MODEL": "/env/m.gguf"}, Path("/cli/m.gguf")),
    ("model", None, {"SLOTKEEPER_MODEL": "/env/m.gguf"}, Path("/env/m.gguf")),
    ("model", None, {}, None),
    ("cache_dir", "/cli/cache", {"SLOTKEEPER_CACHE_DIR": "/env/cache"}, Path("/cli/cache")),
    ("cache_dir", None, {"SLOTKEEPER_CACHE_DIR": "/env/cache"}, Path("/env/cache")),
    ("launch_command", ["/cli/llama-server", "-m", "a.gguf"],
     {"SLOTKEEPER_LAUNCH_COMMAND": "/env/llama-server -m b.gguf"}, ("/cli/llama-server", "-m", "a.gguf")),
    ("launch_command", None, {"SLOTKEEPER_LAUNCH_COMMAND": "/env/llama-server -m 'my model.gguf' -np 2"},
     ("/env/llama-server", "-m", "my model.gguf", "-np", "2")),
    ("launch_command", (), {"SLOTKEEPER_LAUNCH_COMMAND": "/env/llama-server"}, ("/env/llama-server",)),
    ("launch_command", None, {}, ()),
    ("start_timeout", 30, {"SLOTKEEPER_START_TIMEOUT": "60"}, 30.0),
    ("start_timeout", None, {"SLOTKEEPER_START_TIMEOUT": "60"}, 60.0),
    ("start_timeout", None, {}, 600.0),
    ("shutdown_timeout", 12, {"SLOTKEEPER_SHUTDOWN_TIMEOUT": "90"}, 12.0),
    ("shutdown_timeout", None, {"SLOTKEEPER_SHUTDOWN_TIMEOUT": "90"}, 90.0),
    ("shutdown_timeout", None, {}, 30.0),
    ("backends", [{"name": "cli", "upstream": "http://127.0.0.1:1/", "slot_dir": "/cli/slots"}],
     {"SLOTKEEPER_BACKENDS": '[{"name": "env"}]'},
     (BackendSpec("cli", "http://127.0.0.1:1", Path("/cli/slots")),)),
    ("backends", None, {"SLOTKEEPER_BACKENDS": '[{"name": "env", "model": "/m/a.gguf", "parallel": 2}]'},
     (BackendSpec("env", model=Path("/m/a.gguf"), parallel=2),)),
    ("backends", None, {}, ()),
]


def _row_id(row: tuple[str, Any, dict[str, str], Any]) -> str:
    name, cli, env, expected = row
    if cli is not None and cli != ():
        source = "cli-over-env" if env else "cli"
    elif any(env.values()):
        source = "env-over-empty-cli" if cli == () else "env"
    else:
        source = "default-empty-env" if env else "default"
    return f"{name}-{source}-{expected!r}"


@pytest.mark.parametrize(("name", "cli", "env", "expected"), PRECEDENCE_ROWS,
                         ids=[_row_id(r) for r in PRECEDENCE_ROWS])
def test_cli_beats_env_beats_default(name: str, cli: Any, env: dict[str, str], expected: Any) -> None:
    settings = Settings.build({name: cli}, env)
    assert getattr(settings, name) == expected


def test_every_setting_has_a_precedence_row() -> None:
    # upstream and slot_dir must be given together, so they have their own table below.
    names = {f.name for f in dataclasses.fields(Settings)}
    assert names - {row[0] for row in PRECEDENCE_ROWS} == {"upstream", "slot_dir"}


@pytest.mark.parametrize(
    ("cli", "env", "expected_upstream", "expected_slot_dir"),
    [
        (ATTACH, {}, "http://127.0.0.1:8080", Path("/srv/slots")),
        ({}, {"SLOTKEEPER_UPSTREAM": "http://env:1", "SLOTKEEPER_SLOT_DIR": "/env/slots"}, "http://env:1",
         Path("/env/slots")),
        ({"upstream": "http://cli:2"}, {"SLOTKEEPER_UPSTREAM": "http://env:1", "SLOTKEEPER_SLOT_DIR": "/env/slots"},
         "http://cli:2", Path("/env/slots")),
        ({"slot_dir": "/cli/slots"}, {"SLOTKEEPER_UPSTREAM": "http://env:1", "SLOTKEEPER_SLOT_DIR": "/env/slots"},
         "http://env:1", Path("/cli/slots")),
        ({"upstream": "http://x:1/", "slot_dir": "/s"}, {}, "http://x:1", Path("/s")),
        ({"upstream": "http://x:1///", "slot_dir": "/s"}, {}, "http://x:1", Path("/s")),
    ],
    ids=["cli-both", "env-both", "cli-upstream-env-slot-dir", "env-upstream-cli-slot-dir", "trailing-slash",
         "many-trailing-slashes"],
)
def test_attach_mode_sources(
    cli: dict[str, Any], env: dict[str, str], expected_upstream: str, expected_slot_dir: Path
) -> None:
    settings = Settings.build(cli, env)
    assert settings.upstream == expected_upstream
    assert settings.slot_dir == expected_slot_dir
    assert not settings.embedded


@pytest.mark.parametrize("url", ["localhost:8080", "ftp://host:21", "http://", "127.0.0.1"])
def test_an_upstream_that_is_not_an_http_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="the backend URL must look like http://HOST:PORT"):
        Settings.build({"upstream": url, "slot_dir": "/tmp"}, {})


def test_an_upstream_with_a_path_is_taken() -> None:
    settings = Settings.build({"upstream": "http://127.0.0.1:8080/upstream/qwen", "slot_dir": "/tmp"}, {})
    assert settings.upstream == "http://127.0.0.1:8080/upstream/qwen"


def test_defaults_with_nothing_given(_isolated_home: Path) -> None:
    settings = Settings.build({}, {})
    assert settings == Settings(cache_dir=_isolated_home / ".cache" / "slotkeeper")
    assert settings.embedded
    assert settings.upstream is None
    assert settings.slot_dir is None


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTKEEPER_PORT", "12345")
    assert Settings.build({}).port == 12345
    assert Settings.build({}, {}).port == 11434


def test_unrelated_env_and_cli_keys_are_ignored() -> None:
    settings = Settings.build({"command": "serve", "port": None}, {"PORT": "1", "SLOTKEEPER_BOGUS": "x"})
    assert settings.port == 11434


# ---------------------------------------------------------------------------------------------------------------------
# Conversion


@pytest.mark.parametrize(
    ("cli", "env", "name", "expected"),
    [
        ({}, {"SLOTKEEPER_PORT": "8080"}, "port", 8080),
        ({}, {"SLOTKEEPER_PORT": " 8080 "}, "port", 8080),
        ({"port": "8080"}, {}, "port", 8080),
        ({}, {"SLOTKEEPER_CTX_SIZE": "16384"}, "ctx_size", 16384),
        ({}, {"SLOTKEEPER_SAVE_IDLE_SECONDS": "0.25"}, "save_idle_seconds", 0.25),
        ({}, {"SLOTKEEPER_SESSION_HEADERS": "X-A,X-B"}, "session_headers", ("X-A", "X-B")),
        ({}, {"SLOTKEEPER_SESSION_HEADERS": " X-A , X-B ,, "}, "session_headers", ("X-A", "X-B")),
        ({}, {"SLOTKEEPER_SESSION_HEADERS": "X-Only"}, "session_headers", ("X-Only",)),
        ({}, {"SLOTKEEPER_SESSION_HEADERS": " , ,"}, "session_headers", ()),
        ({"session_headers": ["X-A", "X-B"]}, {}, "session_headers", ("X-A", "X-B")),
        ({"session_headers": ("X-A",)}, {}, "session_headers", ("X-A",)),
        ({"model": Path("/m.gguf")}, {}, "model", Path("/m.gguf")),
        ({"cache_dir": "relative/dir"}, {}, "cache_dir", Path("relative/dir")),
    ],
    ids=["env-port", "env-port-padded", "cli-port-string", "env-ctx", "env-float", "env-headers",
         "env-headers-messy", "env-header-single", "env-headers-only-commas", "cli-headers-list",
         "cli-headers-tuple", "cli-path-object", "relative-path"],
)
def test_type_conversion(cli: dict[str, Any], env: dict[str, str], name: str, expected: Any) -> None:
    value = getattr(Settings.build(cli, env), name)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("cli", "env", "name", "relative"),
    [
        ({"cache_dir": "~/cache"}, {}, "cache_dir", "cache"),
        ({}, {"SLOTKEEPER_CACHE_DIR": "~/envcache"}, "cache_dir", "envcache"),
        ({"model": "~/models/x.gguf"}, {}, "model", "models/x.gguf"),
        ({}, {"SLOTKEEPER_MODEL": "~/m.gguf"}, "model", "m.gguf"),
        ({"upstream": "http://h:1", "slot_dir": "~/slots"}, {}, "slot_dir", "slots"),
        ({"upstream": "http://h:1"}, {"SLOTKEEPER_SLOT_DIR": "~/s"}, "slot_dir", "s"),
    ],
    ids=["cli-cache-dir", "env-cache-dir", "cli-model", "env-model", "cli-slot-dir", "env-slot-dir"],
)
def test_paths_are_expanded(
    cli: dict[str, Any], env: dict[str, str], name: str, relative: str, _isolated_home: Path
) -> None:
    value = getattr(Settings.build(cli, env), name)
    assert isinstance(value, Path)
    assert value == _isolated_home / relative
    assert "~" not in str(value)


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    settings = Settings.build({}, {})
    assert settings.cache_dir == tmp_path / "xdg" / "slotkeeper"
    assert settings.index_path == tmp_path / "xdg" / "slotkeeper" / "index.sqlite3"


# ---------------------------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    ("cli", "env", "fragments"),
    [
        ({"upstream": "http://x"}, {}, ["--upstream", "--slot-dir", "--slot-save-path"]),
        ({}, {"SLOTKEEPER_UPSTREAM": "http://x"}, ["--slot-dir"]),
        ({**ATTACH, "model": "/m.gguf"}, {}, ["--upstream", "--model"]),
        ({}, {"SLOTKEEPER_UPSTREAM": "http://x", "SLOTKEEPER_SLOT_DIR": "/s", "SLOTKEEPER_MODEL": "/m"},
         ["--upstream", "--model"]),
        ({"port": 0}, {}, ["port", "0", "out of range"]),
        ({"port": -1}, {}, ["port", "-1"]),
        ({"port": 65536}, {}, ["port", "65536"]),
        ({"port": 100000}, {}, ["port", "100000"]),
        ({}, {"SLOTKEEPER_PORT": "70000"}, ["port", "70000"]),
        ({}, {"SLOTKEEPER_PORT": "abc"}, ["port", "abc"]),
        ({}, {"SLOTKEEPER_PORT": "80.5"}, ["port", "80.5"]),
        ({"port": "http"}, {}, ["port", "http"]),
        ({"parallel": 0}, {}, ["--parallel", "at least 1"]),
        ({"parallel": -3}, {}, ["--parallel", "at least 1"]),
        ({}, {"SLOTKEEPER_PARALLEL": "0"}, ["--parallel"]),
        ({}, {"SLOTKEEPER_PARALLEL": "many"}, ["parallel", "many"]),
        ({}, {"SLOTKEEPER_CTX_SIZE": "big"}, ["ctx_size", "big"]),
        ({}, {"SLOTKEEPER_SAVE_IDLE_SECONDS": "soon"}, ["save_idle_seconds", "soon"]),
        ({**ATTACH, "launch_command": ["llama-server"]}, {}, ["--upstream", "launch mode", "not both"]),
        ({"model": "/m.gguf", "launch_command": ["llama-server"]}, {}, ["--model", "-m PATH.gguf"]),
        ({}, {"SLOTKEEPER_LAUNCH_COMMAND": "llama-server --port"}, ["--port", "needs a value"]),
        ({}, {"SLOTKEEPER_LAUNCH_COMMAND": "llama-server --port x"}, ["--port", "whole number", "'x'"]),
        ({}, {"SLOTKEEPER_LAUNCH_COMMAND": "-m x.gguf"}, ["program", "'-m'"]),
        ({}, {"SLOTKEEPER_LAUNCH_COMMAND": "llama-server --no-slots"}, ["--no-slots"]),
        ({"slot_dir": "/a", "launch_command": ["llama-server", "--slot-save-path", "/b"]}, {},
         ["--slot-dir /a", "--slot-save-path /b", "differ"]),
        ({"shutdown_timeout": 0}, {}, ["--shutdown-timeout", "more than 0"]),
        ({}, {"SLOTKEEPER_START_TIMEOUT": "-1"}, ["--start-timeout"]),
    ],
    ids=["upstream-without-slot-dir", "env-upstream-without-slot-dir", "upstream-and-model",
         "env-upstream-and-model", "port-zero", "port-negative", "port-65536", "port-huge", "env-port-huge",
         "env-port-not-int", "env-port-float", "cli-port-not-int", "parallel-zero", "parallel-negative",
         "env-parallel-zero", "env-parallel-not-int", "env-ctx-not-int", "env-float-not-float",
         "launch-and-upstream", "launch-and-model", "launch-port-without-value", "launch-port-not-int",
         "launch-without-program", "launch-no-slots", "launch-slot-dir-conflict", "shutdown-timeout-zero",
         "start-timeout-negative"],
)
def test_validation_errors(cli: dict[str, Any], env: dict[str, str], fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        Settings.build(cli, env)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    "cli",
    [{"port": 1}, {"port": 65535}, {"parallel": 1}, {"parallel": 64}, ATTACH, {"model": "/m.gguf"}],
    ids=["port-1", "port-65535", "parallel-1", "parallel-64", "attach", "embedded-model"],
)
def test_valid_boundaries(cli: dict[str, Any]) -> None:
    Settings.build(cli, {})


def test_validate_on_direct_construction() -> None:
    with pytest.raises(ValueError, match="--slot-dir"):
        Settings(upstream="http://x").validate()


# ---------------------------------------------------------------------------------------------------------------------
# Derived values and immutability


@pytest.mark.parametrize(
    ("cli", "embedded", "slot_dir"),
    [
        ({"cache_dir": "/c"}, True, Path("/c/slots")),
        ({"cache_dir": "/c", "model": "/m.gguf"}, True, Path("/c/slots")),
        ({"cache_dir": "/c", **ATTACH}, False, Path("/srv/slots")),
        ({"cache_dir": "/c", "slot_dir": "/own"}, True, Path("/own")),
        ({"cache_dir": "/c", "launch_command": ["llama-server", "-m", "m.gguf"]}, False, Path("/c/slots/launch")),
        ({"cache_dir": "/c", "launch_command": ["llama-server", "--slot-save-path", "/srv/s"]}, False,
         Path("/srv/s")),
        ({"cache_dir": "/c", "launch_command": ["llama-server", "--slot-save-path=/srv/s"]}, False, Path("/srv/s")),
        ({"cache_dir": "/c", "slot_dir": "/own", "launch_command": ["llama-server"]}, False, Path("/own")),
        ({"cache_dir": "/c", "slot_dir": "/s", "launch_command": ["llama-server", "--slot-save-path", "/s/"]}, False,
         Path("/s")),
    ],
    ids=["embedded-tiny", "embedded-model", "attach", "embedded-explicit-slot-dir", "launch-default",
         "launch-slot-save-path", "launch-slot-save-path-equals", "launch-slot-dir", "launch-both-the-same"],
)
def test_effective_slot_dir(cli: dict[str, Any], embedded: bool, slot_dir: Path) -> None:
    settings = Settings.build(cli, {})
    assert settings.embedded is embedded
    assert settings.effective_slot_dir() == slot_dir
    assert settings.index_path == Path("/c/index.sqlite3")


@pytest.mark.parametrize(
    ("name", "value"),
    [("port", 1), ("upstream", "http://y"), ("session_headers", ("X",)), ("cache_dir", Path("/x"))],
    ids=["port", "upstream", "session_headers", "cache_dir"],
)
def test_settings_is_frozen(name: str, value: Any) -> None:
    settings = Settings.build({}, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(settings, name, value)


@pytest.mark.parametrize(
    ("cli", "mode"),
    [({}, "embedded"), ({"model": "/m.gguf"}, "embedded"), (ATTACH, "attach"),
     ({"launch_command": ["llama-server", "-m", "m.gguf"]}, "launch")],
    ids=["embedded", "embedded-model", "attach", "launch"],
)
def test_mode(cli: dict[str, Any], mode: str) -> None:
    assert Settings.build(cli, {}).mode == mode


@pytest.mark.parametrize(
    ("total", "responses", "saving", "stopping"),
    [(30.0, 10.0, 15.0, 5.0), (6.0, 2.0, 3.0, 1.0), (120.0, 40.0, 60.0, 20.0)],
    ids=["default", "short", "long"],
)
def test_shutdown_budget_adds_up_to_the_timeout(total: float, responses: float, saving: float,
                                                stopping: float) -> None:
    budget = Settings.build({"shutdown_timeout": total}, {}).shutdown_budget
    assert (budget.responses, budget.saving, budget.stopping) == pytest.approx((responses, saving, stopping))
    assert budget.responses + budget.saving + budget.stopping == pytest.approx(total)


def test_settings_is_hashable_and_comparable() -> None:
    a = Settings.build({"port": 1234, "cache_dir": "/c"}, {})
    b = Settings.build({}, {"SLOTKEEPER_PORT": "1234", "SLOTKEEPER_CACHE_DIR": "/c"})
    assert a == b
    assert hash(a) == hash(b)
