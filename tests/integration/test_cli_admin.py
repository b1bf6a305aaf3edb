"""The management commands (`slotkeeper sessions ...`, `doctor`) and `--log-json`, run as processes against a
running slotkeeper over a real llama-server; stdout, stderr and exit status are checked, never generated text."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest

from slotkeeper.upstream.launcher import free_port
from tests.conftest import Stack
from tests.support import Conversation, Slotkeeper, words

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


def test_clear_one_slot(stack: Stack, client_for) -> None:
    keeper = stack.slotkeeper(stack.backend(parallel=2, cache_ram=0))
    client = client_for(keeper)
    Conversation(client, "slot-a", size=300, seed=1).turn()
    Conversation(client, "slot-b", size=300, seed=2).turn()
    held = {s["session"]: s["id"] for s in client.get("/api/sessions/current").json()["slots"]}
    slot_a, slot_b = held["slot-a"], held["slot-b"]

    cleared = cli("sessions", "clear", "--slot", str(slot_b), "--url", keeper.url)
    assert (cleared.returncode, cleared.stderr) == (0, "")
    assert cleared.stdout == f"erased slot {slot_b}, which held slot-b (saved first if it had changed)\n"
    slots = {s["id"]: s for s in client.get("/api/sessions/current").json()["slots"]}
    assert slots[slot_b]["session"] is None and slots[slot_b]["n_tokens"] == 0
    assert slots[slot_a]["session"] == "slot-a" and slots[slot_a]["dirty"]  # untouched, still unsaved
    assert keeper.row("slot-b") is not None and keeper.row("slot-a") is None

    again = cli("sessions", "clear", "--slot", str(slot_b), "--json", "--url", keeper.url)
    assert (again.returncode, again.stderr) == (0, "")
    assert json.loads(again.stdout) == {"erased_slots": [slot_b], "session": "default", "held": None}
    empty = cli("sessions", "clear", "--slot", str(slot_b), "--url", keeper.url)
    assert empty.stdout == f"erased slot {slot_b}, which held no session\n"

    missing = cli("sessions", "clear", "--slot", "5", "--url", keeper.url)
    assert (missing.returncode, missing.stdout) == (1, "")
    assert missing.stderr == "slotkeeper: no slot 5: the backend has 2 slot(s), numbered from 0\n"
    not_a_number = cli("sessions", "clear", "--slot", "two", "--url", keeper.url)
    assert not_a_number.returncode == 2 and "invalid int value: 'two'" in not_a_number.stderr

    # The route answers in slotkeeper's own error shape; without ?slot it still clears every slot.
    response = client.post("/api/sessions/clear", params={"slot": "5"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "no slot 5: the backend has 2 slot(s), numbered from 0"
    bad = client.post("/api/sessions/clear", params={"slot": "x"})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "slot must be a slot number (0, 1, ...), not 'x'"
    assert client.post("/api/sessions/clear").json() == {"erased_slots": [0, 1], "session": "default"}
    assert keeper.row("slot-a") is not None


def test_top_level_export_and_import(stack: Stack, client_for, tmp_path: Path) -> None:
    keeper = two_saved_sessions(stack, client_for)
    row = keeper.row("cli-a")
    assert row is not None
    bundle = tmp_path / "cli-a.tar"
    exported = cli("export", "cli-a", str(bundle), "--url", keeper.url)
    assert (exported.returncode, exported.stderr) == (0, "")
    assert re.fullmatch(rf"exported cli-a to {re.escape(str(bundle))} \([0-9.]+ (KiB|MiB)\)\n", exported.stdout)
    with tarfile.open(bundle) as tar:
        assert tar.getmember("snapshot.bin").size == row["n_bytes"]

    imported = cli("import", str(bundle), "--as", "cli-a-copy", "--url", keeper.url)
    assert (imported.returncode, imported.stderr) == (0, "")
    assert imported.stdout.startswith(f"imported session snapshot cli-a-copy (tiny, {row['n_tokens']} tokens, ")
    copy = keeper.row("cli-a-copy")
    assert copy is not None and (copy["n_bytes"], copy["checksum"]) == (row["n_bytes"], row["checksum"])

    clash = cli("import", str(bundle), "--url", keeper.url)
    assert (clash.returncode, clash.stdout) == (1, "")
    assert clash.stderr.startswith("slotkeeper: a session snapshot 'cli-a' exists already; import with replace=true")
    replaced = cli("import", str(bundle), "--replace", "--json", "--url", keeper.url)
    assert (replaced.returncode, replaced.stderr) == (0, "")
    assert json.loads(replaced.stdout)["imported"] == "cli-a"

    # The same as `sessions export -o FILE`: a system snapshot too, and the errors of the sessions commands.
    key = httpx.post(keeper.url + "/api/sessions/prewarm", json={"system": words(400, 5)}, timeout=60).json()["system"]
    system_bundle = tmp_path / "system.tar"
    assert cli("export", key, str(system_bundle), "--system", "--url", keeper.url).returncode == 0
    removed = cli("sessions", "rm", key, "--system", "--url", keeper.url)
    assert (removed.returncode, removed.stderr) == (0, "")
    assert removed.stdout.startswith(f"deleted system snapshot {key} (tiny): ")
    back = cli("import", str(system_bundle), "--url", keeper.url)
    assert back.stdout.startswith(f"imported system snapshot {key} (tiny, ") and back.stderr == ""
    shown = httpx.get(f"{keeper.url}/api/sessions/{key}", params={"kind": "system"}).json()
    assert (shown["kind"], shown["session"]) == ("system", key)
    for method in ("GET", "DELETE"):
        response = httpx.request(method, f"{keeper.url}/api/sessions/nope", params={"kind": "system"})
        assert (response.status_code, response.json()["error"]["message"]) == (404, "no system snapshot 'nope'")
        response = httpx.request(method, f"{keeper.url}/api/sessions/cli-b", params={"kind": "all"})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "kind must be session or system, not 'all'"
    assert keeper.row("cli-b") is not None
    missing = cli("export", "no-such-session", str(tmp_path / "x.tar"), "--url", keeper.url)
    assert (missing.returncode, missing.stdout) == (1, "")
    assert missing.stderr == "slotkeeper: no session snapshot 'no-such-session' to export\n"
    assert not (tmp_path / "x.tar").exists() and not (tmp_path / "x.tar.part").exists()
    unreadable = cli("import", str(tmp_path / "none.tar"), "--url", keeper.url)
    assert (unreadable.returncode, unreadable.stdout) == (1, "")
    assert unreadable.stderr == f"slotkeeper: cannot read {tmp_path / 'none.tar'}: No such file or directory\n"
    usage = cli("export")
    assert usage.returncode == 2 and usage.stdout == ""
    assert "usage: slotkeeper export" in usage.stderr and "session" in usage.stderr


def test_commands_report_an_unreachable_slotkeeper() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["sessions", "ls"], ["sessions", "clear"], ["sessions", "clear", "--slot", "0"], ["doctor"],
                 ["doctor", "--json"], ["export", "some-session", "-"], ["import", "/dev/null"]):
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
    (stack.slot_dir / (row["filename"] + (".tail" if row["tail_bytes"] else ""))).unlink()  # its file, or tail
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
