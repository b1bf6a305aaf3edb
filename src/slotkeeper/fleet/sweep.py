"""Removing what no manifest names from the shared tier's object store, safely with many writers: two phases.

A sweep marks (`gc/<object key>`) every object no manifest names, once it is older than `stray` seconds (an upload
puts its objects before its manifest), and removes an object only at a later sweep, once its mark is older than
`grace` seconds and the object was not written since the mark. A writer's side of it is shared.py's: right before
it writes a manifest, an upload looks once more at every object it did not put itself, and one that is gone or
marked is put again under a fresh name, which no mark covers. So a mark that a writer did not see was set after its
last look, and its object goes no sooner than `grace` later; the manifest is written within moments of that look.
Every host may sweep; marking or removing twice is harmless. Kopia's maintenance and restic's prune were read for
the idea (a safety margin longer than any writer's window); nothing here is theirs.

With a budget, the least recently written manifests go first until what the rest name fits it; what only they named
then goes through the marks like any other object (the budget is met a grace period later).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from slotkeeper.errors import SlotkeeperError
from slotkeeper.fleet.manifest import Manifest
from slotkeeper.fleet.objectstore import ObjectStore

log = logging.getLogger("slotkeeper.shared")

# An object no manifest names is marked only once it is this old (an upload writes its objects before its manifest).
STRAY_SECONDS = 600.0
# A mark's age before its object may go: far longer than an upload takes from its last look to its manifest.
GRACE_SECONDS = 3600.0
MARKS = "gc/"


def marks(store: ObjectStore) -> set[str]:
    """The objects marked for removal (their keys)."""
    return {key[len(MARKS):] for key, _, _ in store.listing(MARKS)}


def sweep(store: ObjectStore, budget: int = 0, now: float | None = None, grace: float = GRACE_SECONDS,
          stray: float = STRAY_SECONDS) -> int:
    """Blocking: one sweep; returns how many objects went."""
    now = time.time() if now is None else now
    listed = [*store.listing("blobs/"), *store.listing("tails/"), *store.listing("kv/")]
    objects = {key: (size, when) for key, size, when in listed}
    marked = {key[len(MARKS):]: when for key, _, when in store.listing(MARKS)}
    named = _named_by_manifests(store)
    if budget > 0:
        _enforce_budget(store, budget, named, objects)
    refs: Counter[str] = Counter(o for names in named.values() for o in set(names))
    removed = 0
    for key, (_, written) in objects.items():
        mark = marked.pop(key, None)
        if refs[key]:
            if mark is not None:
                store.delete(MARKS + key)  # named again: the mark goes
        elif mark is None:
            if now - written > stray:
                store.put_json(MARKS + key, {"marked": now}, None)
        elif now - mark > grace and written < mark:
            store.delete(key)
            store.delete(MARKS + key)
            removed += 1
    for key in marked:  # marks of objects gone
        store.delete(MARKS + key)
    if removed:
        log.info("swept %d object(s) no manifest named for %.0f s from the shared store", removed, grace)
    return removed


def _named_by_manifests(store: ObjectStore) -> dict[str, list[str]]:
    """Every manifest (least recently written first) and the objects it names."""
    names: dict[str, list[str]] = {}
    for key, _, _ in sorted(store.listing("manifests/"), key=lambda m: m[2]):
        found = store.get_json(key)
        if found is None:
            continue
        try:
            manifest = Manifest.from_json(found[0])
        except SlotkeeperError:
            continue
        names[key] = manifest.objects()
    return names


def _enforce_budget(store: ObjectStore, budget: int, named: dict[str, list[str]],
                    objects: dict[str, tuple[int, float]]) -> None:
    """Remove the least recently written manifests until what the rest name fits the budget."""
    refs: Counter[str] = Counter(o for names in named.values() for o in set(names))
    total = sum(objects[o][0] for o in refs if o in objects)
    removed = 0
    for key in list(named):
        if total <= budget:
            break
        store.delete(key)
        for o in set(named.pop(key)):
            refs[o] -= 1
            if refs[o] == 0 and o in objects:
                total -= objects[o][0]
        removed += 1
    if removed:
        log.info("the shared store's budget (%d bytes) removed %d snapshot(s), the least recently saved; their "
                 "objects go after %.0f s", budget, removed, GRACE_SECONDS)
