"""Backend fingerprints: the model file's identity plus the slot layout that slot files depend on.

A snapshot is restored only into a backend with the same fingerprint: same-shape foreign models restore silently.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slotkeeper.cache.store import SnapshotStore

_HEAD_BYTES = 4 * 1024 * 1024  # covers the GGUF header and metadata of any ordinary model
_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024


def model_file_identity(path: Path, store: SnapshotStore | None = None) -> str:
    """Hash of size, the first megabytes (header, metadata, vocab) and evenly spaced tensor blocks.

    Reading a few MB instead of the whole file keeps start-up fast for 20 GB models; the result is cached in the
    index by (path, size, mtime), so an unchanged file is not read at all.
    """
    st = path.stat()
    resolved = str(path.resolve())
    if store is not None:
        cached = store.cached_identity(resolved, st.st_size, st.st_mtime_ns)
        if cached is not None:
            return cached
    digest = hashlib.sha256()
    digest.update(str(st.st_size).encode())
    with path.open("rb") as fh:
        digest.update(fh.read(_HEAD_BYTES))
        if st.st_size > _HEAD_BYTES:
            span = st.st_size - _HEAD_BYTES
            for i in range(_SAMPLES + 1):
                fh.seek(_HEAD_BYTES + span * i // _SAMPLES - (_SAMPLE_BYTES if i == _SAMPLES else 0))
                digest.update(fh.read(_SAMPLE_BYTES))
    identity = "file:" + digest.hexdigest()
    if store is not None:
        store.remember_identity(resolved, st.st_size, st.st_mtime_ns, identity)
    return identity


def remote_model_identity(props: Mapping[str, Any], model_meta: Mapping[str, Any]) -> str:
    """A weaker identity for a model file we cannot read: what the server reports about it."""
    described = {"model_path": props.get("model_path"), "meta": dict(model_meta)}
    return "meta:" + hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def local_model_path(props: Mapping[str, Any]) -> Path | None:
    """The model file named by /props when it is readable from here (slotkeeper on the backend's machine)."""
    raw = props.get("model_path")
    if not isinstance(raw, str) or not raw:
        return None
    path = Path(raw)
    return path if path.is_file() and os.access(path, os.R_OK) else None


def backend_fingerprint(model_identity: str, layout: Mapping[str, Any]) -> str:
    """16 hex digits over the model identity and the slot layout (slots, per-slot context, build, KV settings)."""
    blob = json.dumps({"model": model_identity, "layout": dict(layout)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
