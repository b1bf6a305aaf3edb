"""kill -9 of slotkeeper at random points while it saves: no torn file is ever in the index, a restart reconciles
the directory, and every session's last completed snapshot stays intact and restorable by the real backend."""

from __future__ import annotations

import random
import re
import signal
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from slotkeeper.cache.store import file_checksum
from tests.support import Backend, Slotkeeper, chat, words

pytestmark = pytest.mark.backend
KILLS = 50
SESSIONS = ["a", "b", "c"]
_TEMP = re.compile(r"^[0-9a-f]{40}\.tmp-[0-9a-f]{8}\.bin$")


def _index(cache_dir: Path) -> list[sqlite3.Row]:
    db = sqlite3.connect(cache_dir / "index.sqlite3")
    db.row_factory = sqlite3.Row
    try:
        return list(db.execute("SELECT * FROM snapshots"))
    except sqlite3.OperationalError:  # killed before the schema was ever written
        return []
    finally:
        db.close()


def _assert_index_consistent(cache_dir: Path, slot_dir: Path) -> dict[str, str]:
    """Every indexed file (of sessions and system prompts) exists with the indexed size and checksum; returns
    session -> checksum for the sessions."""
    good = {}
    for row in _index(cache_dir):
        path = slot_dir / row["filename"]
        assert path.is_file(), f"indexed file missing: {row['filename']}"
        assert path.stat().st_size == row["n_bytes"], f"torn file in the index: {row['filename']}"
        assert file_checksum(path) == row["checksum"], f"checksum mismatch in the index: {row['filename']}"
        assert row["n_tokens"] > 0
        if row["kind"] == "session":
            good[row["session_id"]] = row["checksum"]
    return good


def test_kill_9_at_random_points_of_saving(tmp_path: Path, tiny_model: Path) -> None:
    backend = Backend("binary", tiny_model, tmp_path / "slots", tmp_path / "backend.log", cache_ram=0).start()
    cache = tmp_path / "cache"
    rng = random.Random(2026)
    history = {s: [{"role": "system", "content": f"session {s} " + words(400, i)}] for i, s in enumerate(SESSIONS)}
    temporaries_seen = 0
    keeper: Slotkeeper | None = None
    try:
        for _kill in range(KILLS):
            keeper = Slotkeeper(cache, tmp_path / "slotkeeper.log", backend,
                                extra_args=("--save-idle-seconds", "0", "--min-restore-tokens", "0")).start()
            # Right after a start, the previous run's leftovers are gone (reconcile) and the index is consistent.
            assert not [p for p in backend.slot_dir.iterdir() if _TEMP.match(p.name)]
            _assert_index_consistent(cache, backend.slot_dir)

            def drive(client_url: str = keeper.url) -> None:
                with httpx.Client(base_url=client_url, timeout=30) as client:
                    for _ in range(4):  # every switch saves the previous session; every turn ends in an idle save
                        session = rng.choice(SESSIONS)
                        history[session].append({"role": "user", "content": words(30, rng.randrange(1000))})
                        try:
                            chat(client, history[session], session, max_tokens=2)
                        except httpx.HTTPError:
                            return  # killed under us

            worker = threading.Thread(target=drive)
            worker.start()
            time.sleep(rng.uniform(0.05, 1.2))
            keeper.stop(signal.SIGKILL)
            worker.join(60)
            temporaries_seen += sum(1 for p in backend.slot_dir.iterdir() if _TEMP.match(p.name))
            _assert_index_consistent(cache, backend.slot_dir)  # even right after the kill, before any repair
            assert backend.alive()

        keeper = Slotkeeper(cache, tmp_path / "slotkeeper.log", backend).start()
        good = _assert_index_consistent(cache, backend.slot_dir)
        # A session whose save was logged as complete has a snapshot (a kill after the commit but before the log
        # line may add more; a kill before the commit keeps the previous one).
        completed = set(re.findall(r"saved slot \d+ as tiny/(\w+):", keeper.log_text()))
        assert completed and completed <= set(good) <= set(SESSIONS), (completed, good)
        assert not [p for p in backend.slot_dir.iterdir() if _TEMP.match(p.name)]
        with httpx.Client(base_url=keeper.url, timeout=60) as client:
            for session in sorted(good):  # each last completed snapshot restores into the real backend
                chat(client, [{"role": "user", "content": "switch away"}], "elsewhere", max_tokens=1)
                response = chat(client, history[session], session, max_tokens=1)
                assert response.status_code == 200
                assert response.headers["x-slotkeeper-cache"] == "restored"
        assert backend.alive()
        keeper.stop()
        saves = len(re.findall(r"saved slot \d+ as ", keeper.log_text()))
        print(f"{KILLS} kills, {saves} completed saves, {temporaries_seen} leftover temporaries reconciled")
    finally:
        if keeper is not None:
            keeper.stop()  # a failed assertion must not leave a slotkeeper running
        backend.stop()
