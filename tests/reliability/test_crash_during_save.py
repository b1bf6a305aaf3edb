"""kill -9 of slotkeeper at random points while it saves: no torn file is ever in the index, a restart reconciles
the directory, and every session's last completed snapshot stays intact and restorable by the real backend."""

from __future__ import annotations

import random
import re
import shutil
import signal
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slotkeeper.cache.blockstore import BlockStore
from slotkeeper.cache.store import file_checksum
from tests.support import Backend, Slotkeeper, chat, wait_until, words

pytestmark = pytest.mark.backend
KILLS = 50
BLOCK_TOKENS = 16
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


def _temporaries(slot_dir: Path, ram: Path | None) -> list[Path]:
    return [p for d in (slot_dir, ram) if d is not None and d.is_dir() for p in d.iterdir() if _TEMP.match(p.name)]


def _assert_index_consistent(cache_dir: Path, slot_dir: Path, ram: Path | None = None) -> dict[str, str]:
    """Every indexed file (of sessions and system prompts) exists with the indexed size and checksum, and so does
    whatever its name in the RAM dir resolves to; returns session -> checksum for the sessions."""
    good = {}
    for row in _index(cache_dir):
        if row["tail_bytes"]:  # kept as KV blocks and a tail: its blocks assemble into the indexed file
            assembled = slot_dir.parent / "assembled.bin"
            n_bytes, checksum = BlockStore(slot_dir, BLOCK_TOKENS).assemble(row["filename"], assembled)
            assert n_bytes == row["n_bytes"] == assembled.stat().st_size, f"torn state: {row['filename']}"
            assert file_checksum(assembled) == checksum == row["checksum"], f"bad blocks: {row['filename']}"
            assembled.unlink()
            assert row["n_tokens"] > 0
            if row["kind"] == "session":
                good[row["session_id"]] = row["checksum"]
            continue
        path = slot_dir / row["filename"]
        assert path.is_file() and not path.is_symlink(), f"indexed file missing: {row['filename']}"
        assert path.stat().st_size == row["n_bytes"], f"torn file in the index: {row['filename']}"
        assert file_checksum(path) == row["checksum"], f"checksum mismatch in the index: {row['filename']}"
        if ram is not None and (ram / row["filename"]).exists():  # a copy, or a link to the file on disk
            assert file_checksum(ram / row["filename"]) == row["checksum"], f"bad RAM copy: {row['filename']}"
        assert row["n_tokens"] > 0
        if row["kind"] == "session":
            good[row["session_id"]] = row["checksum"]
    return good


@pytest.fixture(params=["slot-dir", "ram-dir", "blocks"])
def save_dirs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, Path | None]]:
    """(the backend's --slot-save-path, the RAM dir or None): the backend saves into the slot dir, or into a RAM dir
    on tmpfs whose saves slotkeeper copies to the slot dir (cache/ramdir.py); with "blocks", into the slot dir, kept
    as KV blocks and tails (cache/blockstore.py)."""
    if request.param in ("slot-dir", "blocks"):
        yield tmp_path / "slots", None
        return
    ram = Path(tempfile.mkdtemp(prefix="slotkeeper-test-ram-", dir="/dev/shm"))
    try:
        yield ram, ram
    finally:
        shutil.rmtree(ram, ignore_errors=True)


def test_kill_9_at_random_points_of_saving(tmp_path: Path, tiny_model: Path,
                                           save_dirs: tuple[Path, Path | None], request: pytest.FixtureRequest) -> None:
    backend_dir, ram = save_dirs
    blocks = request.node.callspec.params["save_dirs"] == "blocks"
    backend = Backend("binary", tiny_model, backend_dir, tmp_path / "backend.log", cache_ram=0).start()
    slot_dir = tmp_path / "slots"  # where the snapshots are kept, either way
    kills = KILLS if ram is None and not blocks else KILLS // 2
    block_args = ("--block-tokens", str(BLOCK_TOKENS)) if blocks else ()
    cache = tmp_path / "cache"
    rng = random.Random(2026)
    history = {s: [{"role": "system", "content": f"session {s} " + words(400, i)}] for i, s in enumerate(SESSIONS)}
    temporaries_seen = 0
    keeper: Slotkeeper | None = None
    try:
        for _kill in range(kills):
            keeper = Slotkeeper(cache, tmp_path / "slotkeeper.log", backend,
                                extra_args=("--save-idle-seconds", "0", "--min-restore-tokens", "0", *block_args),
                                disk_slot_dir=None if ram is None else slot_dir).start()
            # Right after a start, the previous run's leftovers are gone (reconcile) and the index is consistent.
            assert not _temporaries(slot_dir, ram)
            _assert_index_consistent(cache, slot_dir, ram)
            if blocks:  # no block store temporary survives a start (the sweep after it, in the background)
                assert wait_until(lambda: not [p for p in slot_dir.rglob(".*") if p.is_file()], timeout=20,
                                  interval=0.1)

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
            temporaries_seen += len(_temporaries(slot_dir, ram))
            _assert_index_consistent(cache, slot_dir, ram)  # even right after the kill, before any repair
            assert backend.alive()

        keeper = Slotkeeper(cache, tmp_path / "slotkeeper.log", backend, extra_args=block_args,
                            disk_slot_dir=None if ram is None else slot_dir).start()
        good = _assert_index_consistent(cache, slot_dir, ram)
        # A session whose save was logged as complete has a snapshot (a kill after the commit but before the log
        # line may add more; a kill before the commit keeps the previous one).
        completed = set(re.findall(r"saved slot \d+ as tiny/(\w+):", keeper.log_text()))
        assert completed and completed <= set(good) <= set(SESSIONS), (completed, good)
        assert not _temporaries(slot_dir, ram)
        with httpx.Client(base_url=keeper.url, timeout=60) as client:
            for session in sorted(good):  # each last completed snapshot restores into the real backend
                chat(client, [{"role": "user", "content": "switch away"}], "elsewhere", max_tokens=1)
                response = chat(client, history[session], session, max_tokens=1)
                assert response.status_code == 200
                assert response.headers["x-slotkeeper-cache"] == "restored"
        assert backend.alive()
        keeper.stop()
        saves = len(re.findall(r"saved slot \d+ as ", keeper.log_text()))
        if blocks:
            assert list(slot_dir.glob("*.tail")) and not list(slot_dir.glob("*.bin"))
        print(f"{kills} kills, {saves} completed saves, {temporaries_seen} leftover temporaries reconciled")
    finally:
        if keeper is not None:
            keeper.stop()  # a failed assertion must not leave a slotkeeper running
        backend.stop()
