"""The management commands (`slotkeeper sessions ...`, `doctor`) and `--log-json`, run as processes against a
running slotkeeper over a real llama-server; stdout, stderr and exit status are checked, never generated text."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from slotkeeper.upstream.launcher import free_port
from tests.conftest import Stack
from tests.support import Conversation, Slotkeeper

pytestmark = pytest.mark.backend


@pytest.fixture
def backend_kind() -> str:
    """The commands speak HTTP to slotkeeper only, so one backend kind is enough."""
    return "binary"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLOTKEEPER_")}
    return subprocess.run([sys.executable, "-m", "slotkeeper.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**clean, **(env or {})}, check=False)


def two_saved_sessions(stack: Stack, client_for) -> Slotkeeper:
    keeper = stack.slotkeeper(stack.backend(parallel=1, cache_ram=0))
    client = client_for(keeper)
    Conversation(client, "cli-a", size=500, seed=1).turn()
    Conversation(client, "cli-b", size=300, seed=2).turn()  # saves cli-a
    result = cli("sessions", "clear", "--url", keeper.url)  # saves cli-b, erases the slot
    assert result.returncode == 0, result.stderr
    assert result.stdout == "saved changed slots, then erased slot(s): 0\n"
    assert result.stderr == ""
    return keeper


def test_sessions_ls_show_rm(stack: Stack, client_for) -> None:
    keeper = two_saved_sessions(stack, client_for)
    rows = {r["session_id"]: r for r in keeper.index_rows()}
    assert set(rows) == {"cli-a", "cli-b"}

    ls = cli("sessions", "ls", "--url", keeper.url)
    assert ls.returncode == 0 and ls.stderr == ""
    lines = ls.stdout.splitlines()
    assert lines[0].split() == ["SESSION", "MODEL", "KIND", "TOKENS", "SIZE", "LAST", "USED", "HITS", "PINNED", "SLOT"]
    assert [line.split()[0] for line in lines[1:3]] == ["cli-b", "cli-a"]  # most recently used first
    assert lines[1].split()[2:4] == ["session", str(rows["cli-b"]["n_tokens"])]
    assert lines[3].startswith("2 session(s), ")

    as_json = cli("sessions", "ls", "--json", "--url", keeper.url)
    assert as_json.returncode == 0 and as_json.stderr == ""
    listed = {s["session"]: s for s in json.loads(as_json.stdout)["sessions"]}
    assert {k: (v["tokens"], v["bytes"]) for k, v in listed.items()} == {
        k: (r["n_tokens"], r["n_bytes"]) for k, r in rows.items()}

    show = cli("sessions", "show", "cli-a", "--url", keeper.url)
    assert show.returncode == 0 and show.stderr == ""
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in show.stdout.splitlines())
    assert fields["session"].strip() == "cli-a"
    assert fields["tokens"].strip() == str(rows["cli-a"]["n_tokens"])
    assert fields["file"].strip() == rows["cli-a"]["filename"]
    assert fields["requests"].strip() == "1"
    shown = json.loads(cli("sessions", "show", "cli-a", "--json", "--url", keeper.url).stdout)
    assert shown["tokens"] == rows["cli-a"]["n_tokens"] and shown["activity"]["requests"] == 1

    rm = cli("sessions", "rm", "cli-b", "--url", keeper.url)
    assert rm.returncode == 0 and rm.stderr == ""
    assert rm.stdout.startswith(f"deleted cli-b (tiny): {rows['cli-b']['filename']}, ")
    assert not (stack.slot_dir / rows["cli-b"]["filename"]).exists()
    assert keeper.row("cli-b") is None

    missing = cli("sessions", "rm", "no-such-session", "--url", keeper.url)
    assert missing.returncode == 1
    assert missing.stdout == ""
    assert missing.stderr == "slotkeeper: session 'no-such-session' not found\n"
    missing_show = cli("sessions", "show", "no-such-session", "--url", keeper.url)
    assert (missing_show.returncode, missing_show.stdout) == (1, "")
    assert "not found" in missing_show.stderr


def test_sessions_ls_when_empty_and_url_from_environment(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend())
    result = cli("sessions", "ls", env={"SLOTKEEPER_URL": keeper.url})
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("no saved sessions in ")


def test_commands_report_an_unreachable_slotkeeper() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["sessions", "ls"], ["sessions", "clear"], ["doctor"], ["doctor", "--json"]):
        result = cli(*args, "--url", url)
        assert result.returncode == 1, args
        assert result.stdout == ""
        assert result.stderr.startswith(f"slotkeeper: cannot reach slotkeeper at {url} ")
        assert "Traceback" not in result.stderr


def test_sessions_needs_an_action() -> None:
    result = cli("sessions")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "ls" in result.stderr and "rm" in result.stderr


def test_doctor_reports_checks_and_fixes(stack: Stack, client_for) -> None:
    keeper = two_saved_sessions(stack, client_for)
    result = cli("doctor", "--url", keeper.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    status = {line[6:].split("  ")[0].strip(): line[:4].strip() for line in result.stdout.splitlines()
              if line[:4].strip() in ("ok", "warn", "fail")}
    assert status == {"backend": "ok", "slots": "warn", "context": "ok", "slot dir": "ok", "fingerprint": "ok",
                      "restores": "ok", "saves": "ok"}
    assert "fix: start llama-server with --parallel N" in result.stdout
    assert result.stdout.splitlines()[-1] == "6 ok, 1 warning(s), 0 failure(s)"

    # A snapshot file removed behind slotkeeper's back is a failure with its fix, and exit status 1.
    row = keeper.row("cli-a")
    assert row is not None
    (stack.slot_dir / row["filename"]).unlink()
    broken = cli("doctor", "--json", "--url", keeper.url)
    assert broken.returncode == 1 and broken.stderr == ""
    report = json.loads(broken.stdout)
    assert report["ok"] is False
    slot_dir = next(c for c in report["checks"] if c["name"] == "slot dir")
    assert slot_dir["status"] == "fail" and "1 indexed file(s) missing" in slot_dir["detail"]
    assert slot_dir["fix"]


def test_log_json_writes_one_object_per_line(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(), "--log-json")
    Conversation(client_for(keeper), "json-log", size=300).turn()
    keeper.stop()
    records = [json.loads(line) for line in keeper.log_text().splitlines() if line.strip()]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    turns = [r for r in records if r["logger"] == "slotkeeper.turn"]
    assert len(turns) == 1
    turn = turns[0]
    assert (turn["api"], turn["session"], turn["cache"], turn["status"], turn["end"]) == (
        "openai.chat", "json-log", "cold", 200, "completed")
    assert turn["prompt_n"] > 0 and turn["cache_n"] is not None
    assert {"restore_ms", "save_ms", "restored", "slot", "ms", "model"} <= set(turn)
    assert turn["message"].startswith("openai.chat session=tiny/json-log slot=0 cache=cold ")


def test_admin_key_is_sent(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(), "--admin-key", "sesame")
    refused = cli("sessions", "ls", "--url", keeper.url)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith(f"slotkeeper: {keeper.url} refused the admin key")
    allowed = cli("sessions", "ls", "--url", keeper.url, env={"SLOTKEEPER_ADMIN_KEY": "sesame"})
    assert allowed.returncode == 0, allowed.stderr
    assert cli("sessions", "ls", "--url", keeper.url, "--admin-key", "sesame").returncode == 0
