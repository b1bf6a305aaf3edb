"""One model on several backends: each turn goes to its session's owner (placement.py), and a session that moves
takes its newest snapshot with it.

The members are backends of one host (their slot dirs are all readable here), of the same model, slot layout and
build: a snapshot moves only between members of one fingerprint. A move copies the snapshot file into the new
owner's slot dir (checked against its checksum) and imports it there, before the turn is leased: the new owner's
pool then restores it as if it had saved it itself. A turn whose backend refuses the connection (it died before
the health watch noticed) is placed again, without that backend, and sent there: only a turn the dead backend had
already started fails, in its client's dialect.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from slotkeeper.cache.chain import Link
from slotkeeper.cache.operations import import_snapshot, save_session
from slotkeeper.cache.pool import SlotPool
from slotkeeper.cache.snapshots import Snapshots
from slotkeeper.cache.systemprompt import SystemPrompt, system_prompt_of
from slotkeeper.errors import SlotkeeperError, UpstreamUnavailable
from slotkeeper.fleet.placement import Choice, Placement
from slotkeeper.serving.identity import session_group
from slotkeeper.serving.service import (
    BodyBuilder,
    HungUp,
    Prewarm,
    ProgressCallback,
    StreamTurn,
    TurnRecord,
    TurnService,
)
from slotkeeper.types import BackendInfo, IdSource, SessionKey, Snapshot, SnapshotKind
from slotkeeper.upstream.client import UpstreamClient
from slotkeeper.upstream.health import Probe
from slotkeeper.version import newer

log = logging.getLogger("slotkeeper.group")
T = TypeVar("T")

# Asks the session directory for another backend of this replica when the one it chose refused a turn.
Reroute = Callable[[str], Awaitable[str | None]]

# How long a moving session waits for its previous owner (still up: draining or overloaded) to save its latest turn.
MOVE_SAVE_SECONDS = 30.0


class Member(Protocol):
    """What the group needs of one backend (the web layer's AppState)."""

    @property
    def backend(self) -> BackendInfo: ...
    @property
    def client(self) -> UpstreamClient: ...
    @property
    def pool(self) -> SlotPool: ...
    @property
    def service(self) -> TurnService: ...
    @property
    def snapshots(self) -> Snapshots: ...


def ring_key(key: SessionKey) -> str:
    """Where a session starts its walk of the ring: a conversation without an id of its own starts at its system
    prompt's group, so that conversations on one system prompt land where it is warm."""
    if key.source is IdSource.SYSTEM_PROMPT:
        return session_group(key.session_id) or key.session_id
    return key.session_id


class BackendGroup:
    """The backends of one model and the owners of its sessions. Offers the turn methods of TurnService."""

    def __init__(self, members: Sequence[Member], load_factor: float) -> None:
        self.members = list(members)
        self._by_name = {m.backend.url: m for m in self.members}
        self.placement = Placement(list(self._by_name), load_factor)
        self.moved_in: dict[str, int] = {}  # per member: sessions that moved there with their snapshot

    async def learn_owners(self) -> int:
        """Give each session found in the members' indexes to the member holding its newest version (version.py);
        returns how many sessions have an owner."""
        newest: dict[str, tuple[Member, Snapshot]] = {}
        for member in self.members:
            for snapshot in await member.snapshots.list(None, SnapshotKind.SESSION):
                held = newest.get(snapshot.key.scoped_id)
                if held is None or newer(snapshot.version, held[1].version):
                    newest[snapshot.key.scoped_id] = (member, snapshot)
        for session, (member, snapshot) in newest.items():
            self.placement.learn(session, member.backend.url, snapshot.last_used)
        return len(self.placement)

    def drain(self, url: str, draining: bool) -> None:
        """Take a backend out of service (`draining`: it gets no new session, and each of its sessions moves at its
        next turn, with its snapshot) or put it back."""
        if draining:
            self.placement.draining.add(url)
        else:
            self.placement.draining.discard(url)
        log.info("backend %s %s", url, "is draining: its sessions move at their next turn" if draining
                 else "takes sessions again")

    def status(self) -> list[dict[str, Any]]:
        """Each member: its URL, whether it is up and draining, and its active sessions."""
        loads = self.placement.loads(time.time())
        return [{"url": m.backend.url, "up": m.service.health.up, "draining": m.backend.url in self.placement.draining,
                 "active_sessions": loads[m.backend.url], "moved_in": self.moved_in.get(m.backend.url, 0)}
                for m in self.members]

    def _for_side_task(self, key: SessionKey) -> Member:
        """A side task (a title or tags request) runs where its conversation is, and owns nothing itself."""
        up = [m.backend.url for m in self.members if m.service.health.up]
        return self._by_name[self.placement.peek(key.scoped_id, ring_key(key), up)]

    async def owner_for(self, key: SessionKey, exclude: frozenset[str] = frozenset(),
                        system: Callable[[], SystemPrompt | None] | None = None, at: str | None = None) -> Member:
        """The member a turn of `key` goes to now, with the session's newest snapshot brought in when it moves, and
        (a new session) its system prompt's snapshot when another member has it and this one has not. `system`
        gives the request's system part; it is computed only for a new session. `at`: the member the session
        directory chose (several replicas), taken unless it is excluded."""
        if at is not None and at in self._by_name and at not in exclude:
            choice = self.placement.assign(key.scoped_id, at, time.time())
        else:
            up = [m.backend.url for m in self.members if m.service.health.up]
            choice = self.placement.place(key.scoped_id, ring_key(key), up, time.time(), exclude)
        member = self._by_name[choice.member]
        if choice.moved:
            log.info("session %s moves to %s (%s, was on %s)", key.session_id, choice.member, choice.why,
                     choice.previous)
        if choice.moved or choice.previous is None:
            await self._bring_newest(key, member, choice)
        prompt = system() if choice.previous is None and system is not None and member.pool.system_snapshots else None
        if prompt is not None:
            await self._bring_system(key.within(prompt.digest), member)
        return member

    async def _bring_system(self, key: SessionKey, dest: Member) -> None:
        """Copy a system snapshot another member of the same fingerprint has into `dest`, which has none: a new
        conversation there then starts from it instead of warming the prompt up again."""
        if await dest.snapshots.system(key, checked=False) is not None:
            return
        for source in self.members:
            if source is dest or source.backend.fingerprint != dest.backend.fingerprint:
                continue
            if await source.snapshots.system(key, checked=False) is None:
                continue
            try:
                copied = await copy_snapshot(source, dest, key, SnapshotKind.SYSTEM)
            except (SlotkeeperError, OSError) as exc:
                log.warning("system prompt %s: copying its snapshot from %s to %s failed (%s); it is warmed up there",
                            key.session_id[:12], source.backend.url, dest.backend.url,
                            exc.message if isinstance(exc, SlotkeeperError) else str(exc))
                return
            if copied is not None:
                log.info("system prompt %s: its snapshot of %d tokens came from %s to %s for a new conversation",
                         key.session_id[:12], copied.n_tokens, source.backend.url, dest.backend.url)
                return

    async def _bring_newest(self, key: SessionKey, dest: Member, choice: Choice) -> None:
        """Copy the session's newest snapshot of the other members into `dest` when it is newer than dest's own. A
        failure is logged and leaves the turn to prefill (or to restore dest's older copy). A previous owner that is
        still up (draining, or overloaded) saves the session's latest turn first."""
        previous = self._by_name.get(choice.previous) if choice.previous is not None else None
        if previous is not None and previous is not dest and previous.service.health.up:
            try:
                await asyncio.wait_for(save_session(previous.pool, key), MOVE_SAVE_SECONDS)
            except (TimeoutError, SlotkeeperError) as exc:
                log.warning("session %s: saving its latest turn on %s before it moves did not finish (%s); it moves "
                            "with its last saved state", key.session_id, previous.backend.url,
                            exc.message if isinstance(exc, SlotkeeperError) else f"over {MOVE_SAVE_SECONDS:g} s")
        found = await asyncio.gather(*(m.snapshots.get(key) for m in self.members))
        own = found[self.members.index(dest)]
        newest: tuple[Member, Snapshot] | None = None
        for member, snapshot in zip(self.members, found, strict=True):
            if member is dest or snapshot is None or member.backend.fingerprint != dest.backend.fingerprint:
                continue
            if newest is None or newer(snapshot.version, newest[1].version):
                newest = (member, snapshot)
        if newest is None or (own is not None and not newer(newest[1].version, own.version)):
            return
        source, snapshot = newest
        try:
            imported = await copy_snapshot(source, dest, key)
        except (SlotkeeperError, OSError) as exc:
            message = exc.message if isinstance(exc, SlotkeeperError) else str(exc)
            log.warning("session %s: bringing its snapshot from %s to %s failed (%s); the turn prefills",
                        key.session_id, source.backend.url, dest.backend.url, message)
            return
        if imported is not None:
            self.moved_in[dest.backend.url] = self.moved_in.get(dest.backend.url, 0) + 1
            log.info("session %s: its snapshot of %d tokens came from %s to %s (%s)", key.session_id,
                     imported.n_tokens, source.backend.url, dest.backend.url, choice.why)

    async def _refused(self, member: Member) -> bool:
        """Whether the member's backend refuses connections now (then it counts as down at once)."""
        probe = await member.client.probe()
        member.service.health.probed(probe)
        return probe is Probe.REFUSED

    async def unary(self, api: str, key: SessionKey, path: str, build: BodyBuilder, side: bool = False,
                    hung_up: HungUp | None = None, chat: Mapping[str, Any] | None = None,
                    chain: Sequence[Link] | None = None, at: str | None = None,
                    reroute: Reroute | None = None) -> tuple[Any, TurnRecord]:
        return await self._on_owner(key, side, build, chat, at, reroute, lambda member: member.service.unary(
            api, key, path, build, side=side, hung_up=hung_up, chat=chat, chain=chain))

    async def open_stream(self, api: str, key: SessionKey, path: str, build: BodyBuilder, side: bool = False,
                          hung_up: HungUp | None = None, chat: Mapping[str, Any] | None = None,
                          chain: Sequence[Link] | None = None, at: str | None = None,
                          reroute: Reroute | None = None) -> StreamTurn:
        return await self._on_owner(key, side, build, chat, at, reroute, lambda member: member.service.open_stream(
            api, key, path, build, side=side, hung_up=hung_up, chat=chat, chain=chain))

    def pinned(self, url: str, reroute: Reroute | None = None) -> Pinned:
        """The group's turn methods with each turn sent to the member `url` (the session directory's choice);
        `reroute` asks the directory for another when that one refuses the turn."""
        return Pinned(self, url, reroute)

    async def _on_owner(self, key: SessionKey, side: bool, build: BodyBuilder, chat: Mapping[str, Any] | None,
                        at: str | None, reroute: Reroute | None, run: Callable[[Member], Awaitable[T]]) -> T:
        """Run the turn on the session's member; when that backend refuses the connection (it died before the watch
        noticed), once more on the member placed without it (by the directory, with `reroute`, when it placed the
        first)."""
        if side:
            member = self._by_name.get(at or "") or self._for_side_task(key)
        else:
            member = await self.owner_for(key, system=lambda: _system_part(chat if chat is not None else build(0)),
                                          at=at)
        try:
            return await run(member)
        except UpstreamUnavailable:
            if not await self._refused(member):
                raise
        again = await reroute(member.backend.url) if reroute is not None and at is not None else None
        return await run(await self.owner_for(key, exclude=frozenset({member.backend.url}), at=again))

    async def prewarm(self, model: str, system: SystemPrompt, progress: ProgressCallback | None = None,
                      pin: bool = False, domain: str = "") -> Prewarm:
        """Warm the system prompt up on the member its conversations go to first."""
        up = {m.backend.url for m in self.members if m.service.health.up}
        order = self.placement.walk(f"sys-{system.digest}")
        first = next((name for name in order if name in up), order[0])
        return await self._by_name[first].service.prewarm(model, system, progress, pin, domain)


class Pinned:
    """A BackendGroup whose turns go to one member, chosen by the session directory; pre-warms as the group's."""

    def __init__(self, group: BackendGroup, url: str, reroute: Reroute | None = None) -> None:
        self.group = group
        self.url = url
        self.reroute = reroute

    async def unary(self, api: str, key: SessionKey, path: str, build: BodyBuilder, side: bool = False,
                    hung_up: HungUp | None = None, chat: Mapping[str, Any] | None = None,
                    chain: Sequence[Link] | None = None) -> tuple[Any, TurnRecord]:
        return await self.group.unary(api, key, path, build, side=side, hung_up=hung_up, chat=chat, chain=chain,
                                      at=self.url, reroute=self.reroute)

    async def open_stream(self, api: str, key: SessionKey, path: str, build: BodyBuilder, side: bool = False,
                          hung_up: HungUp | None = None, chat: Mapping[str, Any] | None = None,
                          chain: Sequence[Link] | None = None) -> StreamTurn:
        return await self.group.open_stream(api, key, path, build, side=side, hung_up=hung_up, chat=chat, chain=chain,
                                            at=self.url, reroute=self.reroute)

    async def prewarm(self, model: str, system: SystemPrompt, progress: ProgressCallback | None = None,
                      pin: bool = False, domain: str = "") -> Prewarm:
        return await self.group.prewarm(model, system, progress, pin, domain)


def _system_part(body: Mapping[str, Any]) -> SystemPrompt | None:
    """The system part a conversation's state is cut back to (the one its saved system state is named by)."""
    part = system_prompt_of(body)
    return part.without_instructions() if part is not None else None


async def copy_snapshot(source: Member, dest: Member, key: SessionKey,
                        kind: SnapshotKind = SnapshotKind.SESSION) -> Snapshot | None:
    """Copy `key`'s checked snapshot of `kind` from `source`'s slot dir into `dest`'s and import it there (replacing
    dest's own). None when source has none any more."""
    found = await source.snapshots.transfers.open_for_export(key, kind)
    if found is None:
        return None
    snapshot, chain, handle = found
    temp, path = await dest.snapshots.transfers.stage_upload(key, kind)
    try:
        with handle:
            await asyncio.to_thread(_copy, handle, path)
        if await dest.snapshots.transfers.checksum(path) != snapshot.checksum:
            raise SlotkeeperError(f"the copy of {snapshot.filename} does not match its checksum")
    except BaseException:
        await dest.snapshots.transfers.discard_upload(temp)
        raise
    return await import_snapshot(dest.pool, key, temp, snapshot.n_tokens, chain, snapshot.n_bytes, kind,
                                 snapshot.n_prompt, snapshot.version)


def _copy(handle: Any, path: Any) -> None:
    with open(path, "wb") as out:
        shutil.copyfileobj(handle, out, 1024 * 1024)
