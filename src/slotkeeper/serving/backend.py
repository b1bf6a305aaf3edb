"""Discovering an attached or embedded backend: its model, slots, per-slot context and fingerprint.

Refuses a backend that cannot save slots, and checks that its --slot-save-path is the directory we were given.

The fingerprint names everything a saved state's KV bytes depend on: the model file, the build, the slot layout,
the options of a launched command that change the KV (launchargs.kv_arguments), the LoRA adapters the server
reports, and the KV setting its probe shows (cache/kvprobe.py: the K/V types and layout exactly, and rope, adapters
and control vectors through the values), so that a state saved under one setting is never restored under another.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slotkeeper.cache.capability import (
    ArchKind,
    Capability,
    arch_kind,
    build_number,
    checkpoints_by_build,
    read_gguf_metadata,
)
from slotkeeper.cache.fingerprint import (
    backend_fingerprint,
    local_model_path,
    remote_model_identity,
)
from slotkeeper.cache.kvprobe import KvProbe, probe_tokens, read_probe
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.errors import SlotkeeperError, UpstreamError
from slotkeeper.types import BackendInfo
from slotkeeper.upstream.client import UpstreamClient

log = logging.getLogger("slotkeeper.backend")


class BackendNotUsable(SlotkeeperError):
    """The backend is up but cannot do what slotkeeper needs; the message says what to change."""


async def discover(client: UpstreamClient, snapshots: Snapshots, alias: str | None,
                   kv_settings: Sequence[str] = ()) -> BackendInfo:
    props: dict[str, Any] = await client.get_json("/props")
    slots: list[dict[str, Any]] = await client.get_json("/slots")
    models: dict[str, Any] = await client.get_json("/v1/models")
    await _check_slot_actions(client)
    await _check_slot_dir(client, snapshots.backend_dir, "--ram-dir" if snapshots.has_ram_dir else "--slot-dir")
    if snapshots.has_ram_dir:
        await _check_links(client, snapshots.backend_dir, snapshots.slot_dir)

    n_slots = int(props.get("total_slots") or len(slots) or 1)
    n_ctx_slot = int(slots[0].get("n_ctx") or props["default_generation_settings"]["n_ctx"])
    model_path = str(props.get("model_path") or "")
    meta = _own_entry(models.get("data") or [{}], client.model).get("meta") or {}
    local = local_model_path(props)
    if local is not None:
        identity = await asyncio.to_thread(snapshots.model_identity, local)
    else:
        identity = remote_model_identity(props, meta)
        log.warning(
            "the model file %r is not readable from here: the fingerprint uses what the server reports about it, "
            "which cannot tell apart two models of the same shape", model_path,
        )
    build = str(props.get("build_info") or "")
    layout: dict[str, Any] = {"n_slots": n_slots, "n_ctx_slot": n_ctx_slot, "build": build,
                              "kv": list(kv_settings), "lora": await _lora_adapters(client)}
    base = backend_fingerprint(identity, layout)
    setting = await kv_setting(client, snapshots, base, meta)
    return BackendInfo(
        url=client.base_url,
        model_id=alias or _model_id(props),
        model_path=model_path,
        n_slots=n_slots,
        n_ctx_slot=n_ctx_slot,
        build_info=build,
        fingerprint=kv_fingerprint(base, setting),
        props=props,
        meta=meta,
        kv_base=base,
    )


def _own_entry(entries: list[Any], model: str | None) -> dict[str, Any]:
    """The backend's own entry of its /v1/models: the first, or (a router's list of all its models) the model's."""
    own = [e for e in entries if isinstance(e, dict) and (model is None or e.get("id") == model)]
    return own[0] if own else {}


def kv_fingerprint(base: str, setting: str) -> str:
    """The fingerprint of a backend of `base` (model, build, layout, options) running the KV setting `setting`."""
    return hashlib.sha256(f"{base}|kv-setting {setting}".encode()).hexdigest()[:16]


async def kv_setting(client: UpstreamClient, snapshots: Snapshots, base: str, meta: Mapping[str, Any]) -> str:
    """Which KV setting the backend runs, by its probe (made in slot 0, which must be free), among those seen with
    this model and layout (its name: kvprobe.py); when the probe cannot be made, a setting of its own (no state
    saved before is then restored)."""
    probe = await _probe(client, snapshots, int(meta.get("n_vocab") or 0))
    if probe is None:
        return "unprobed-" + secrets.token_hex(4)
    setting = await asyncio.to_thread(snapshots.kv_setting, base, probe)
    log.info("the backend's KV: %s (setting %s of this model and layout)", probe.layout, setting)
    return setting


async def _probe(client: UpstreamClient, snapshots: Snapshots, n_vocab: int) -> KvProbe | None:
    """Prefill the probe's prompt into slot 0, save it, read the file; the slot is erased after."""
    name = f"slotkeeper-probe-{secrets.token_hex(4)}.bin"
    path = snapshots.backend_dir / name
    try:
        await client.post_json("/completion", {"prompt": probe_tokens(max(n_vocab, 2)), "n_predict": 0,
                                               "id_slot": 0, "cache_prompt": False}, timeout=120.0)
        await client.post_json("/slots/0?action=save", {"filename": name}, timeout=60.0)
        return await asyncio.to_thread(read_probe, path)
    except (SlotkeeperError, OSError, ValueError, struct.error) as exc:
        log.warning("could not probe the backend's KV settings (%s): states saved before this start are not "
                    "restored, since they may have been made under other settings", exc)
        return None
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        with contextlib.suppress(SlotkeeperError):
            await client.post_json("/slots/0?action=erase", {}, timeout=15.0)


async def _lora_adapters(client: UpstreamClient) -> list[Any]:
    """The LoRA adapters the server has loaded, with their scales (none, or an older server without the route)."""
    try:
        found = await client.get_json("/lora-adapters")
    except SlotkeeperError:
        return []
    if not isinstance(found, list):
        return []
    return [[str(a.get("path") or a.get("id")), a.get("scale")] for a in found if isinstance(a, dict)]


def capability_of(props: Any, embedded: bool = False) -> Capability:
    """What restores can give on this backend: the model's architecture (from its GGUF file, when readable from
    here) and whether the build keeps context checkpoints in slot files (from its build number; a saved file may
    tell later, see SlotPool). The embedded server reports no build number, but its package version carries it."""
    build = str(props.get("build_info") or "")
    if embedded and build_number(build) is None:
        build = _xllamacpp_build() or build
    local = local_model_path(props)
    arch, kind = "", ArchKind.UNKNOWN
    if local is not None:
        try:
            arch, kind = arch_kind(read_gguf_metadata(local))
        except Exception as exc:  # an unreadable or unusual header: restores are still judged after the fact
            log.warning("could not read the architecture of %s: %s", local, exc)
    return Capability(arch, kind, checkpoints_by_build(build))


def _xllamacpp_build() -> str | None:
    """"b11549" for xllamacpp 2026.10.11549: the last part of its version is llama.cpp's build number."""
    try:
        from importlib.metadata import version

        last = version("xllamacpp").rsplit(".", 1)[-1]
    except Exception:  # not installed, or an unusual version string
        return None
    return f"b{last}" if last.isdigit() else None


async def _check_links(client: UpstreamClient, ram_dir: Path, slot_dir: Path) -> None:
    """With a RAM dir, the backend reaches snapshots not kept in RAM through absolute symlinks into the slot dir. A
    llama-server in a container that mounts the slot dir elsewhere cannot follow them, and every such restore would
    fail: have it save through one such link (a restore of the probe's empty state could crash older builds) and
    check that the file landed in the slot dir."""
    name = f"slotkeeper-probe-{secrets.token_hex(4)}.bin"
    link, target = ram_dir / name, slot_dir / name
    try:
        link.symlink_to(target)
        try:
            await client.post_json("/slots/0?action=save", {"filename": name}, timeout=15.0)
        except UpstreamError as exc:
            raise BackendNotUsable(_LINKS_UNREACHABLE.format(slot_dir=slot_dir, ram_dir=ram_dir,
                                                             detail=exc.message)) from exc
        except SlotkeeperError as exc:
            log.warning("could not check the links from the RAM dir (the slot stayed busy): %s", exc.message)
            return
        if not target.is_file():
            raise BackendNotUsable(_LINKS_UNREACHABLE.format(slot_dir=slot_dir, ram_dir=ram_dir,
                                                             detail="the file did not appear there"))
    finally:
        for path in (link, target):
            with contextlib.suppress(OSError):
                path.unlink()


_LINKS_UNREACHABLE = (
    "the backend cannot write or read snapshots in {slot_dir} through the links in its --slot-save-path {ram_dir} "
    "({detail}): it must see the slot dir at the same path (mount it so in its container), or run slotkeeper "
    "without --ram-dir"
)


def _model_id(props: dict[str, Any]) -> str:
    """The served model's name: its alias, or the file name without .gguf when the alias is just the path."""
    alias = str(props.get("model_alias") or "")
    path = str(props.get("model_path") or "")
    if alias and alias != path:
        return alias
    name = Path(path or alias or "model").name
    return name[:-5] if name.endswith(".gguf") else name


async def _check_slot_actions(client: UpstreamClient) -> None:
    """An invalid file name is refused with 400 when slot actions work and 501 when they are off; no side effects."""
    try:
        await client.post_json("/slots/0?action=save", {"filename": "probe..invalid"}, timeout=10.0)
    except UpstreamError as exc:
        if exc.status_code == 501:
            raise BackendNotUsable(
                "the backend cannot save or restore slots: start llama-server with --slot-save-path DIR "
                "and give slotkeeper the same directory as --slot-dir"
            ) from exc
        if exc.status_code == 400:
            return
        raise


async def _check_slot_dir(client: UpstreamClient, slot_dir: Path, option: str) -> None:
    """Ask the backend to save into a probe file and look for it where it should be (`option` names the setting
    that said so), so a wrong --slot-dir or --ram-dir is caught."""
    name = f"slotkeeper-probe-{secrets.token_hex(4)}.bin"
    try:
        await client.post_json("/slots/0?action=save", {"filename": name}, timeout=15.0)
    except UpstreamError as exc:
        raise BackendNotUsable(f"the backend refused a probe save: {exc.message}") from exc
    except SlotkeeperError as exc:
        log.warning("could not check the slot dir (the slot stayed busy): %s", exc.message)
        return
    probe = slot_dir / name
    if not probe.exists():
        raise BackendNotUsable(
            f"the backend saved a probe file that did not appear in {slot_dir}: {option} must be the directory "
            "llama-server was started with as --slot-save-path"
        )
    probe.unlink()
