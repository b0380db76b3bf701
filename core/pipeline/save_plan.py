"""Save planning: this rank's state described (manifest), then the collective plan (cached per
process group: a repeated save with the same layout skips the gather), and the save's id.

Pure steps over what the caller hands in (comm, plan cache, begin); the order of a whole save is
pipeline/save.py's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import pickle
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..common import dtypes
from ..common.errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, IncompleteCheckpointError
from ..collectives.comm import Comm
from ..format import chunk_tables, codec
from ..format.metadata import METADATA_FILE, Metadata
from ..planning.planner import (
    LocalPlan,
    RankManifest,
    SavePlan,
    TensorManifest,
    local_plan,
    pack_manifest,
    plan_save,
    split_for_ranks,
)
from ..state import structure_union
from ..state.flatten import Flat, TypeRegistry, flatten_for_save
from ..state.structure_union import SavedStructure
from ..storage import Storage
from ..storage.errors import StorageError


@dataclass
class Prepared:
    """This rank's state, flattened and described; or, when that failed, the error (save_plan.plan
    then raises it on every rank, so no rank waits for one that gave up)."""
    flat: Optional[Flat] = None
    manifest: Optional[RankManifest] = None
    objects_blob: Optional[bytes] = None
    error: Optional[BaseException] = None

    @property
    def structure(self) -> Any:
        """The state's nesting (None when preparing failed)."""
        return self.flat.structure if self.flat is not None else None


def prepare(state: Dict[str, Any], registry: TypeRegistry, fsdp1_route: str, on_tensor=None) -> Prepared:
    """Flatten `state` into tensor entries and plain values; `on_tensor(entry)` sees each tensor
    as the walk finds it (early staging copies)."""
    try:
        flat = flatten_for_save(state, registry, fsdp1_route, on_tensor)
        return Prepared(flat, manifest_of(flat), codec.dumps(flat.objects))
    except Exception as exc:  # noqa: BLE001 - every rank raises it, from plan()
        return Prepared(error=exc)


def manifest_of(flat: Flat) -> RankManifest:
    return tuple(
        TensorManifest(e.key, dtypes.name_of(e.dtype), e.shape, e.layout,
                       tuple((p.offsets, p.lengths) for p in e.pieces), getattr(e, "grid", None))
        for e in sorted(flat.tensors.values(), key=lambda e: e.key))


@dataclass
class _CachedPlan:
    fingerprint: str
    local: LocalPlan
    full: Optional[SavePlan]               # coordinator only
    structure: Optional[SavedStructure]    # coordinator only: the union of every rank's


class PlanCache:
    """The last plan per process group: a repeated save with the same layout skips the gather."""

    def __init__(self) -> None:
        self._plans: Dict[Any, _CachedPlan] = {}

    def get(self, key: Any) -> Optional[_CachedPlan]:
        return self._plans.get(key)

    def put(self, key: Any, plan: _CachedPlan) -> None:
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()


def new_save_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def begin(store: Storage, overwrite: bool, read_metadata: Callable[[Storage], Metadata]
          ) -> Tuple[str, Optional[str]]:
    """Coordinator: refuse to clobber a checkpoint; pick this save's id; name the data directory
    of the checkpoint this one replaces (deleted after the commit)."""
    try:
        old_data = read_metadata(store).info.get("data_dir")
        exists = True
    except (CheckpointNotFoundError, IncompleteCheckpointError) as exc:
        if isinstance(exc, StorageError):  # e.g. no such bucket: not "no checkpoint yet"
            raise
        old_data, exists = None, False
    except CheckpointError:  # damaged metadata: still a checkpoint that overwrite must be asked for
        old_data, exists = None, store.get(METADATA_FILE) is not None
    if exists and not overwrite:
        raise CheckpointExistsError(
            f"{store.url!r} already holds a checkpoint; pass overwrite=True to replace it or save to a new "
            f"path (the existing checkpoint was left untouched)")
    return new_save_id(), old_data


PREPARE_FAILED, NEW_PLAN, CACHED_PLAN = 0, 1, 2


def plan(comm: Comm, manifest: Optional[RankManifest], cache: PlanCache,
         begin: Callable[[], Tuple[str, Optional[str]]], prepare_error: Optional[BaseException] = None,
         what: str = "preparing the state for save", safetensors: Tuple[str, ...] = (), structure: Any = None
         ) -> Tuple[LocalPlan, Optional[SavePlan], str, Optional[str], Optional[SavedStructure]]:
    """Collective: this rank's part of the save plan (the whole plan on the coordinator), what
    `begin()` returns on the coordinator: the save id and the data directory of the checkpoint it
    replaces (if any), and (coordinator) the union of every rank's `structure` (the state's
    nesting: ranks holding other pipeline stages or experts save other keys). `prepare_error`:
    this rank could not prepare its state (`what`); every rank then raises, naming the ranks that
    failed. `safetensors`: key paths written as safetensors packs (planning/planner.plan_save)."""
    tree_digest = structure_union.digest(structure) if prepare_error is None else ""
    fingerprint = (None if prepare_error is not None
                   else hashlib.sha1(pickle.dumps((comm.world_size, manifest, safetensors, tree_digest))).hexdigest())
    cache_key = comm.key
    cached = cache.get(cache_key)
    hit = fingerprint is not None and cached is not None and cached.fingerprint == fingerprint
    # One all-reduce answers both questions of a steady-state save (did every rank prepare its
    # state; does every rank's cached plan still hold): an async save's stall is mostly these.
    status = comm.min_int(PREPARE_FAILED if prepare_error is not None else CACHED_PLAN if hit else NEW_PLAN)
    if status == PREPARE_FAILED:
        comm.agree(prepare_error, what)  # raises on every rank: some rank failed
        raise CheckpointError(f"internal: {what} failed on some rank but no rank reported an error")
    if status == CACHED_PLAN:
        save_id, old = comm.run_on_coordinator(begin, "checking the save path")
        return cached.local, cached.full, save_id, old, cached.structure

    # Ranks whose manifest table matches the coordinator's send only their coordinates and
    # irregular boxes; the grid part of the plan is broadcast, general-path parts scattered.
    # Structures likewise: a digest each, the trees of the distinct ones only.
    packed = pack_manifest(manifest)
    reference = comm.broadcast(packed.digest)
    gathered = comm.gather((packed if comm.is_coordinator or packed.digest != reference else packed.without_table(),
                            tree_digest))
    head: Any = None
    extras: Optional[List[LocalPlan]] = None
    full: Optional[SavePlan] = None
    if comm.is_coordinator:
        try:
            full = plan_save([g[0] for g in gathered], safetensors=safetensors)
            save_id, old = begin()
            shared, extras = split_for_ranks(full)
            head = (True, (shared, extras is not None, save_id, old, structure_union.senders([g[1] for g in gathered]),
                           chunk_tables.chunk_bases(full.arrays)))
        except Exception as exc:  # noqa: BLE001 - shipped to every rank
            head = (False, exc)
    ok, value = comm.broadcast(head)
    if not ok:
        raise value
    shared, has_extras, save_id, old, senders, bases = value
    # every array's first chunk position: ranks report their chunks by position (format/chunk_tables.py)
    local = dataclasses.replace(local_plan(shared, comm.scatter(extras) if has_extras else None, comm.rank),
                                chunk_bases=bases)
    merged = _union(comm, structure, senders)
    cache.put(cache_key, _CachedPlan(fingerprint, local, full, merged))
    return local, full, save_id, old, merged


def _union(comm: Comm, structure: Any, senders: List[int]) -> Optional[SavedStructure]:
    """Collective when some rank's structure differs from the coordinator's: the coordinator
    merges the distinct ones (a conflict is raised on every rank); others get None."""
    if not senders:
        return SavedStructure(structure) if comm.is_coordinator else None
    trees = comm.gather(structure if comm.rank in senders else None)
    merged: Optional[SavedStructure] = None
    error: Optional[BaseException] = None
    if comm.is_coordinator:
        try:
            merged = structure_union.merge({0: structure, **{r: trees[r] for r in senders}})
        except Exception as exc:  # noqa: BLE001 - shipped to every rank
            error = exc
    error = comm.broadcast(error)   # only the verdict travels: the coordinator alone writes the metadata
    if error is not None:
        raise error
    return merged
