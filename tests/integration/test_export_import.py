"""Moving a session between slotkeepers with `slotkeeper sessions export` / `import`: the imported snapshot restores
and is reused; a bundle from another model, a damaged or truncated bundle, and an id clash are refused cleanly."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest

from tests.conftest import Stack
from tests.support import REPO, Backend, Conversation, Slotkeeper, chat, timings

pytestmark = pytest.mark.backend


def cli(keeper: Slotkeeper, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slotkeeper.cli", "sessions", *args, "--url", keeper.url],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def saved_conversation(keeper: Slotkeeper, client: httpx.Client) -> Conversation:
    conv = Conversation(client, "moving", size=800, seed=3)
    conv.turn()
    conv.turn()
    Conversation(client, "elsewhere", size=200, seed=8).turn()  # saves "moving"
    assert keeper.row("moving") is not None
    return conv


@pytest.fixture
def backend_kind() -> str:
    return "binary"


def test_export_then_import_on_another_slotkeeper_restores_the_session(stack: Stack, client_for,
                                                                       tmp_path: Path) -> None:
    backend = stack.backend(cache_ram=0)
    source = stack.slotkeeper(backend)
    conv = saved_conversation(source, client_for(source))
    row = source.row("moving")
    assert row is not None
    bundle = tmp_path / "moving.tar"
    exported = cli(source, "export", "moving", "-o", str(bundle))
    assert exported.returncode == 0, exported.stderr
    with tarfile.open(bundle) as tar:
        assert tar.getnames() == ["snapshot.json", "snapshot.bin"]
        assert tar.getmember("snapshot.bin").size == row["n_bytes"]
    source.stop()

    # Another slotkeeper with its own index and slot dir, over a server of the same model and layout.
    other = Backend("binary", stack.model, tmp_path / "other-slots", tmp_path / "other-backend.log").start()
    try:
        target = Slotkeeper(tmp_path / "other-cache", tmp_path / "other.log", other).start()
        try:
            imported = cli(target, "import", str(bundle))
            assert imported.returncode == 0, imported.stderr
            assert "imported session snapshot moving" in imported.stdout
            [new_row] = target.index_rows()
            assert (new_row["n_tokens"], new_row["n_bytes"], new_row["checksum"]) == (
                row["n_tokens"], row["n_bytes"], row["checksum"])
            response = chat(client_for(target), conv.messages, "moving")
            assert response.headers["x-slotkeeper-cache"] == "restored"
            assert timings(response)["cache_n"] >= row["n_tokens"] - 8

            again = cli(target, "import", str(bundle))
            assert again.returncode == 1 and "exists already" in again.stderr
            renamed = cli(target, "import", str(bundle), "--as", "copy-of-moving")
            assert renamed.returncode == 0 and target.row("copy-of-moving") is not None
        finally:
            target.stop()
    finally:
        other.stop()


def test_bundles_from_another_model_or_damaged_ones_are_refused(stack: Stack, client_for, tmp_path: Path,
                                                                foreign_model: Path) -> None:
    backend = stack.backend(cache_ram=0)
    keeper = stack.slotkeeper(backend)
    saved_conversation(keeper, client_for(keeper))
    with httpx.Client(base_url=keeper.url, timeout=60) as http:
        good = http.get("/api/sessions/moving/export").content
        missing = http.get("/api/sessions/nobody/export")
        assert missing.status_code == 404

        before = sorted(p.name for p in backend.slot_dir.iterdir())
        truncated = http.post("/api/sessions/import", params={"as": "t"}, content=good[: len(good) // 2])
        assert truncated.status_code == 400 and "ends early" in truncated.json()["error"]["message"]
        damaged = bytearray(good)
        damaged[len(good) // 2] ^= 0xFF
        corrupt = http.post("/api/sessions/import", params={"as": "d"}, content=bytes(damaged))
        assert corrupt.status_code == 400 and "checksum" in corrupt.json()["error"]["message"]
        junk = http.post("/api/sessions/import", content=b"not a tar at all" * 100)
        assert junk.status_code == 400
        assert sorted(p.name for p in backend.slot_dir.iterdir()) == before  # no temporaries left behind

    # A server of a model with identical shapes but other weights refuses the bundle by its fingerprint.
    foreign = Backend("binary", foreign_model, tmp_path / "foreign-slots", tmp_path / "foreign.log").start()
    try:
        target = Slotkeeper(tmp_path / "foreign-cache", tmp_path / "foreign-keeper.log", foreign).start()
        try:
            with httpx.Client(base_url=target.url, timeout=60) as http:
                refused = http.post("/api/sessions/import", content=io.BytesIO(good).read())
            assert refused.status_code == 400
            assert "made by another model" in refused.json()["error"]["message"]
            assert target.index_rows() == []
        finally:
            target.stop()
    finally:
        foreign.stop()
