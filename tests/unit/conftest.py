"""Fixtures of the pool and service tests: a slot directory and a real SnapshotStore over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from slotkeeper.cache.store import SnapshotStore


@pytest.fixture
def slot_dir(tmp_path: Path) -> Path:
    return tmp_path / "slots"


@pytest.fixture
def store(tmp_path: Path, slot_dir: Path) -> Iterator[SnapshotStore]:
    s = SnapshotStore(slot_dir, tmp_path / "index" / "index.db")
    yield s
    s.close()
