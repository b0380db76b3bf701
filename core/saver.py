"""save(): flatten -> plan (collective, cached) -> write -> commit, sync or in the background."""
from __future__ import annotations

import atexit
import sys
import hashlib
import logging
import pickle
import threading
import time
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import codec, commit
from .comm import Comm
from .errors import CheckpointError, CheckpointExistsError
from .flatten import Flat, TensorEntry, flatten_for_save
from .metadata import (DTYPES, METADATA_FILE, ArrayMeta, Metadata, ObjectFileMeta,
                       TensorMeta)
from .planner import RankManifest, SavePlan, TensorManifest, WriteItem, plan_save
from .regions import relative
from .staging import shared_pool
from .storage import Store, chunks

log = logging.getLogger("bytecheckpoint")
DATA_PREFIX = "data-"


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"dtype {dtype} is not supported; supported: {sorted(DTYPES)}")
    return name


# ------------------------------------------------------------------ handle

class SaveHandle:
    """Returned by save(). wait() blocks until committed and re-raises a background failure."""

    def __init__(self, path: str, future: Optional[Future] = None):
        self.path = path
        self._future = future
        self.stats: Dict[str, float] = {}

    def wait(self, timeout: Optional[float] = None) -> "SaveHandle":
        if self._future is not None:
            try:
                self._future.result(timeout)
            finally:
                if self._future.done():  # a failure is delivered once, here
                    _forget(self)
        return self

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, done={self.done()})"


_PENDING: List[SaveHandle] = []
_PENDING_LOCK = threading.Lock()


def _forget(handle: SaveHandle) -> None:
    with _PENDING_LOCK:
        if handle in _PENDING:
            _PENDING.remove(handle)


def wait_pending() -> None:
    """Wait for every in-flight async save of this process; re-raise the first failure."""
    with _PENDING_LOCK:
        handles = list(_PENDING)
    first: Optional[BaseException] = None
    for h in handles:
        try:
            h.wait()
        except BaseException as exc:  # noqa: BLE001 - remember, keep draining, re-raise below
            first = first or exc
    if first is not None:
        raise first


def _raise_finished_failures() -> None:
    """A background failure of an earlier save surfaces on the next save()."""
    with _PENDING_LOCK:
        finished = [h for h in _PENDING if h.done()]
    for h in finished:
        try:
            h.wait()
        except BaseException as exc:
            raise CheckpointError(f"an earlier async save to {h.path!r} failed: {exc}") from exc


@atexit.register
def _wait_at_exit() -> None:
    """Never exit with a save in flight, and never drop a background failure nobody waited for."""
    with _PENDING_LOCK:
        handles = list(_PENDING)
    running = sum(1 for h in handles if not h.done())
    if running:
        sys.stderr.write(f"bytecheckpoint: waiting for {running} async save(s) to finish before exit\n")
    for h in handles:
        try:
            h.wait()
        except BaseException as exc:  # noqa: BLE001 - exiting anyway: say loudly what was lost
            sys.stderr.write(f"bytecheckpoint: ERROR: async save to {h.path!r} failed and was not committed: "
                             f"{exc}\n")


# ------------------------------------------------------------------ planning (collective)

@dataclass(frozen=True)
class LocalPlan:
    writes: Tuple[WriteItem, ...]
    creates: Tuple[str, ...]
    arrays: Mapping[str, ArrayMeta]        # the arrays this rank touches (data-dir relative)


@dataclass
class _CachedPlan:
    fingerprint: str
    local: LocalPlan
    full: Optional[SavePlan]               # coordinator only


_PLAN_CACHE: Dict[Any, _CachedPlan] = {}


def manifest_of(flat: Flat) -> RankManifest:
    return tuple(
        TensorManifest(e.key, dtype_name(e.dtype), e.shape, e.layout,
                       tuple((p.offsets, p.lengths) for p in e.pieces))
        for e in sorted(flat.tensors.values(), key=lambda e: e.key))


def _local_part(plan: SavePlan, rank: int) -> LocalPlan:
    touched = {w.array for w in plan.writes[rank]} | set(plan.creates[rank])
    return LocalPlan(plan.writes[rank], plan.creates[rank], {a: plan.arrays[a] for a in touched})


def _begin(store: Store, overwrite: bool) -> Tuple[str, Optional[str]]:
    """Coordinator: refuse to clobber a checkpoint; pick this save's id."""
    existing = store.read_bytes(METADATA_FILE)
    old_data = None
    if existing is not None:
        if not overwrite:
            raise CheckpointExistsError(
                f"{store.url!r} already holds a checkpoint; pass overwrite=True to replace it or save to a new "
                f"path (the existing checkpoint was left untouched)")
        try:
            old_data = Metadata.from_json(existing, store.url).info.get("data_dir")
        except CheckpointError:
            old_data = None
    save_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]
    return save_id, old_data


def _plan(comm: Comm, store: Store, manifest: RankManifest, overwrite: bool) -> Tuple[LocalPlan, Optional[SavePlan], str, Optional[str]]:
    fingerprint = hashlib.sha1(pickle.dumps((comm.world_size, manifest))).hexdigest()
    cache_key = (id(comm.group), comm.world_size)
    cached = _PLAN_CACHE.get(cache_key)
    if comm.all_true(cached is not None and cached.fingerprint == fingerprint):
        save_id, old = comm.run_on_coordinator(lambda: _begin(store, overwrite), "checking the save path")
        return cached.local, cached.full, save_id, old

    gathered = comm.gather(manifest)
    payloads: Optional[List[Any]] = None
    full: Optional[SavePlan] = None
    if comm.is_coordinator:
        try:
            full = plan_save(gathered)
            save_id, old = _begin(store, overwrite)
            payloads = [(True, (_local_part(full, r), save_id, old)) for r in range(comm.world_size)]
        except Exception as exc:  # noqa: BLE001 - shipped to every rank
            payloads = [(False, exc)] * comm.world_size
    ok, value = comm.scatter(payloads)
    if not ok:
        raise value
    local, save_id, old = value
    _PLAN_CACHE[cache_key] = _CachedPlan(fingerprint, local, full)
    return local, full, save_id, old


# ------------------------------------------------------------------ writing

def _sources(flat: Flat, writes: Sequence[WriteItem]) -> List[torch.Tensor]:
    """The local tensor view that holds each write item."""
    out = []
    for w in writes:
        entry: TensorEntry = flat.tensors[w.key]
        for p in entry.pieces:
            if all(po <= wo and wo + wl <= po + pl for po, pl, wo, wl in zip(p.offsets, p.lengths, w.offsets, w.lengths)):
                out.append(p.tensor[relative((w.offsets, w.lengths), p.offsets)] if w.offsets else p.tensor)
                break
        else:  # the planner only assigns a box to a rank that holds it
            raise CheckpointError(f"internal: rank holds no piece of {w.key!r} containing {w.offsets}")
    return out


def _write_local(store: Store, data_dir: str, local: LocalPlan, data: Sequence[torch.Tensor],
                 objects_blob: bytes, rank: int) -> Tuple[ObjectFileMeta, Dict[str, Dict[str, int]]]:
    """Write this rank's boxes and plain values; returns the object file entry and chunk crc32s."""
    arrays = {p: commit.rooted(a, data_dir) for p, a in local.arrays.items()}
    io = chunks.chunk_io_for(store)
    created = [chunks.write_zarr_json(io, arrays[path]) for path in local.creates]
    pending: Dict[str, chunks.PendingWrite] = {}
    for w, t in zip(local.writes, data):
        pending[w.array] = chunks.start_write(io, arrays[w.array], w.array_offsets, t, pending.get(w.array))
    obj_path = f"{data_dir}/objects/rank_{rank}.json"
    store.write_bytes(obj_path, objects_blob)
    checksums = {path: p.finish(f"tensor data {path!r} to {store.url!r}") for path, p in pending.items()}
    for fut in created:
        fut.result()
    store.sync()  # one flush of the whole file system instead of an fsync per chunk
    return ObjectFileMeta(rank, obj_path, len(objects_blob), zlib.crc32(objects_blob)), checksums


def _write_and_commit(comm: Comm, store: Store, local: LocalPlan, full: Optional[SavePlan], save_id: str,
                      old_data: Optional[str], structure: Any, overwrite: bool, data: Sequence[torch.Tensor],
                      objects_blob: bytes, background: bool) -> None:
    data_dir = DATA_PREFIX + save_id
    try:
        result = (_write_local(store, data_dir, local, data, objects_blob, comm.rank), None)
    except Exception as exc:  # noqa: BLE001 - reported to the coordinator, raised on every rank
        result = (None, f"{type(exc).__name__}: {exc}")

    def decide(results) -> None:
        commit.write_metadata(store, full, save_id, data_dir, comm.world_size, structure, overwrite, old_data,
                              results)

    if not background:
        commit.collect_by_collective(comm, result, decide)
        return
    board = commit.MarkerBoard(store, data_dir, comm.world_size, comm.rank)
    board.publish(result)
    if comm.is_coordinator:
        error: Optional[BaseException] = None
        try:
            decide(board.collect())
        except BaseException as exc:  # noqa: BLE001 - announced to every rank, then re-raised here
            error = exc
        board.announce(error)
        if error is not None:
            raise error
    else:
        board.outcome()


# ------------------------------------------------------------------ entry point

_EXECUTOR: Optional[ThreadPoolExecutor] = None


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bytecheckpoint-save")
    return _EXECUTOR


def save(path, state: Dict[str, Any], *, async_save: bool = False, process_group=None, overwrite: bool = False,
         storage_options: Optional[Mapping[str, Any]] = None) -> SaveHandle:
    """Save `state` to `path` from every rank of `process_group` (collective)."""
    t0 = time.perf_counter()
    _raise_finished_failures()
    comm = Comm(process_group)
    store = Store(path, storage_options)
    flat = comm.run(lambda: flatten_for_save(state), "preparing the state for save")
    objects_blob = codec.dumps(flat.objects)
    local, full, save_id, old_data = _plan(comm, store, manifest_of(flat), overwrite)
    sources = _sources(flat, local.writes)
    handle = SaveHandle(str(path))
    if not async_save:
        _write_and_commit(comm, store, local, full, save_id, old_data, flat.structure, overwrite, sources,
                          objects_blob, background=False)
        handle.stats["total_s"] = time.perf_counter() - t0
        return handle

    pool = shared_pool()
    slot = pool.acquire()
    try:
        staged = pool.stage(slot, [((w.key, w.offsets, w.lengths, t.dtype), t) for w, t in zip(local.writes, sources)])
    except BaseException:
        pool.release(slot)
        raise

    def job() -> None:
        try:
            _write_and_commit(comm, store, local, full, save_id, old_data, flat.structure, overwrite, staged,
                              objects_blob, background=True)
        finally:
            pool.release(slot)

    handle._future = _executor().submit(job)
    _executor().submit(pool.warm, slot)  # after the write, off the training thread: pre-fault the other slot
    handle.stats["stall_s"] = time.perf_counter() - t0
    with _PENDING_LOCK:
        _PENDING.append(handle)
    return handle
