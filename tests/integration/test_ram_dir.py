"""The RAM dir against a real llama-server whose --slot-save-path is on tmpfs (attach mode with --ram-dir, as launch
and embedded modes set it up themselves): saves land in RAM and are kept on disk, restores come from the RAM copy
or through a link to the disk file and are proven by the backend's cache_n, and a RAM dir too full for a save
sends that save to disk instead."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import xxhash

from slotkeeper.cache import ramdir as ramdir_mod
from slotkeeper.cache.budget import DiskBudget
from slotkeeper.cache.events import CacheEvents
from slotkeeper.cache.ramdir import RamDir
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.store import SnapshotStore, file_checksum
from slotkeeper.types import SessionKey
from slotkeeper.upstream.client import UpstreamClient
from tests.support import Backend, Conversation, Slotkeeper, saved_state_bytes, small_tmpfs, timings, words

pytestmark = pytest.mark.backend


@pytest.fixture
def ram_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="slotkeeper-test-ram-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(tmp_path: Path, tiny_model: Path, ram_dir: Path, *options: str) -> tuple[Backend, Slotkeeper]:
    backend = Backend("binary", tiny_model, ram_dir, tmp_path / "backend.log", cache_ram=0).start()
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log", backend,
                        extra_args=("--min-restore-tokens", "0", *options), disk_slot_dir=tmp_path / "slots")
    try:
        keeper.start()
    except BaseException:
        backend.stop()
        raise
    return backend, keeper


@pytest.mark.parametrize("stored_as", ["file", "blocks"])
def test_saves_land_in_ram_are_kept_on_disk_and_restore_from_the_copy(tmp_path: Path, tiny_model: Path,
                                                                      ram_dir: Path, stored_as: str) -> None:
    """Kept as a whole file, or as blocks and a tail (the default): either way the RAM copy is the file the backend
    wrote, and what is on disk gives back the same bytes."""
    backend, keeper = start(tmp_path, tiny_model, ram_dir, *(("--block-tokens", "0") if stored_as == "file" else ()))
    slots = tmp_path / "slots"
    try:
        with httpx.Client(base_url=keeper.url, timeout=120) as client:
            alice, bob = Conversation(client, "alice", 800, 1), Conversation(client, "bob", 800, 2)
            alice.turn()
            bob.turn()  # saves alice (into RAM, then copied to disk)
            row = keeper.row("alice")
            assert row is not None
            copy = ram_dir / row["filename"]
            assert copy.is_file() and not copy.is_symlink()
            kept = saved_state_bytes(slots, row)
            assert xxhash.xxh3_128_hexdigest(kept) == file_checksum(copy) == row["checksum"]
            assert len(kept) == row["n_bytes"]
            assert (slots / row["filename"]).is_file() == (stored_as == "file")
            assert (row["tail_bytes"] > 0) == (stored_as == "blocks")
            assert not [p for p in [*ram_dir.iterdir(), *slots.iterdir()] if ".tmp-" in p.name]

            back = alice.turn()  # saves bob, restores alice from her RAM copy
            assert back.headers["x-slotkeeper-cache"] == "restored"
            assert timings(back)["cache_n"] >= row["n_tokens"] - 4
            bob_row = keeper.row("bob")
            assert bob_row is not None and (ram_dir / bob_row["filename"]).is_file()
            assert "RAM dir" in keeper.log_text()
            disk = client.get("/api/sessions/disk").json()
            rows = keeper.index_rows()  # the sessions' snapshots and their system prompts'
            assert disk["ram"]["dir"] == str(ram_dir) and disk["ram"]["copies"] == len(rows) >= 2
            assert disk["ram"]["bytes"] == sum(r["n_bytes"] for r in rows)
            metrics = client.get("/metrics").text
            gauge = re.search(r"^slotkeeper_ram_copy_bytes (\S+)$", metrics, re.MULTILINE)
            assert gauge is not None and float(gauge.group(1)) == disk["ram"]["bytes"]
    finally:
        keeper.stop()
        backend.stop()
    # slotkeeper did not start this backend: the RAM dir is the operator's, and stays.
    assert ram_dir.is_dir()


def test_with_no_room_for_copies_restores_go_through_links_to_disk(tmp_path: Path, tiny_model: Path,
                                                                   ram_dir: Path) -> None:
    backend, keeper = start(tmp_path, tiny_model, ram_dir, "--ram-budget", "1")
    slots = tmp_path / "slots"
    try:
        with httpx.Client(base_url=keeper.url, timeout=120) as client:
            alice, bob = Conversation(client, "alice", 800, 1), Conversation(client, "bob", 800, 2)
            alice.turn()
            bob.turn()
            row = keeper.row("alice")
            assert row is not None
            link = ram_dir / row["filename"]
            assert link.is_symlink() and os.readlink(link) == str(slots / row["filename"])
            assert not [p for p in ram_dir.iterdir() if p.is_file() and not p.is_symlink()]
            back = alice.turn()
            assert back.headers["x-slotkeeper-cache"] == "restored"
            assert timings(back)["cache_n"] >= row["n_tokens"] - 4
    finally:
        keeper.stop()
        backend.stop()


@pytest.fixture
def small_ram(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    with small_tmpfs(tmp_path / "small-ram", "600k") as mount:
        yield mount


def test_a_ram_dir_without_room_sends_saves_to_disk(tmp_path: Path, tiny_model: Path, small_ram: Path) -> None:
    backend, keeper = start(tmp_path, tiny_model, small_ram)
    slots = tmp_path / "slots"
    try:
        with httpx.Client(base_url=keeper.url, timeout=120) as client:
            alice, bob = Conversation(client, "alice", 900, 1), Conversation(client, "bob", 900, 2)
            alice.turn()
            assert bob.turn().status_code == 200  # a 600 KB tmpfs has no room: alice is saved straight to disk
            row = keeper.row("alice")
            assert row is not None and len(saved_state_bytes(slots, row)) == row["n_bytes"]
            assert (small_ram / row["filename"]).is_symlink() or not (small_ram / row["filename"]).exists()
            back = alice.turn()
            assert back.headers["x-slotkeeper-cache"] == "restored"
            assert timings(back)["cache_n"] >= row["n_tokens"] - 4
            assert client.get("/api/sessions/current").json()["failed_saves"] == 0
            # Kept as blocks: no room to put it back together in RAM either, so it was, in the slot dir, and is gone.
            assert "it is assembled in the slot dir" in keeper.log_text()
            assert not (slots / row["filename"]).exists()
    finally:
        keeper.stop()
        backend.stop()


async def test_a_save_that_fills_the_ram_dir_is_made_again_on_disk(
    tmp_path: Path, tiny_model: Path, small_ram: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The room check passes (no headroom asked), the backend's write then runs out of space in the tmpfs: the save
    is made once more, into the slot dir, and is committed and restorable."""
    monkeypatch.setattr(ramdir_mod, "_HEADROOM", 0)
    backend = Backend("binary", tiny_model, small_ram, tmp_path / "backend.log", cache_ram=0).start()
    slots = tmp_path / "slots"
    store = SnapshotStore(slots, tmp_path / "index.db", RamDir(small_ram, slots, 1 << 30))
    client = UpstreamClient(backend.url)
    try:
        prompt = {"prompt": words(900, 3), "n_predict": 1, "id_slot": 0, "cache_prompt": True}
        first = await client.post_json("/completion", prompt)
        persister = Snapshots(store)
        persister.attach(client, "f" * 16, DiskBudget(), CacheEvents(), lambda: ())
        key = SessionKey("tiny", "alice")
        assert await persister.save(0, key, []) > 0
        snapshot = store.checked_snapshot(key, "f" * 16)
        assert snapshot is not None and snapshot.n_tokens >= first["timings"]["prompt_n"]
        assert "into the RAM dir failed" in caplog.text and persister.failed_saves == 0
        assert (slots / snapshot.filename).stat().st_size == snapshot.n_bytes > 600 * 1024
        await client.slot_action(0, "erase")
        restored = await client.slot_action(0, "restore", snapshot.filename)  # through the link to disk
        assert restored.n_tokens == snapshot.n_tokens
        again = await client.post_json("/completion", prompt)
        assert again["timings"]["cache_n"] >= snapshot.n_tokens - 1
    finally:
        await client.aclose()
        store.close()
        backend.stop()


class _BackendSeeingAnotherSlotDir(Backend):
    """llama-server in a mount namespace of its own where the slot dir is an empty tmpfs: a container that mounts
    the slot dir at another path (or not at all), as far as the RAM dir's links are concerned."""

    hidden: Path = Path("/nonexistent")

    def argv(self) -> list[str]:
        script = f'mount -t tmpfs tmpfs "{self.hidden}" && exec "$0" "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, *super().argv()]


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root (CI runs as root)")
def test_a_backend_that_cannot_follow_the_links_is_refused_at_start(tmp_path: Path, tiny_model: Path,
                                                                   ram_dir: Path) -> None:
    """Restores of snapshots not kept in RAM go through links into the slot dir; a backend that cannot follow them
    would fail every such restore. slotkeeper finds out at start and says what to change."""
    slot_dir = tmp_path / "disk-slots"
    slot_dir.mkdir()
    backend = _BackendSeeingAnotherSlotDir("binary", tiny_model, ram_dir, tmp_path / "backend.log", cache_ram=0)
    backend.hidden = slot_dir
    backend.start()
    try:
        keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log", backend, disk_slot_dir=slot_dir)
        with pytest.raises(RuntimeError, match="exited with code"):
            keeper.start(timeout=60)
        assert "must see the slot dir at the same path" in keeper.log_text()
        assert os.listdir(slot_dir) == [] and not [n for n in os.listdir(ram_dir) if n.startswith("slotkeeper-probe")]
    finally:
        backend.stop()
