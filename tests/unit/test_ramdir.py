"""The RAM dir in front of the slot dir (cache/ramdir.py): saves that land in RAM are copied to disk and kept as
copies within the budget; every snapshot the store hands out resolves in the RAM dir, as a checked copy or a link
to its checked file on disk; removal, quarantine and start-up clean both places."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slotkeeper import files as files_mod
from slotkeeper.cache.ramdir import RamDir
from slotkeeper.cache.store import SnapshotStore, file_checksum
from slotkeeper.config import Settings
from slotkeeper.files import copy_durably
from slotkeeper.types import SessionKey, Snapshot
from slotkeeper.upstream.launchargs import plan_launch

FP = "0123456789abcdef"
MiB = 1024 * 1024


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "slots", tmp_path / "ram"


def make_store(tmp_path: Path, dirs: tuple[Path, Path], budget: int = 64 * MiB) -> SnapshotStore:
    slot_dir, ram_path = dirs
    return SnapshotStore(slot_dir, tmp_path / "index.db", RamDir(ram_path, slot_dir, budget))


@pytest.fixture
def store(tmp_path: Path, dirs: tuple[Path, Path]):
    s = make_store(tmp_path, dirs)
    yield s
    s.close()


def key(session: str) -> SessionKey:
    return SessionKey("m", session)


def backend_save(store: SnapshotStore, k: SessionKey, data: bytes, n_tokens: int = 10) -> tuple[str, bool]:
    """What a save does: prepare the name, have 'the backend' write it (open for writing follows a link, as
    llama-server's fopen does), and return (temp name, whether it landed in RAM)."""
    temp = store.temp_name(k, FP)
    in_ram = store.prepare_save(temp)
    with open(store.backend_dir / temp, "wb") as fh:
        fh.write(data)
    return temp, in_ram


def save(store: SnapshotStore, k: SessionKey, data: bytes, n_tokens: int = 10) -> Snapshot:
    temp, _ = backend_save(store, k, data, n_tokens)
    return store.commit(k, temp, FP, n_tokens, n_written=len(data))


def backend_reads(store: SnapshotStore, snapshot: Snapshot) -> bytes:
    """What the backend reads when told to restore the snapshot's name."""
    return (store.backend_dir / snapshot.filename).read_bytes()


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 4 * MiB, 4 * MiB + 3, 9 * MiB + 100])
def test_copy_durably_copies_every_byte_and_hashes_them(tmp_path: Path, size: int) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(size))
    target = tmp_path / "out" / "dst.bin"
    target.parent.mkdir()
    n, checksum = copy_durably(source, target)
    assert n == size == target.stat().st_size
    assert target.read_bytes() == source.read_bytes()
    assert checksum == file_checksum(source)
    assert target.stat().st_mode & 0o777 == 0o600


def test_copy_durably_falls_back_where_direct_io_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(5000))
    real_open = os.open

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(files_mod.os, "open", no_direct)
    n, checksum = copy_durably(source, tmp_path / "dst.bin")
    assert (n, checksum) == (5000, file_checksum(source))
    assert (tmp_path / "dst.bin").read_bytes() == source.read_bytes()


def test_copy_durably_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(5 * MiB))

    def full(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files_mod.os, "write", full)
    with pytest.raises(OSError):
        copy_durably(source, tmp_path / "dst.bin")
    assert not (tmp_path / "dst.bin").exists()


def test_a_save_in_ram_is_copied_to_disk_and_kept(store: SnapshotStore, dirs: tuple[Path, Path]) -> None:
    slot_dir, ram_path = dirs
    data = os.urandom(3 * MiB + 5)
    temp, in_ram = backend_save(store, key("a"), data)
    assert in_ram and (ram_path / temp).is_file() and not (slot_dir / temp).exists()
    snap = store.commit(key("a"), temp, FP, 10, n_written=len(data))
    assert (slot_dir / snap.filename).read_bytes() == data  # kept on disk
    copy = ram_path / snap.filename
    assert copy.is_file() and not copy.is_symlink() and copy.read_bytes() == data  # and as a copy in RAM
    assert snap.checksum == file_checksum(slot_dir / snap.filename)
    assert not (ram_path / temp).exists() and not (slot_dir / temp).exists()
    assert store.checked_snapshot(key("a"), FP) == snap
    assert copy.is_file() and not copy.is_symlink()  # restored from the copy
    assert store.ram_usage() == (1, len(data))


def test_a_newer_save_replaces_the_copy(store: SnapshotStore, dirs: tuple[Path, Path]) -> None:
    slot_dir, ram_path = dirs
    first = save(store, key("a"), b"one" * 1000)
    second = save(store, key("a"), b"two" * 1000)
    assert not (ram_path / first.filename).exists() and not (slot_dir / first.filename).exists()
    assert backend_reads(store, second) == b"two" * 1000


def test_copies_beyond_the_budget_become_links(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    slot_dir, ram_path = dirs
    store = make_store(tmp_path, dirs, budget=2 * MiB + 1)
    try:
        snaps = [save(store, key(s), os.urandom(MiB)) for s in ("a", "b", "c")]
        assert (ram_path / snaps[0].filename).is_symlink()  # the least recently used
        assert os.readlink(ram_path / snaps[0].filename) == str(slot_dir / snaps[0].filename)
        assert all((ram_path / s.filename).is_file() and not (ram_path / s.filename).is_symlink() for s in snaps[1:])
        assert store.ram_usage() == (2, 2 * MiB)
        # Every snapshot still resolves, to the same bytes, and passes the checks.
        for s in snaps:
            assert store.checked_snapshot(key(s.session_id), FP) is not None
            assert backend_reads(store, s) == (slot_dir / s.filename).read_bytes()
        # A restore is a use: "b" is now the oldest, and goes first on the next save.
        store.mark_used(key("a"))
        store.mark_used(key("c"))
        save(store, key("d"), os.urandom(MiB))
        assert (ram_path / snaps[1].filename).is_symlink()
    finally:
        store.close()


def test_a_zero_budget_keeps_no_copies_but_saves_still_land_in_ram(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    _slot_dir, ram_path = dirs
    store = make_store(tmp_path, dirs, budget=0)
    try:
        data = os.urandom(MiB)
        temp, in_ram = backend_save(store, key("a"), data)
        assert in_ram
        snap = store.commit(key("a"), temp, FP, 10, n_written=len(data))
        assert (ram_path / snap.filename).is_symlink() and backend_reads(store, snap) == data
    finally:
        store.close()


def test_a_changed_copy_is_not_restored(store: SnapshotStore, dirs: tuple[Path, Path],
                                        caplog: pytest.LogCaptureFixture) -> None:
    _slot_dir, ram_path = dirs
    data = os.urandom(MiB)
    snap = save(store, key("a"), data)
    with open(ram_path / snap.filename, "r+b") as fh:  # same size, other content
        fh.write(b"\0" * 16)
    assert store.checked_snapshot(key("a"), FP) == snap
    assert (ram_path / snap.filename).is_symlink()  # the checked file on disk instead
    assert backend_reads(store, snap) == data
    assert "does not match its snapshot" in caplog.text


def test_a_lost_copy_becomes_a_link(store: SnapshotStore, dirs: tuple[Path, Path]) -> None:
    _slot_dir, ram_path = dirs
    data = os.urandom(MiB)
    snap = save(store, key("a"), data)
    (ram_path / snap.filename).unlink()  # e.g. the RAM dir was emptied
    assert store.checked_snapshot(key("a"), FP) == snap
    assert backend_reads(store, snap) == data


def test_a_damaged_disk_file_under_a_link_is_quarantined(store: SnapshotStore, dirs: tuple[Path, Path]) -> None:
    slot_dir, ram_path = dirs
    snap = save(store, key("a"), os.urandom(MiB))
    (ram_path / snap.filename).unlink()
    with open(slot_dir / snap.filename, "r+b") as fh:
        fh.truncate(1000)
    assert store.checked_snapshot(key("a"), FP) is None
    assert store.get(key("a")) is None
    assert not (ram_path / snap.filename).exists()


def test_a_save_without_room_in_ram_goes_to_disk(store: SnapshotStore, dirs: tuple[Path, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    slot_dir, ram_path = dirs
    assert store.ram is not None
    monkeypatch.setattr(store.ram, "_largest", 1 << 60)  # no tmpfs has room for twice that
    data = os.urandom(MiB)
    temp, in_ram = backend_save(store, key("a"), data)
    assert not in_ram and (ram_path / temp).is_symlink() and (slot_dir / temp).is_file()
    snap = store.commit(key("a"), temp, FP, 10, n_written=len(data))
    assert not os.path.lexists(ram_path / temp)
    assert (slot_dir / snap.filename).read_bytes() == data
    assert store.checked_snapshot(key("a"), FP) == snap and backend_reads(store, snap) == data


def test_a_torn_save_in_ram_is_never_indexed(store: SnapshotStore, dirs: tuple[Path, Path]) -> None:
    slot_dir, ram_path = dirs
    temp, _ = backend_save(store, key("a"), b"x" * 1000)
    with pytest.raises(Exception, match="backend wrote 2000"):
        store.commit(key("a"), temp, FP, 10, n_written=2000)
    assert store.get(key("a")) is None
    assert not os.listdir(ram_path) and not [n for n in os.listdir(slot_dir) if n.endswith(".bin")]


def test_delete_and_discard_clean_both_places(store: SnapshotStore, dirs: tuple[Path, Path]) -> None:
    slot_dir, ram_path = dirs
    snap = save(store, key("a"), b"a" * 5000)
    store.delete(key("a"))
    assert not os.path.lexists(ram_path / snap.filename) and not (slot_dir / snap.filename).exists()
    temp, _ = backend_save(store, key("b"), b"b" * 5000)
    store.discard_temp(temp)
    assert not os.path.lexists(ram_path / temp)


def test_start_up_keeps_indexed_copies_and_removes_the_rest(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    slot_dir, ram_path = dirs
    store = make_store(tmp_path, dirs)
    data = os.urandom(MiB)
    snap = save(store, key("a"), data)
    backend_save(store, key("b"), b"half a save")  # a crash before its commit
    stray = "f" * 40 + "-0badf00d.bin"
    (ram_path / stray).write_bytes(b"unindexed")
    (ram_path / ".link-12345678").symlink_to(slot_dir / "nothing")
    (ram_path / "not-ours.txt").write_text("left alone")
    store.close()

    store = make_store(tmp_path, dirs)  # a new process: nothing hashed yet
    try:
        report = store.reconcile()
        assert sorted(os.listdir(ram_path)) == sorted([snap.filename, "not-ours.txt"])
        assert report.temporaries_removed + report.orphans_removed >= 3
        assert store.checked_snapshot(key("a"), FP) == snap  # the copy is hashed once, then used
        assert (ram_path / snap.filename).is_file() and not (ram_path / snap.filename).is_symlink()
    finally:
        store.close()


def test_remove_all_empties_the_ram_dir(store: SnapshotStore, dirs: tuple[Path, Path]) -> None:
    slot_dir, ram_path = dirs
    snap = save(store, key("a"), b"a" * 5000)
    assert store.ram is not None
    store.ram.remove_all()
    assert not ram_path.exists() and (slot_dir / snap.filename).exists()


# -- settings and launch ------------------------------------------------------------------------------------------


def test_the_ram_dir_is_automatic_when_slotkeeper_starts_the_backend(tmp_path: Path) -> None:
    embedded = Settings(cache_dir=tmp_path)
    ram = embedded.effective_ram_dir()
    assert ram is not None and ram.parent == Path(f"/dev/shm/slotkeeper-{os.getuid()}")
    other = Settings(cache_dir=tmp_path / "other").effective_ram_dir()
    assert other is not None and other != ram  # one per slot dir
    launch = Settings(cache_dir=tmp_path, launch_command=("llama-server", "-m", "x.gguf"))
    assert launch.effective_ram_dir() is not None
    assert Settings(cache_dir=tmp_path, ram_budget=0).effective_ram_dir() is None
    attach = Settings(cache_dir=tmp_path, upstream="http://127.0.0.1:8080", slot_dir=tmp_path / "s")
    assert attach.effective_ram_dir() is None
    given = Settings(cache_dir=tmp_path, upstream="http://127.0.0.1:8080", slot_dir=tmp_path / "s",
                     ram_dir=Path("/dev/shm/mine"))
    assert given.effective_ram_dir() == Path("/dev/shm/mine")
    assert Settings(ram_budget=5).effective_ram_budget == 5
    assert 0 < Settings().effective_ram_budget <= 8 * 1024**3


def test_the_ram_dir_and_the_slot_dir_must_differ(tmp_path: Path) -> None:
    settings = Settings(upstream="http://127.0.0.1:8080", slot_dir=tmp_path / "s", ram_dir=tmp_path / "s")
    with pytest.raises(ValueError, match="give them different directories"):
        settings.validate()


def test_a_launch_saves_into_the_ram_dir_and_keeps_the_commands_dir_for_snapshots(tmp_path: Path) -> None:
    command = ["llama-server", "-m", "m.gguf", "--slot-save-path=/srv/slots", "-np", "2"]
    plan = plan_launch(command, tmp_path / "default", lambda: 9999, Path("/dev/shm/r"))
    assert plan.slot_dir == Path("/srv/slots")
    assert "/srv/slots" not in plan.argv and "--slot-save-path=/srv/slots" not in plan.argv
    assert plan.argv[plan.argv.index("--slot-save-path") + 1] == "/dev/shm/r"
    assert plan.argv.count("--slot-save-path") == 1 and "-np" in plan.argv
    without = plan_launch(["llama-server", "-m", "m.gguf"], tmp_path / "default", lambda: 9999)
    assert without.argv[without.argv.index("--slot-save-path") + 1] == str(tmp_path / "default")


def test_a_copy_that_cannot_be_kept_leaves_the_snapshot_on_disk(store: SnapshotStore, dirs: tuple[Path, Path],
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    slot_dir, ram_path = dirs
    assert store.ram is not None

    def fails(*args: object) -> None:
        raise OSError(2, "No such file or directory")

    monkeypatch.setattr(store.ram, "keep_copy", fails)
    data = os.urandom(MiB)
    snap = save(store, key("a"), data)
    assert (slot_dir / snap.filename).read_bytes() == data
    assert not [n for n in os.listdir(ram_path) if ".tmp-" in n]
    assert "keeping a RAM copy" in caplog.text
    assert store.checked_snapshot(key("a"), FP) == snap and backend_reads(store, snap) == data
