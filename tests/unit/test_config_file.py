"""The TOML config file: CLI > SLOTKEEPER_* environment > file > defaults, its checks, and `serve --print-config`."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.config import Settings, load_config_file, settings_toml


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for name in list(os.environ):
        if name.startswith("SLOTKEEPER_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "slotkeeper.toml"
    path.write_text(text)
    return path


# name, CLI value, environment, file value, expected
PRECEDENCE: list[tuple[str, Any, dict[str, str], Any, Any]] = [
    ("port", 9000, {"SLOTKEEPER_PORT": "9001"}, 9002, 9000),
    ("port", None, {"SLOTKEEPER_PORT": "9001"}, 9002, 9001),
    ("port", None, {}, 9002, 9002),
    ("port", None, {"SLOTKEEPER_PORT": ""}, 9002, 9002),
    ("port", None, {}, None, 11434),
    ("save_idle_seconds", None, {}, 5, 5.0),
    ("save_idle_seconds", None, {"SLOTKEEPER_SAVE_IDLE_SECONDS": "1.5"}, 5, 1.5),
    ("session_headers", None, {}, ["X-Chat", "X-Thread"], ("X-Chat", "X-Thread")),
    ("session_headers", ["X-Cli"], {}, ["X-Chat"], ("X-Cli",)),
    ("session_headers", None, {"SLOTKEEPER_SESSION_HEADERS": "X-Env"}, ["X-Chat"], ("X-Env",)),
    ("cache_dir", None, {}, "/file/cache", Path("/file/cache")),
    ("log_json", None, {}, True, True),
    ("log_json", None, {"SLOTKEEPER_LOG_JSON": "0"}, True, False),
    ("log_level", "debug", {"SLOTKEEPER_LOG_LEVEL": "error"}, "warning", "debug"),
    ("log_level", None, {}, "warning", "warning"),
    ("launch_command", None, {}, ["/opt/llama-server", "-m", "/m/a b.gguf"],
     ("/opt/llama-server", "-m", "/m/a b.gguf")),
    ("launch_command", None, {}, "/opt/llama-server -m '/m/a b.gguf'", ("/opt/llama-server", "-m", "/m/a b.gguf")),
    ("launch_command", None, {"SLOTKEEPER_LAUNCH_COMMAND": "/env/llama-server"}, ["/file/llama-server"],
     ("/env/llama-server",)),
    ("launch_command", ["/cli/llama-server"], {}, ["/file/llama-server"], ("/cli/llama-server",)),
    ("shutdown_timeout", None, {}, 45, 45.0),
    ("start_timeout", None, {}, 12.5, 12.5),
]


@pytest.mark.parametrize(("name", "cli", "env", "file", "expected"), PRECEDENCE,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(PRECEDENCE)])
def test_cli_beats_env_beats_file_beats_default(name: str, cli: Any, env: dict[str, str], file: Any,
                                                expected: Any) -> None:
    settings = Settings.build({name: cli}, env, {} if file is None else {name: file})
    assert getattr(settings, name) == expected
    assert type(getattr(settings, name)) is type(expected)


def test_config_path_from_cli_or_environment(tmp_path: Path) -> None:
    path = write(tmp_path, 'port = 12000\nupstream = "http://127.0.0.1:8080"\nslot-dir = "/srv/slots"\n')
    from_cli = Settings.build({"config": str(path)}, {})
    from_env = Settings.build({}, {"SLOTKEEPER_CONFIG": str(path)})
    assert from_cli == from_env
    assert (from_cli.port, from_cli.upstream, from_cli.slot_dir) == (12000, "http://127.0.0.1:8080", Path("/srv/slots"))
    assert Settings.build({"config": str(path), "port": 13000}, {"SLOTKEEPER_PORT": "14000"}).port == 13000
    assert Settings.build({"config": str(path)}, {"SLOTKEEPER_PORT": "14000"}).port == 14000


def test_a_launch_command_reads_back_from_the_printed_file(tmp_path: Path) -> None:
    settings = Settings.build({"launch_command": ["/opt/llama-server", "-m", "/m/x y.gguf", "--alias", 'a"b'],
                               "shutdown_timeout": 12}, {})
    path = write(tmp_path, settings_toml(settings))
    assert Settings.build({"config": str(path)}, {}) == settings


def test_every_setting_can_come_from_the_file(tmp_path: Path) -> None:
    """The file that --print-config writes reads back to the same settings."""
    settings = Settings.build({"upstream": "http://h:1", "slot_dir": "/s", "session_headers": ["X-A"],
                               "cache_ram_mib": 0, "log_json": True, "model_alias": "m", "ram_budget": "1G",
                               "ram_dir": "/dev/shm/r", "shared_store": "s3://team/slots",
                               "shared_endpoint": "http://127.0.0.1:9000", "directory": "redis://10.0.0.5:6379/0",
                               "replica_url": "http://host-a:11434", "replica_secret": "s" * 16,
                               "replicas": ["http://host-b:11434", "http://gpu-*:11434"],
                               "min_restore_tokens": 100}, {})
    path = write(tmp_path, settings_toml(settings))
    assert "s" * 16 not in path.read_text()  # a secret is never printed: it comes back from the environment
    assert Settings.build({"config": str(path)}, {"SLOTKEEPER_REPLICA_SECRET": "s" * 16}) == settings
    names = set(tomllib.loads(path.read_text()))
    # backends is empty here: it is printed as [[backends]] tables (see the next test)
    assert names == {f.name for f in dataclasses.fields(Settings)} - {"model", "api_key", "admin_key", "backends",
                                                                      "replica_secret", "api_keys", "user_header"}


def test_several_backends_read_back_from_the_printed_file(tmp_path: Path) -> None:
    text = """
port = 11500
[[backends]]
name = "qwen3-8b"
launch_command = ["llama-server", "-m", "/models/qwen3-8b.gguf", "-np", "2"]
[[backends]]
name = "coder"
upstream = "http://127.0.0.1:8081"
slot_dir = "/srv/coder-slots"
[[backends]]
name = "tiny"
parallel = 3
"""
    settings = Settings.build({"config": str(write(tmp_path, text))}, {})
    assert [b.name for b in settings.backends] == ["qwen3-8b", "coder", "tiny"]
    units = settings.backend_settings()
    assert [u.mode for u in units] == ["launch", "attach", "embedded"]
    assert [u.model_alias for u in units] == ["qwen3-8b", "coder", "tiny"]
    assert units[2].parallel == 3 and units[1].parallel == 1
    assert len({u.cache_dir for u in units}) == 3 and all(u.cache_dir.parent == settings.cache_dir / "backends"
                                                          for u in units)
    again = write(tmp_path, settings_toml(settings))
    assert Settings.build({"config": str(again)}, {}) == settings


def test_tables_of_one_name_are_one_model_on_several_backends(tmp_path: Path) -> None:
    tables = "".join(f'[[backends]]\nname = "qwen"\nupstream = "http://127.0.0.1:{8080 + i}"\nslot_dir = "/s{i}"\n'
                     for i in range(3))
    settings = Settings.build({"config": str(write(tmp_path, "load_factor = 1.5\n" + tables))}, {})
    assert settings.load_factor == 1.5
    units = settings.backend_settings()
    assert [u.model_alias for u in units] == ["qwen"] * 3
    assert [u.upstream for u in units] == [f"http://127.0.0.1:{8080 + i}" for i in range(3)]
    names = [u.cache_dir.name for u in units]
    assert names[1] == names[0] + ".2" and names[2] == names[0] + ".3"
    with pytest.raises(ValueError, match="load_factor must be 1 or more"):
        Settings.build({"config": str(write(tmp_path, "load_factor = 0.5\n" + tables))}, {})


@pytest.mark.parametrize(("text", "fragment"), [
    ('upstream = "http://x"\nslot_dir = "/s"\n[[backends]]\nname = "a"', "not at the top level"),
    ('[[backends]]\nname = "a"\n[[backends]]\nname = "a"', "the embedded server runs one per process"),
    ('[[backends]]\nname = "a"\nupstream = "http://x"', "backend 'a': --upstream needs --slot-dir"),
    ('[[backends]]\nname = "a"\nupstream = "http://x"\nslot_dir = "/s"\n'
     '[[backends]]\nname = "b"\nupstream = "http://y"\nslot_dir = "/s"', "share the slot dir"),
    ('[[backends]]\nname = "a"\nport = 1', "unknown key(s) port"),
    ('[[backends]]\nupstream = "http://x"', "needs a name"),
    ('backends = 3', "backends must be list"),
], ids=["top-level-mode", "two-embedded-of-one-model", "attach-without-slot-dir", "shared-slot-dir", "unknown-key",
        "no-name", "not-a-list"])
def test_bad_backend_tables_say_what_is_wrong(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        Settings.build({"config": str(write(tmp_path, text + "\n"))}, {})


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("port = ", ["is not valid TOML"]),
        ("bogus = 1", ["unknown setting 'bogus'", "known:", "port"]),
        ('port = "11500"', ["port must be int", "str"]),
        ("port = 1.5", ["port must be int", "float"]),
        ("port = true", ["port must be int", "bool"]),
        ("log_json = 1", ["log_json must be bool"]),
        ("save_idle_seconds = \"2\"", ["save_idle_seconds must be int or float"]),
        ("port = 70000", ["port 70000 is out of range"]),
        ('upstream = "http://x"', ["--slot-dir"]),
        ("launch_command = 5", ["launch_command must be list or str"]),
        ('launch_command = ["llama-server", "-np", "two"]', ["-np", "whole number", "'two'"]),
        ('launch_command = ["llama-server"]\nupstream = "http://x"\nslot_dir = "/s"', ["launch mode", "--upstream"]),
    ],
    ids=["broken", "unknown-key", "string-port", "float-port", "bool-port", "int-bool", "string-float",
         "port-range", "upstream-alone", "launch-command-int", "launch-command-bad-np", "launch-and-upstream"],
)
def test_bad_files_say_what_is_wrong(tmp_path: Path, text: str, fragments: list[str]) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ValueError) as info:
        Settings.build({"config": str(path)}, {})
    for fragment in fragments:
        assert fragment in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config_file(tmp_path / "nope.toml")


def test_secrets_are_never_printed() -> None:
    text = settings_toml(dataclasses.replace(Settings(), api_key="k1", admin_key=None))
    assert "k1" not in text
    assert "# api_key is set (not shown)" in text
    assert "# admin_key is not set" in text


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
    return subprocess.run([sys.executable, "-m", "slotkeeper.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**clean, **(env or {})}, check=False)


def test_print_config_shows_the_merged_settings(tmp_path: Path) -> None:
    path = write(tmp_path, 'port = 12000\nmax_queue = 7\nlog_level = "warning"\ncache_dir = "/tmp/sk"\n')
    result = run_cli("serve", "--config", str(path), "--max-queue", "9", "--print-config",
                     env={"SLOTKEEPER_LOG_LEVEL": "error"})
    assert result.returncode == 0 and result.stderr == ""
    printed = tomllib.loads(result.stdout)
    assert (printed["port"], printed["max_queue"], printed["log_level"], printed["cache_dir"]) == (
        12000, 9, "error", "/tmp/sk")


def test_print_config_reports_a_bad_file_on_stderr(tmp_path: Path) -> None:
    path = write(tmp_path, "bogus = 1\n")
    result = run_cli("serve", "--config", str(path), "--print-config")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"slotkeeper: config file {path}: unknown setting 'bogus'")


def test_the_directory_and_replica_url_are_checked_and_the_replica_url_has_a_default(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="redis://HOST:PORT/DB"):
        Settings.build({"directory": "10.0.0.5:6379"}, {})
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        Settings.build({"directory": "redis://r:6379/0", "replica_url": "host-a:11434", "replica_secret": "s" * 16},
                       {})
    # The replicas' secret is required with a directory, and long enough; the allow-list takes base URLs only.
    with pytest.raises(ValueError, match="--directory needs --replica-secret"):
        Settings.build({"directory": "redis://r:6379/0"}, {})
    with pytest.raises(ValueError, match="at least 16 characters"):
        Settings.build({"directory": "redis://r:6379/0", "replica_secret": "short"}, {})
    for bad in ("host-b:11434", "http://host-b:11434/v1", "http://user:pw@host-b:1", "file:///etc", "http://a b:1"):
        with pytest.raises(ValueError, match="--replica takes a replica's base URL"):
            Settings.build({"replicas": [bad]}, {})
    assert Settings.build({"port": 11500}, {}).effective_replica_url() == "http://127.0.0.1:11500"
    assert Settings.build({"replica_url": "http://host-a:1"}, {}).effective_replica_url() == "http://host-a:1"
