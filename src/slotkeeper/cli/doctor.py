"""`slotkeeper doctor`: checks a running slotkeeper and its backend, and says what to change for each problem.

Every check reads the HTTP API only, so it works against a slotkeeper on this machine or another one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from slotkeeper.cache.capability import ADVISED_BUILD
from slotkeeper.cli.admin_client import AdminClient, CommandError
from slotkeeper.cli.formatting import human_bytes

# A slot smaller than this cuts long conversations short.
SMALL_CONTEXT = 8192
LOW_DISK_BYTES = 2 * 1024**3


@dataclass(frozen=True, slots=True)
class Check:
    """One finding: status is ok, warn or fail; `fix` says what to change (empty when nothing needs to)."""

    name: str
    status: str
    detail: str
    fix: str = ""


def run_doctor(client: AdminClient, as_json: bool, out: TextIO) -> int:
    checks = diagnose(client)
    failed = any(c.status == "fail" for c in checks)
    if as_json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2), file=out)
        return 1 if failed else 0
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.status:<4}  {c.name:<{width}}  {c.detail}", file=out)
        if c.fix:
            print(f"{'':<4}  {'':<{width}}  fix: {c.fix}", file=out)
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "fail")}
    print(f"{counts['ok']} ok, {counts['warn']} warning(s), {counts['fail']} failure(s)", file=out)
    return 1 if failed else 0


def diagnose(client: AdminClient) -> list[Check]:
    """All checks, in order; a slotkeeper that cannot be reached at all raises CommandError."""
    if not _reachable(client):
        return [Check("backend", "fail", f"{client.url}/health says the backend is down",
                      "start llama-server (or check --upstream); slotkeeper keeps serving once it is back")]
    backend = client.call("GET", "/api/backend")
    current = client.call("GET", "/api/sessions/current")
    sessions = client.call("GET", "/api/sessions")["sessions"]
    checks = [
        Check("backend", "ok", f"{backend['url']} is up: model {backend['model']}, build {backend['build'] or '?'}"),
        *_server_check(backend),
        _slots_check(backend),
        _context_check(backend),
        _slot_dir_check(backend, sessions),
        _fingerprint_check(backend, sessions),
        _restore_check(current),
        _save_check(current),
    ]
    return checks


def _server_check(backend: dict[str, Any]) -> list[Check]:
    """Launch and embedded modes: the server process slotkeeper runs, and whether it had to be restarted."""
    server = backend.get("server")
    if not isinstance(server, dict):
        return []
    if server.get("restarts"):
        return [Check("server", "warn", f"{server['name']} was restarted {server['restarts']} time(s) after it "
                      f"exited on its own (last: {server['last_exit']}); it runs as pid {server['pid']}",
                      f"read the end of {server['log']} for why; an OOM kill shows in dmesg")]
    return [Check("server", "ok", f"{server['name']} runs as pid {server['pid']}, output in {server['log']}")]


def _reachable(client: AdminClient) -> bool:
    """True when /health answers 200; False when it answers 503 (backend down); CommandError when nothing answers."""
    try:
        client.call("GET", "/health")
    except CommandError as exc:
        if "cannot reach" in str(exc):
            raise
        return False
    return True


def _slots_check(backend: dict[str, Any]) -> Check:
    n = int(backend["slots"])
    if n > 1:
        return Check("slots", "ok", f"{n} slots: {n} conversations stay hot at once")
    return Check("slots", "warn", "1 slot: every switch between two conversations costs a save and a restore",
                 "start llama-server with --parallel N and -c N times the context you want per slot, so N "
                 "conversations (a chat and its agents, OpenWebUI's title tasks) stay hot")


def _context_check(backend: dict[str, Any]) -> Check:
    n_ctx = int(backend["ctx_per_slot"])
    if n_ctx >= SMALL_CONTEXT:
        return Check("context", "ok", f"{n_ctx} tokens per slot")
    return Check("context", "warn", f"{n_ctx} tokens per slot: longer conversations fail with "
                 "exceed_context_size_error", f"raise llama-server's -c (it is split across --parallel slots) to at "
                 f"least {SMALL_CONTEXT} per slot")


def _stored_file(session: dict[str, Any]) -> str:
    """The file a saved state is kept in: its slot file, or its tail when kept as blocks (cache/blockstore.py)."""
    return str(session["file"]) + (".tail" if session.get("stored_as") == "blocks" else "")


def _slot_dir_check(backend: dict[str, Any], sessions: list[dict[str, Any]]) -> Check:
    slot_dir = Path(backend["slot_dir"])
    free = backend.get("slot_dir_free_bytes")
    used = sum(int(s["bytes"]) for s in sessions)
    detail = f"{slot_dir}: {len(sessions)} snapshot(s), {human_bytes(used)}"
    if free is not None:
        detail += f", {human_bytes(free)} free"
    if free is not None and free < LOW_DISK_BYTES:
        return Check("slot dir", "warn", detail, "free disk space or delete old sessions (`slotkeeper sessions rm "
                     "ID`): a save that does not fit fails and the conversation is prefilled again later")
    if slot_dir.is_dir():  # the same machine: the files can be checked too
        missing = [s["session"] for s in sessions if not (slot_dir / _stored_file(s)).is_file()]
        if missing:
            return Check("slot dir", "fail", f"{detail}; {len(missing)} indexed file(s) missing, e.g. {missing[0]!r}",
                         "another program removed files from the slot dir: restart slotkeeper (it drops rows "
                         "without files at start) and keep other tools out of the directory")
        quarantined = slot_dir / "quarantine"
        n_bad = len(os.listdir(quarantined)) if quarantined.is_dir() else 0
        if n_bad:
            return Check("slot dir", "warn", f"{detail}; {n_bad} file(s) in quarantine/",
                         f"see the log lines 'snapshot ... quarantined: REASON'; delete {quarantined} when done")
    return Check("slot dir", "ok", detail)


def _fingerprint_check(backend: dict[str, Any], sessions: list[dict[str, Any]]) -> Check:
    stale = [s for s in sessions if s["fingerprint"] != backend["fingerprint"]]
    if not stale:
        return Check("fingerprint", "ok", f"{backend['fingerprint']}: every snapshot matches the running backend")
    return Check("fingerprint", "warn", f"{len(stale)} of {len(sessions)} snapshot(s) were made by another model or "
                 "slot layout and will never be restored here",
                 "restart llama-server with the model, -c and --parallel they were made with, or delete them: "
                 "slotkeeper sessions rm " + " ".join(s["session"] for s in stale[:3]))


def _restore_check(current: dict[str, Any]) -> Check:
    good, bad = int(current["restores_effective"]), int(current["restores_ineffective"])
    restoring = current.get("restoring") or {}
    strategy, reason = restoring.get("strategy", "restore"), str(restoring.get("reason", ""))
    build = f"llama.cpp {restoring['build']}: " if restoring.get("build") else ""
    if strategy == "keep-hot":
        return Check("restores", "warn", f"{build}{reason}",
                     f"run llama.cpp {ADVISED_BUILD}: it keeps context checkpoints in slot files "
                     "(docs/architectures.md)")
    if not current["restore_effective"]:
        return Check("restores", "warn", f"{bad} restore(s) reused less than they shared with the request: {reason}",
                     "see docs/architectures.md for what each model and llama.cpp build can restore")
    counted = f"{good} restore(s) checked, {bad} not reused" if good or bad else "no restore checked yet"
    if strategy == "prompt-end":
        return Check("restores", "warn", f"{counted}; {build}{reason}",
                     f"run llama.cpp {ADVISED_BUILD} to restore edited and forked histories of this model too")
    return Check("restores", "ok", f"{counted}; {reason}" if reason else counted)


def _save_check(current: dict[str, Any]) -> Check:
    failed, saves = int(current["failed_saves"]), int(current["saves"])
    if failed:
        return Check("saves", "warn", f"{failed} failed save(s), {saves} good",
                     "see the log lines 'saving slot N as ... failed' (disk full, permissions, or the backend "
                     "restarted and saved 0 tokens)")
    return Check("saves", "ok", f"{saves} save(s), none failed")
