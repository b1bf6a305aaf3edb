"""The management commands (`slotkeeper sessions ...`, `doctor`, `prewarm`, `export`, `import`): talk to a running
slotkeeper over HTTP.

Human-readable tables on stdout by default, the API's JSON with --json; problems go to stderr with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any, TextIO

from slotkeeper.cli.admin_client import DEFAULT_URL, AdminClient, CommandError
from slotkeeper.cli.doctor import run_doctor
from slotkeeper.cli.formatting import human_bytes, print_json, since, table
from slotkeeper.cli.story import tell

_DOMAIN_HELP = ("the cache domain the session is in, where users are kept apart (docs/domains.md); default: the "
                "key's own")


def add_commands(sub: Any) -> None:
    """Register `sessions`, `backends`, `prewarm`, `doctor`, `export` and `import` on the top-level subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, metavar="URL",
                        help=f"the running slotkeeper (default $SLOTKEEPER_URL or {DEFAULT_URL})")
    common.add_argument("--admin-key", default=None, metavar="KEY",
                        help="sent as 'Authorization: Bearer KEY' (default $SLOTKEEPER_ADMIN_KEY)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")

    sessions = sub.add_parser("sessions", help="list, show, delete or clear sessions of a running slotkeeper",
                              description="Manage the sessions of a running slotkeeper over its HTTP API.")
    actions = sessions.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("ls", parents=[common], help="list saved sessions, most recently used first")
    ls.add_argument("--model", help="only this model's sessions")
    ls.add_argument("--kind", choices=["session", "system", "all"], default="session",
                    help="conversations (default), system-prompt snapshots, or both")
    show = actions.add_parser("show", parents=[common], help="one session's snapshot and activity")
    show.add_argument("session")
    show.add_argument("--model", help="the model namespace (default: the served model)")
    show.add_argument("--domain", metavar="DOMAIN", help=_DOMAIN_HELP)
    explain = actions.add_parser("explain", parents=[common],
                                 help="tell, in words, what the cache did for a session's last requests, and why")
    explain.add_argument("session")
    explain.add_argument("--model", help="the model namespace (default: every served model)")
    explain.add_argument("--domain", metavar="DOMAIN", help=_DOMAIN_HELP)
    rm = actions.add_parser("rm", parents=[common], help="delete sessions' snapshots (files and index rows)")
    rm.add_argument("session", nargs="+")
    rm.add_argument("--system", action="store_true", help="the ids are system-prompt snapshot keys")
    rm.add_argument("--model", help="the model namespace (default: the served model)")
    rm.add_argument("--domain", metavar="DOMAIN", help=_DOMAIN_HELP)
    clear = actions.add_parser("clear", parents=[common], help="save changed slots, then erase every slot (or one)")
    clear.add_argument("--slot", type=int, metavar="N",
                       help="only slot N (numbered from 0); the other slots keep their state")
    clear.add_argument("--model", help="the backend's model (default: the first backend)")
    for verb, what in (("pin", "keep snapshots from the disk budget (never evicted)"),
                       ("unpin", "let the disk budget evict snapshots again")):
        action = actions.add_parser(verb, parents=[common], help=what)
        action.add_argument("session", nargs="+", help="session ids (or, with --system, system snapshot keys)")
        action.add_argument("--system", action="store_true", help="the ids are system-prompt snapshot keys")
        action.add_argument("--model", help="the model namespace (default: the served model)")
        action.add_argument("--domain", metavar="DOMAIN", help=_DOMAIN_HELP)
    actions.add_parser("disk", parents=[common], help="disk used by snapshots, the budget, and evictions")
    _add_transfer_commands(actions, common, file_positional=False)

    prewarm = sub.add_parser(
        "prewarm", parents=[common], help="warm a system prompt up once and keep it as a system snapshot",
        description="Evaluate a system prompt (and tools) in a running slotkeeper and save it as a system snapshot, so "
        "the first conversation on it starts warm. FILE is the system prompt as plain text, or a JSON object with "
        "any of: system, messages (leading system messages, or a first user message whose leading text blocks are "
        "instructions), tools, api, model. '-' reads standard input. Progress goes to stderr.")
    prewarm.add_argument("file", metavar="FILE")
    prewarm.add_argument("--tools", metavar="TOOLS.json", help="a JSON list of tool definitions to warm up with it")
    prewarm.add_argument("--api", choices=["openai", "anthropic", "ollama"],
                         help="the client API whose requests will carry this prompt (default: anthropic when the "
                         "tools have input_schema, else openai; the three render some prompts differently)")
    prewarm.add_argument("--model", help="the model namespace (default: the served model)")
    prewarm.add_argument("--pin", action="store_true", help="keep the snapshot from the disk budget")
    prewarm.add_argument("--domain", default="", metavar="DOMAIN",
                         help="the cache domain to keep it in (a key's name, `team/user=ID`; default: the one domain "
                         "of requests nothing keeps apart); a prompt shared on purpose is pre-warmed into each")

    several = sub.add_parser("backends", help="a model on several backends: list them, drain one, put it back",
                             description="The backends of a model that runs on several ([[backends]] tables of one "
                             "name). A drained backend gets no new session, and each of its sessions moves to "
                             "another backend at its next turn, its latest turn saved first.")
    verbs = several.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = verbs.add_parser("ls", parents=[common], help="each backend: up, draining, active sessions")
    listing.add_argument("--model", help="the model (default: the first)")
    for verb, what in (("drain", "take a backend out of service"), ("undrain", "put a drained backend back")):
        action = verbs.add_parser(verb, parents=[common], help=what)
        action.add_argument("backend", metavar="URL", help="the backend's URL, as `slotkeeper backends ls` shows it")

    sub.add_parser("models", parents=[common], help="each model: loaded or not, its loads and unloads, what its last "
                   "unload saved",
                   description="The models a running slotkeeper serves. In front of a llama-server router they take "
                   "turns: each one's state (loaded, unloaded, loading), its running turns, how often it was loaded "
                   "and unloaded, the conversations its last unload saved first, and when its keep_alive runs out.")
    sub.add_parser("doctor", parents=[common], help="check the backend's settings, slot dir, fingerprints and "
                   "restores, and say what to change",
                   description="Check a running slotkeeper and its backend; exit status 1 if a check fails.")
    # `slotkeeper export SESSION FILE` and `slotkeeper import FILE`: the same as `sessions export/import`.
    _add_transfer_commands(sub, common, file_positional=True)


def _add_transfer_commands(sub: Any, common: argparse.ArgumentParser, file_positional: bool) -> None:
    """`export` and `import`, under `sessions` (the file of an export given with -o) or at the top level (the
    file given as the second word, `slotkeeper export SESSION FILE`)."""
    export = sub.add_parser("export", parents=[common], help="write a session's snapshot to a bundle file",
                            description="Write one snapshot (slot file, index row, message chain) to a tar bundle "
                            "that `slotkeeper import` reads on a machine running the same model file, slot layout "
                            "and llama.cpp build.")
    export.add_argument("session", help="the session id (with --system, the system snapshot's key)")
    output_help = "default: SESSION.slotkeeper.tar here; '-' for stdout"
    if file_positional:
        export.add_argument("output", nargs="?", metavar="FILE", help=output_help)
    else:
        export.add_argument("-o", "--output", metavar="FILE", help=output_help)
    export.add_argument("--system", action="store_true", help="the id is a system-prompt snapshot key")
    export.add_argument("--model", help="the model namespace (default: the served model)")
    export.add_argument("--domain", metavar="DOMAIN", help=_DOMAIN_HELP)
    imp = sub.add_parser("import", parents=[common], help="add a snapshot from a bundle file",
                         description="Add the snapshot of a bundle written by `slotkeeper export`. Refused when the "
                         "bundle was made by another model file, slot layout or build.")
    imp.add_argument("file", metavar="FILE", help="the bundle; '-' reads standard input")
    imp.add_argument("--as", dest="as_id", metavar="ID", help="import under another session id")
    imp.add_argument("--replace", action="store_true", help="overwrite an existing snapshot of that id")
    imp.add_argument("--model", help="the model namespace (default: the served model)")
    imp.add_argument("--domain", metavar="DOMAIN", help="the cache domain to import it into, if not the one it was "
                     "exported from (the admin key only; docs/domains.md)")


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    client = AdminClient((args.url or os.environ.get("SLOTKEEPER_URL") or DEFAULT_URL).rstrip("/"),
                         args.admin_key or os.environ.get("SLOTKEEPER_ADMIN_KEY") or None)
    try:
        if args.command == "doctor":
            return run_doctor(client, args.json, out)
        if args.command == "prewarm":
            return _prewarm(client, args, out, err)
        if args.command == "backends":
            return _backends(client, args, out)
        if args.command == "models":
            return _models(client, args, out)
        action = args.command if args.command in ("export", "import") else args.action
        return _SESSION_ACTIONS[action](client, args, out)
    except CommandError as exc:
        print(f"slotkeeper: {exc}", file=err)
        return 1


def _backends(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    if args.action == "ls":
        data = client.call("GET", "/api/backend", {"model": args.model} if args.model else None)
        model, listed = data["model"], data.get("backends")
        if listed is None:
            raise CommandError(f"model {model!r} runs on one backend ({data['url']})")
    else:
        data = client.call("POST", "/api/backend/drain", body={"backend": args.backend,
                                                               "draining": args.action == "drain"})
        model, listed = data["model"], data["backends"]
    if args.json:
        print_json({"model": model, "backends": listed}, out)
        return 0
    rows = [[b["url"], "up" if b["up"] else "down", "yes" if b["draining"] else "no", b["active_sessions"],
             b["moved_in"]] for b in listed]
    print(table(["BACKEND", "STATE", "DRAINING", "ACTIVE SESSIONS", "MOVED IN"], rows), file=out)
    print(f"model {model}: {len(listed)} backends", file=out)
    return 0


def _models(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    data = client.call("GET", "/api/models")
    if args.json:
        print_json(data, out)
        return 0
    now = time.time()
    rows = [[m["model"], m["status"], m["turns_running"], m["loads"], m["unloads"],
             ", ".join(m["saved_at_last_unload"]) or "-",
             "-" if m["expires_at"] is None else f"in {max(0.0, m['expires_at'] - now):.0f} s"]
            for m in data["models"]]
    print(table(["MODEL", "STATE", "TURNS", "LOADS", "UNLOADS", "SAVED AT LAST UNLOAD", "UNLOADED"], rows), file=out)
    return 0


def _ls(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    data = client.call("GET", "/api/sessions", {"kind": args.kind})
    sessions = [s for s in data["sessions"] if args.model is None or s["model"] == args.model]
    if args.json:
        print_json({"slot_dir": data["slot_dir"], "sessions": sessions}, out)
        return 0
    if not sessions:
        print(f"no saved sessions in {data['slot_dir']}", file=out)
        _model_states(client, out)
        return 0
    rows = [[s["session"], s["model"], s["kind"], s["tokens"], human_bytes(s["bytes"]), since(s["last_used"]),
             s["hits"], "yes" if s["pinned"] else "no", "" if s["hot_in_slot"] is None else s["hot_in_slot"]]
            for s in sessions]
    header = ["SESSION", "MODEL", "KIND", "TOKENS", "SIZE", "LAST USED", "HITS", "PINNED", "SLOT"]
    if any(s.get("domain") for s in sessions):  # users kept apart (docs/domains.md): whose each one is
        header.insert(1, "DOMAIN")
        for row, s in zip(rows, sessions, strict=True):
            row.insert(1, s.get("domain") or '""')
    print(table(header, rows), file=out)
    total = sum(s["bytes"] for s in sessions)
    print(f"{len(sessions)} session(s), {human_bytes(total)} in {data['slot_dir']}", file=out)
    _model_states(client, out)
    return 0


def _model_states(client: AdminClient, out: TextIO) -> None:
    """Where models take turns (a router's, or max_loaded): one line with each model's state (`slotkeeper models`
    has the rest)."""
    try:
        data = client.call("GET", "/api/models")
    except CommandError:
        return  # an older slotkeeper: no model states
    if data.get("take_turns"):
        print("models: " + ", ".join(f"{m['model']} {m['status']}" for m in data["models"]), file=out)


def _show(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    data = client.call("GET", "/api/sessions/" + _quote(args.session), _model_param(args))
    recent = client.call("GET", "/api/requests/recent")
    totals = next((t for t in recent.get("session_totals", [])
                   if t["session"] == data["session"] and t["model"] == data["model"]
                   and t.get("domain", "") == data.get("domain", "")), None)
    if args.json:
        print_json({**data, "activity": totals}, out)
        return 0
    rows: list[list[Any]] = [["session", data["session"]], ["model", data["model"]]]
    if data.get("file") is None:
        rows.append(["file", "(not saved yet)"])
    else:
        rows += [["file", data["file"]], ["tokens", data["tokens"]], ["size", human_bytes(data["bytes"])],
                 ["created", data["created"]], ["last used", f"{data['last_used']} ({since(data['last_used'])})"],
                 ["hits", data["hits"]], ["fingerprint", data["fingerprint"]]]
    rows.append(["in slot", "-" if data.get("hot_in_slot") is None else data["hot_in_slot"]])
    if totals is not None:
        rows += [["requests", totals["requests"]], ["tokens reused", totals["tokens_reused"]],
                 ["tokens prefilled", totals["tokens_prefilled"]],
                 ["prefill saved", f"{totals['seconds_saved']:.1f} s (estimated, since slotkeeper started)"]]
    width = max(len(str(r[0])) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=out)
    return 0


def _explain(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    params = {"session": args.session, **(_model_param(args) or {})}
    rows = client.call("GET", "/api/requests/recent", params)["requests"]
    if args.json:
        print_json({"session": args.session, "requests": rows}, out)
        return 0
    for line in tell(args.session, rows):
        print(line, file=out)
    return 0


def _rm(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    params = {**(_model_param(args) or {}), **({"kind": "system"} if args.system else {})}
    results = [client.call("DELETE", "/api/sessions/" + _quote(s), params or None) for s in args.session]
    if args.json:
        print_json({"deleted": results}, out)
        return 0
    for r in results:
        what = "system snapshot " if r.get("kind") == "system" else ""
        print(f"deleted {what}{r['deleted']} ({r['model']}): {r['file']}, {human_bytes(r['bytes'])}", file=out)
    return 0


def _clear(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    params = {**(_model_param(args) or {}), **({"slot": str(args.slot)} if args.slot is not None else {})}
    data = client.call("POST", "/api/sessions/clear", params or None)
    if args.json:
        print_json(data, out)
        return 0
    if args.slot is not None:
        held = data.get("held")
        print(f"erased slot {args.slot}, " + (f"which held {held} (saved first if it had changed)" if held
                                              else "which held no session"), file=out)
        return 0
    erased = ", ".join(str(i) for i in data["erased_slots"]) or "none"
    print(f"saved changed slots, then erased slot(s): {erased}", file=out)
    return 0


def _prewarm(client: AdminClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    body = _prewarm_body(args)
    result: dict[str, Any] | None = None
    progress = Progress(err)
    for event in client.stream_lines("/api/sessions/prewarm", body):
        status = event.get("status")
        if status == "prefill":
            progress.show(int(event.get("processed", 0)), int(event.get("total", 0)))
        elif status == "failed":
            progress.done()
            raise CommandError(f"the pre-warm failed, nothing was saved: {event.get('error')}")
        elif status in ("saved", "exists", "too-short"):
            result = event
    progress.done()
    if result is None:
        raise CommandError("the pre-warm ended without a result (did slotkeeper stop?)")
    if args.json:
        print_json(result, out)
        return 0
    what = {"saved": "saved as a system snapshot", "exists": "already had a system snapshot",
            "too-short": "is too short for its restore to pay: not worth a snapshot"}[str(result["status"])]
    print(f"system prompt {str(result['system'])[:12]} ({result['model']}, {result['tokens']} tokens) {what}"
          + (f", {human_bytes(result['bytes'])}" if result["status"] == "saved" else "")
          + f" in {float(result['ms']) / 1000:.1f} s", file=out)
    return 0


def _prewarm_body(args: argparse.Namespace) -> dict[str, Any]:
    text = _read_text(args.file)
    body: dict[str, Any]
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    body = dict(parsed) if isinstance(parsed, dict) else {"system": text}
    if args.tools:
        try:
            body["tools"] = json.loads(_read_text(args.tools))
        except ValueError as exc:
            raise CommandError(f"{args.tools} is not JSON: {exc}") from exc
    if args.api:
        body["api"] = args.api
    if args.model:
        body["model"] = args.model
    if args.pin:
        body["pin"] = True
    if args.domain:
        body["domain"] = args.domain
    body["stream"] = True
    return body


def _read_text(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise CommandError(f"{path} is not UTF-8 text: {exc}") from exc


class Progress:
    """A prefill progress line on stderr: rewritten in place on a terminal, every 10% otherwise."""

    def __init__(self, err: TextIO) -> None:
        self._err = err
        self._tty = err.isatty()
        self._shown = -1
        self._open = False

    def show(self, processed: int, total: int) -> None:
        percent = int(100 * processed / total) if total else 0
        if not self._tty and percent // 10 == self._shown // 10:
            return
        self._shown = percent
        text = f"prefill {processed}/{total} tokens ({percent}%)"
        if self._tty:
            print("\r" + text, end="", file=self._err, flush=True)
            self._open = True
        else:
            print(text, file=self._err, flush=True)

    def done(self) -> None:
        if self._open:
            print(file=self._err)
            self._open = False


def _pin(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    params = {**(_model_param(args) or {}), **({"kind": "system"} if args.system else {})}
    results = [client.call("POST", f"/api/sessions/{_quote(s)}/{args.action}", params or None) for s in args.session]
    if args.json:
        print_json({args.action + "ned": results}, out)
        return 0
    for r in results:
        print(f"{r['kind']} snapshot {r['session']} ({r['model']}) is {'pinned' if r['pinned'] else 'not pinned'}",
              file=out)
    return 0


def _disk(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    data = client.call("GET", "/api/sessions/disk")
    if args.json:
        print_json(data, out)
        return 0
    budget = data["budget"]
    rows = [[kind, u["count"], human_bytes(u["bytes"]), u["pinned"]] for kind, u in data["snapshots"].items()]
    print(table(["KIND", "SNAPSHOTS", "SIZE", "PINNED"], rows), file=out)
    limits = [f"total {human_bytes(budget['max_bytes'])}" if budget["max_bytes"] else "no size limit",
              f"max age {budget['max_age_seconds'] / 86400:.1f} d" if budget["max_age_seconds"] else "no max age",
              f"{budget['max_system_snapshots']} system snapshot(s) per model" if budget["max_system_snapshots"]
              else "no system snapshot limit"]
    print(f"{human_bytes(data['bytes'])} in {data['slot_dir']} ({human_bytes(data['disk_free_bytes'])} free); "
          f"budget: {', '.join(limits)}; {data['evictions']} evicted since start", file=out)
    return 0


def _export(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    params = {**(_model_param(args) or {}), **({"kind": "system"} if args.system else {})}
    target = args.output or f"{args.session}.slotkeeper.tar".replace("/", "_")
    path = f"/api/sessions/{_quote(args.session)}/export"
    if target == "-":
        client.download(path, params, sys.stdout.buffer)
        return 0
    partial = Path(target + ".part")
    try:
        with partial.open("wb") as fh:
            written = client.download(path, params, fh)
        partial.replace(target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    print(f"exported {args.session} to {target} ({human_bytes(written)})", file=out)
    return 0


def _import(client: AdminClient, args: argparse.Namespace, out: TextIO) -> int:
    params = {**(_model_param(args) or {}), **({"as": args.as_id} if args.as_id else {}),
              **({"replace": "true"} if args.replace else {})}
    try:
        source = sys.stdin.buffer if args.file == "-" else Path(args.file).open("rb")  # noqa: SIM115
    except OSError as exc:
        raise CommandError(f"cannot read {args.file}: {exc.strerror or exc}") from exc
    with source:
        result = client.upload("/api/sessions/import", params, source)
    if args.json:
        print_json(result, out)
        return 0
    print(f"imported {result['kind']} snapshot {result['imported']} ({result['model']}, {result['tokens']} tokens, "
          f"{human_bytes(result['bytes'])})", file=out)
    return 0


_SESSION_ACTIONS = {"ls": _ls, "show": _show, "explain": _explain, "rm": _rm, "clear": _clear, "pin": _pin,
                    "unpin": _pin, "disk": _disk, "export": _export, "import": _import}


def _quote(session: str) -> str:
    return urllib.parse.quote(session, safe="")


def _model_param(args: argparse.Namespace) -> dict[str, str] | None:
    """The model and, where users are kept apart, the cache domain a command names (docs/domains.md)."""
    params = {**({"model": args.model} if args.model else {}),
              **({"domain": args.domain} if getattr(args, "domain", None) is not None else {})}
    return params or None
