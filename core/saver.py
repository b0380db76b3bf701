"""The save pipeline: flatten -> plan (collective, cached) -> write -> commit.

Pure steps over what a Checkpointer hands in (comm, storage, workers, caches); the Checkpointer
decides sync vs background and owns every resource.
"""
from __future__ import annotations

import hashlib
import pickle
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import commit, dtypes
from .comm import Comm
from .errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, IncompleteCheckpointError
from .flatten import Flat, TensorEntry
from .metadata import METADATA_FILE, Metadata, ObjectFileMeta
from .planner import (LocalPlan, RankManifest, SavePlan, TensorManifest, WriteItem, local_plan, pack_manifest,
                      plan_save, split_for_ranks)
from .regions import relative
from .storage import Storage, chunks, packs
from .storage.errors import StorageError
from .workers import Workers

DATA_PREFIX = "data-"




# ------------------------------------------------------------------ planning (collective)

@dataclass
class _CachedPlan:
    fingerprint: str
    local: LocalPlan
    full: Optional[SavePlan]               # coordinator only


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


def manifest_of(flat: Flat) -> RankManifest:
    return tuple(
        TensorManifest(e.key, dtypes.name_of(e.dtype), e.shape, e.layout,
                       tuple((p.offsets, p.lengths) for p in e.pieces), getattr(e, "grid", None))
        for e in sorted(flat.tensors.values(), key=lambda e: e.key))


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
         what: str = "preparing the state for save") -> Tuple[LocalPlan, Optional[SavePlan], str, Optional[str]]:
    """Collective: this rank's part of the save plan (the whole plan on the coordinator), and what
    `begin()` returns on the coordinator: the save id and the data directory of the checkpoint it
    replaces (if any). `prepare_error`: this rank could not prepare its state (`what`); every rank
    then raises, naming the ranks that failed."""
    fingerprint = (None if prepare_error is not None
                   else hashlib.sha1(pickle.dumps((comm.world_size, manifest))).hexdigest())
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
        return cached.local, cached.full, save_id, old

    # Ranks whose manifest table matches the coordinator's send only their coordinates and
    # irregular boxes; the grid part of the plan is broadcast, general-path parts scattered.
    packed = pack_manifest(manifest)
    reference = comm.broadcast(packed.digest)
    gathered = comm.gather(packed if comm.is_coordinator or packed.digest != reference else packed.without_table())
    head: Any = None
    extras: Optional[List[LocalPlan]] = None
    full: Optional[SavePlan] = None
    if comm.is_coordinator:
        try:
            full = plan_save(gathered)
            save_id, old = begin()
            shared, extras = split_for_ranks(full)
            head = (True, (shared, extras is not None, save_id, old))
        except Exception as exc:  # noqa: BLE001 - shipped to every rank
            head = (False, exc)
    ok, value = comm.broadcast(head)
    if not ok:
        raise value
    shared, has_extras, save_id, old = value
    local = local_plan(shared, comm.scatter(extras) if has_extras else None, comm.rank)
    cache.put(cache_key, _CachedPlan(fingerprint, local, full))
    return local, full, save_id, old


# ------------------------------------------------------------------ writing

def sources(flat: Flat, writes: Sequence[WriteItem]) -> List[torch.Tensor]:
    """The local tensor view that holds each write item."""
    out = []
    for w in writes:
        src = source_of(flat.tensors[w.key], w)
        if src is None:  # the planner only assigns a box to a rank that holds it
            raise CheckpointError(f"internal: rank holds no piece of {w.key!r} containing {w.offsets}")
        out.append(src)
    return out


def source_of(entry: TensorEntry, w: WriteItem) -> Optional[torch.Tensor]:
    """The view of the entry's local pieces that holds write item `w`, or None."""
    for p in entry.pieces:
        if all(po <= wo and wo + wl <= po + pl for po, pl, wo, wl in zip(p.offsets, p.lengths, w.offsets, w.lengths)):
            return p.tensor[relative((w.offsets, w.lengths), p.offsets)] if w.offsets else p.tensor
    return None


def staging_key(w: WriteItem, t: torch.Tensor) -> tuple:
    return (w.key, w.offsets, w.lengths, t.dtype)


class EarlyCopies:
    """An async save's staging copies started while the state is still being walked: when the
    last plan for this process group is known, each tensor's writes are copied out the moment the
    walk finds it, so the copy engines run during the rest of the walk and the planning. Used only
    if the save's plan turns out to be that same plan (an unchanged layout: the usual case)."""

    def __init__(self, plan: LocalPlan, staging) -> None:
        self.plan, self.staging = plan, staging
        self._by_key: Dict[str, List[int]] = {}
        for i, w in enumerate(plan.writes):
            self._by_key.setdefault(w.key, []).append(i)
        self._buffers: Dict[int, torch.Tensor] = {}
        self.first_copy: Optional[float] = None  # perf_counter of the first copy (SaveHandle.stats)

    def on_tensor(self, entry: TensorEntry) -> None:
        if self.first_copy is None:
            self.first_copy = time.perf_counter()
        for i in self._by_key.get(entry.key, ()):
            w = self.plan.writes[i]
            src = source_of(entry, w)
            if src is not None and src.dtype == entry.dtype and tuple(src.shape) == tuple(w.lengths):
                self._buffers[i] = self.staging.copy(staging_key(w, src), src)

    def buffers(self, local: LocalPlan) -> Optional[List[torch.Tensor]]:
        """The staged buffers of every write of `local`, or None unless it is the plan copied from."""
        if local is not self.plan or len(self._buffers) != len(local.writes):
            return None
        return [self._buffers[i] for i in range(len(local.writes))]


def write_local(store: Storage, workers: Workers, data_dir: str, local: LocalPlan, data: Sequence[torch.Tensor],
                objects_blob: bytes, rank: int) -> commit.WriteResult:
    """Write this rank's boxes (format 5: into its pack files, storage/packs.py) and plain values;
    returns the object file entry, the block crc32s and the pack location of every chunk it wrote."""
    arrays = {p: commit.rooted(a, data_dir) for p, a in local.arrays.items()}
    items = [(w.array, chunks.chunk_name(index), payload) for w, t in zip(local.writes, data)
             for index, payload in chunks.encode_box(arrays[w.array], w.array_offsets, t)]
    obj_path = f"{data_dir}/objects/rank_{rank}.json"
    store.prepare([obj_path])
    checksums, locations = packs.write(store, workers, data_dir, rank, items, chunks.block_checksums,
                                       chunks.BLOCK_BYTES)
    store.put(obj_path, objects_blob)
    store.sync()  # durable before reporting success (big packs were fdatasync'ed as written)
    return ObjectFileMeta(rank, obj_path, len(objects_blob), zlib.crc32(objects_blob)), checksums, locations


@dataclass
class Job:
    """Everything the write-and-commit step of one save needs (built on the caller's thread)."""
    comm: Comm
    store: Storage
    local: LocalPlan
    full: Optional[SavePlan]
    save_id: str
    old_data: Optional[str]
    structure: Any
    overwrite: bool
    objects_blob: bytes

    data_prefix: str = DATA_PREFIX
    info: Optional[Dict[str, Any]] = None   # extra metadata info (training step, capture time)

    @property
    def data_dir(self) -> str:
        return self.data_prefix + self.save_id

    def board(self, timeout_s: float, dead_peer_s: float) -> commit.MarkerBoard:
        return commit.MarkerBoard(self.store, self.data_dir, self.comm.world_size, self.comm.rank, timeout_s,
                                  dead_peer_s)

    def _decide(self, results) -> None:
        commit.write_metadata(self.store, self.full, self.save_id, self.data_dir, self.comm.world_size,
                              self.structure, self.overwrite, self.old_data, results, self.info)

    def _write(self, workers: Workers, data: Sequence[torch.Tensor]) -> Tuple[commit.RankResult, Optional[Exception]]:
        try:
            return (write_local(self.store, workers, self.data_dir, self.local, data, self.objects_blob,
                                self.comm.rank), None), None
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, raised on every rank
            return (None, f"{type(exc).__name__}: {exc}"), exc

    def run_sync(self, workers: Workers, data: Sequence[torch.Tensor]) -> None:
        """On the caller's thread: write, then commit through a gather + broadcast."""
        result, error = self._write(workers, data)
        if self.comm.world_size == 1 and error is not None:
            raise error
        commit.collect_by_collective(self.comm, result, self._decide)

    def run_background(self, workers: Workers, data: Sequence[torch.Tensor], board: commit.MarkerBoard) -> None:
        """On a background thread: write, then commit through marker objects (no collectives:
        training may tear its process group down while this runs). A save of one rank commits
        directly: nobody needs its markers."""
        result, error = self._write(workers, data)
        if self.comm.world_size == 1:
            if error is not None:
                raise error
            self._decide([result])
            return
        board.publish(result)
        if not self.comm.is_coordinator:
            board.outcome()
            return
        error: Optional[BaseException] = None
        try:
            self._decide(board.collect())
        except BaseException as exc:  # noqa: BLE001 - announced to every rank, then re-raised here
            error = exc
        board.announce(error)
        if error is not None:
            raise error


def manifest_and_blob(flat: Flat) -> Tuple[RankManifest, bytes]:
    from . import codec
    return manifest_of(flat), codec.dumps(flat.objects)


def order_key(info: Mapping[str, Any]) -> Tuple[int, float]:
    """How checkpoints are ordered (newest = largest): the training step given to save() (-1 when
    none was), then when the state was captured (save() was called; the commit time for older
    checkpoints)."""
    step = info.get("step")
    captured = info.get("captured_unix", info.get("created_unix", 0.0))
    return (int(step) if isinstance(step, int) and not isinstance(step, bool) else -1,
            float(captured) if isinstance(captured, (int, float)) else 0.0)
