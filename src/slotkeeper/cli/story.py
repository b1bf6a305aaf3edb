"""`slotkeeper sessions explain ID`: the story of a session's last turns, told from its journal rows (what the cache
did for each request, and why the backend prefilled what it did). Pure: rows in, lines of text out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

# What each reason (cache/reasons.py) means to the person reading the story.
WORDS: dict[str, str] = {
    "hot": "the slot still held the conversation: only the new messages were prefilled",
    "own": "its own snapshot was restored from disk",
    "prefix": "it started from another conversation's snapshot that shares its beginning",
    "system": "it started from its system prompt's snapshot",
    "in-slot": "the slot already held as much as any snapshot would have given",
    "new-session": "a conversation slotkeeper had not seen before: nothing saved to start from",
    "side-task": "a side request (a title, tags, a quick check): it ran apart and did not touch the conversation",
    "rewritten": "the client sent an earlier message changed or dropped, so reuse stopped at that message",
    "evicted": "its snapshot had been evicted by the disk budget (--disk-budget, --max-snapshot-age)",
    "not-restorable": "its snapshot belongs to another model file, build or slot layout, so it cannot be used here",
    "quarantined": "its snapshot failed its checks (size or checksum) and was moved to quarantine/",
    "backend-restarted": "the backend lost the slot's state (it crashed or was restarted) before it was saved",
    "slot-taken": "another session took its slot, and this backend cannot bring the state back from disk",
    "not-extended": "this backend restores a recurrent or hybrid state only for a request that extends all of it",
    "keep-hot": "restores cannot help on this backend, so only a conversation still in its slot is reused",
    "too-short": "restoring what could be restored would cost more than prefilling it (measured)",
    "too-long": "its snapshot is larger than a slot's context",
    "warm-up": "a new system prompt: it was evaluated and saved first, for the conversations that will use it",
    "nothing-shared": "no saved state shares enough with the request",
    "restore-failed": "the backend refused the restore, so the turn ran without it (see the log)",
    "default-session": "a request with no session id and no system prompt: slotkeeper never saves those",
}


def tell(session: str, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One paragraph per request, oldest first, then a line of totals."""
    if not rows:
        return [f"no requests of session {session!r} since slotkeeper started (or they are too old to be kept)"]
    lines = [f"session {session}: its last {len(rows)} request(s), oldest first", ""]
    ordered = sorted(rows, key=lambda r: r.get("time", 0.0))
    for number, row in enumerate(ordered, 1):
        lines += _paragraph(number, row)
    reused = sum(r.get("cache_n") or 0 for r in ordered)
    prefilled = sum(r.get("prompt_n") or 0 for r in ordered)
    share = f" ({100 * reused / (reused + prefilled):.0f}% reused)" if reused + prefilled else ""
    lines.append(f"in all: {reused:,} prompt tokens reused, {prefilled:,} prefilled{share}")
    return lines


def _paragraph(number: int, row: Mapping[str, Any]) -> list[str]:
    when = datetime.fromtimestamp(float(row.get("time", 0.0))).strftime("%H:%M:%S")
    kind = "side request" if row.get("side") else "turn"
    status = int(row.get("status", 200))
    head = f"{number}. {when} {row.get('api', '?')} {kind} in slot {row.get('slot', '?')}"
    if status >= 400:
        head += f", answered {status}"
    reason = str(row.get("why") or "")
    words = WORDS.get(reason, reason or "no reason recorded")
    detail = row.get("why_detail")
    lines = [head, f"   {reason or '-'}: {words}" + (f" ({detail})" if detail else "")]
    counts = f"   reused {row.get('cache_n') or 0:,} prompt tokens, prefilled {row.get('prompt_n') or 0:,}"
    if row.get("restored"):
        origin = row.get("restored_from")
        counts += f"; restored {row['restored']:,} tokens{f' from {origin}' if origin else ''} in " \
                  f"{float(row.get('restore_ms') or 0):.0f} ms"
    lines += [counts, ""]
    return lines
