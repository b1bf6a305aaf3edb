"""One slotkeeper over one real llama-server binary, shared by a test module: client-conformance checks need a real
backend but not a fresh one per test. Tests that prove restores use the function-scoped `stack` fixture instead."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Backend, Slotkeeper


@pytest.fixture(scope="module")
def keeper(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Slotkeeper]:
    root = tmp_path_factory.mktemp("conformance")
    backend = Backend("binary", tiny_model, root / "slots", root / "backend.log", parallel=1, cache_ram=0,
                      ctx_per_slot=8192).start()
    slotkeeper = Slotkeeper(root / "cache", root / "slotkeeper.log", backend).start()
    try:
        yield slotkeeper
    finally:
        slotkeeper.stop()
        backend.stop()
