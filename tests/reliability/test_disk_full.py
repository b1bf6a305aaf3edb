"""A full disk under the slot dir (a small tmpfs): saves fail cleanly, the previous good snapshot is kept, requests
still succeed, the failure is visible to an operator, and nothing retries in a loop."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import xxhash

from tests.support import Backend, Slotkeeper, chat, saved_state_bytes, small_tmpfs, words

pytestmark = [
    pytest.mark.backend,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)"),
]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "slots", "1200k") as mount:
        yield mount


def test_disk_full_keeps_the_good_snapshot_and_serves_on(tmp_path: Path, tiny_model: Path, small_disk: Path) -> None:
    backend = Backend("binary", tiny_model, small_disk, tmp_path / "backend.log", cache_ram=0).start()
    keeper = Slotkeeper(tmp_path / "cache", tmp_path / "slotkeeper.log", backend,
                        extra_args=("--min-restore-tokens", "0")).start()
    try:
        with httpx.Client(base_url=keeper.url, timeout=60) as client:
            small = [{"role": "user", "content": "small " + words(120, 1)}]
            assert chat(client, small, "small").status_code == 200
            big = [{"role": "user", "content": "big " + words(900, 2)}]
            assert chat(client, big, "big").status_code == 200  # switching saves "small" (~270 KB): fits
            good = keeper.row("small")
            assert good is not None
            # Switching again must save "big" (~1.9 MB): the 1.2 MB disk is full.
            third = chat(client, [{"role": "user", "content": "third"}], "third")
            assert third.status_code == 200
            assert keeper.row("big") is None
            assert keeper.row("small") is not None and keeper.row("small")["checksum"] == good["checksum"]  # type: ignore[index]
            # Its file, or (kept as blocks, the default) its blocks and tail, give back the indexed bytes.
            assert xxhash.xxh3_128_hexdigest(saved_state_bytes(small_disk, good)) == good["checksum"]
            assert not [p for p in small_disk.rglob("*") if ".tmp-" in p.name]  # the partial file is gone
            current = client.get("/api/sessions/current").json()
            assert current["failed_saves"] == 1
            assert re.search(r"ERROR slotkeeper.pool: saving slot 0 as tiny/big failed", keeper.log_text())

            # The session that could not be saved still works (cold), and "small" is still restorable.
            assert chat(client, [*big, {"role": "user", "content": "more"}], "big").status_code == 200
            back = chat(client, [*small, {"role": "user", "content": "again"}], "small")
            assert back.status_code == 200 and back.headers["x-slotkeeper-cache"] == "restored"
            time.sleep(2)
            failures = len(re.findall(r"saving slot \d+ as .* failed", keeper.log_text()))
            time.sleep(2)
            assert len(re.findall(r"saving slot \d+ as .* failed", keeper.log_text())) == failures  # no retry loop
        assert backend.alive()
    finally:
        keeper.stop()
        backend.stop()
