"""Snapshot bundles: what write_bundle streams, BundleReader reads back, whatever the chunking of the upload."""

from __future__ import annotations

import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from slotkeeper.cache.bundle import BundleMeta, BundleReader, write_bundle
from slotkeeper.cache.chain import Link
from slotkeeper.errors import BadRequest
from slotkeeper.types import SnapshotKind

DATA = bytes(range(256)) * 4099  # not a multiple of the tar block size
META = BundleMeta("m", "s", SnapshotKind.SESSION, "fp", 77, len(DATA), "sum", (Link("d1", 10), Link("d2", 20)))


def bundle() -> bytes:
    return b"".join(write_bundle(META, io.BytesIO(DATA)))


async def chunked(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_a_bundle_is_a_plain_tar_archive() -> None:
    with tarfile.open(fileobj=io.BytesIO(bundle())) as tar:
        assert tar.getnames() == ["snapshot.json", "snapshot.bin"]
        member = tar.extractfile("snapshot.bin")
        assert member is not None and member.read() == DATA


@pytest.mark.parametrize("chunk", [997, 511, 512, 4096, 10**7])
async def test_read_back_in_any_chunking(tmp_path: Path, chunk: int) -> None:
    reader = BundleReader(chunked(bundle(), chunk))
    assert await reader.meta() == META
    await reader.copy_file_to(tmp_path / "out.bin", len(DATA))
    assert (tmp_path / "out.bin").read_bytes() == DATA


async def test_a_truncated_bundle_says_so(tmp_path: Path) -> None:
    reader = BundleReader(chunked(bundle()[:-1024 - 3000], 4096))
    await reader.meta()
    with pytest.raises(BadRequest, match="ends early"):
        await reader.copy_file_to(tmp_path / "out.bin", len(DATA))


async def test_a_size_that_disagrees_with_the_metadata_is_refused(tmp_path: Path) -> None:
    reader = BundleReader(chunked(bundle(), 4096))
    await reader.meta()
    with pytest.raises(BadRequest, match=r"snapshot\.json says"):
        await reader.copy_file_to(tmp_path / "out.bin", len(DATA) + 1)


async def test_something_else_is_not_a_bundle() -> None:
    other = io.BytesIO()
    with tarfile.open(fileobj=other, mode="w") as tar:
        info = tarfile.TarInfo("notes.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(BadRequest, match=r"expected snapshot\.json, found .notes\.txt."):
        await BundleReader(chunked(other.getvalue(), 100)).meta()


def test_a_bundle_carries_the_prompt_token_count_and_reads_one_without_it() -> None:
    from slotkeeper.cache.bundle import BundleMeta
    from slotkeeper.types import SnapshotKind

    meta = BundleMeta("m", "s", SnapshotKind.SESSION, "fp", 500, 10, "c", (), 120)
    data = meta.to_json()
    assert data["prompt_tokens"] == 120 and BundleMeta.from_json(data) == meta
    del data["prompt_tokens"]  # a bundle exported before the count was kept
    assert BundleMeta.from_json(data).n_prompt == 0
