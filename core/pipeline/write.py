"""Writing one save: this rank's boxes into its pack files and its plain values (write_local),
then the commit (Job: collectively for a sync save, through marker objects for an async one).
PersistentTarget is where a save to a checkpoint directory goes (the local tier has its own,
tiers/local.py); pipeline/save.py drives either.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..common.errors import CheckpointError, CheckpointExistsError
from ..collectives.comm import Comm
from ..format import chunk_tables
from ..format.metadata import Metadata, ObjectFileMeta
from ..geometry.regions import relative
from ..monitor import OFF, Recorder, record_key, write_record
from ..planning.planner import LocalPlan, SavePlan, WriteItem
from ..state.flatten import Flat, TensorEntry
from ..storage import Storage, chunks, packs
from . import commit
from .save_plan import begin, new_save_id
from .workers import Workers

DATA_PREFIX = "data-"


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


def write_local(store: Storage, workers: Workers, data_dir: str, local: LocalPlan, data: Sequence[torch.Tensor],
                objects_blob: bytes, rank: int, rec: Recorder = OFF) -> commit.WriteResult:
    """Write this rank's boxes (format 5: into its pack files, storage/packs.py) and plain values;
    returns the object file entry, the block crc32s and the pack location of every chunk it wrote."""
    arrays = {p: commit.rooted(a, data_dir) for p, a in local.arrays.items()}
    with rec.span("write.encode", count=len(data)):
        encoded = [(w.array, index, payload) for w, t in zip(local.writes, data)
                   for index, payload in chunks.encode_box(arrays[w.array], w.array_offsets, t)]
        items = [(array, chunks.chunk_name(index), payload) for array, index, payload in encoded]
    obj_path = f"{data_dir}/objects/rank_{rank}.json"
    store.prepare([obj_path])
    sums, where = packs.write(store, workers, data_dir, rank, items, chunks.block_checksums,
                              chunks.BLOCK_BYTES, rec if rec.enabled else None,
                              packs.st_arrays(local) if local.safetensors else None)
    tables = _tables(local, encoded, sums, where)
    with rec.span("write.objects", len(objects_blob), 1):
        store.put(obj_path, objects_blob)
    with rec.span("write.sync"):
        store.sync()  # durable before reporting success (big packs were fdatasync'ed as written)
    return ObjectFileMeta(rank, obj_path, len(objects_blob), zlib.crc32(objects_blob)), *tables


def _tables(local: LocalPlan, encoded, sums, where) -> tuple:
    """What this rank wrote, for the commit: as ChunkTables (global positions, no names) when the
    plan gave every array's first position, else as {array: {chunk: crc32s}}, {array: {chunk: where}}.
    A chunk given twice (a 0-d array's) counts once, its last copy."""
    bases = local.chunk_bases
    if bases and all(array in bases for array, _, _ in encoded):
        last = {chunk_tables.position(bases[array], local.arrays[array], index): i
                for i, (array, index, _) in enumerate(encoded) if where[i] is not None}
        return chunk_tables.ChunkTables.build(list(last), [sums[i] for i in last.values()],
                                              [where[i] for i in last.values()]), None
    checksums: Dict[str, Dict[str, Any]] = {}
    locations: Dict[str, Dict[str, Any]] = {}
    for (array, index, _), crcs, at in zip(encoded, sums, where):
        if at is not None:
            checksums.setdefault(array, {})[chunks.chunk_name(index)] = crcs
            locations.setdefault(array, {})[chunks.chunk_name(index)] = at
    return checksums, locations


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
    rec: Recorder = OFF                     # this rank's record of the save (monitor/)
    before_commit: Optional[Callable[[Metadata], None]] = None  # coordinator, before the commit point

    @property
    def data_dir(self) -> str:
        return self.data_prefix + self.save_id

    def board(self, timeout_s: float, dead_peer_s: float) -> commit.MarkerBoard:
        return commit.MarkerBoard(self.store, self.data_dir, self.comm.world_size, self.comm.rank, timeout_s,
                                  dead_peer_s)

    def _decide(self, results) -> None:
        with self.rec.span("commit.metadata"):
            commit.write_metadata(self.store, self.full, self.save_id, self.data_dir, self.comm.world_size,
                                  self.structure, self.overwrite, self.old_data, results, self.info,
                                  self.before_commit)

    def _write(self, workers: Workers, data: Sequence[torch.Tensor]
               ) -> Tuple[commit.RankResult, Optional[Exception]]:
        try:
            with self.rec.span("write", sum(t.numel() * t.element_size() for t in data) if self.rec.enabled else 0,
                               len(data)):
                return (write_local(self.store, workers, self.data_dir, self.local, data, self.objects_blob,
                                    self.comm.rank, self.rec), None), None
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, raised on every rank
            return (None, f"{type(exc).__name__}: {exc}"), exc

    def _record(self, error: Optional[BaseException]) -> None:
        """This rank's record beside the data (after the commit or the failure; never part of it)."""
        lost = isinstance(error, CheckpointExistsError) or "CheckpointExistsError" in str(error or "")
        if self.rec.enabled and not lost:  # a losing job's data dir is gone: leave nothing behind
            write_record(self.rec, self.store, record_key(self.data_dir, "save", self.comm.rank), error)

    def run_sync(self, workers: Workers, data: Sequence[torch.Tensor]) -> None:
        """On the caller's thread: write, then commit through a gather + broadcast."""
        error: Optional[BaseException] = None
        try:
            result, error = self._write(workers, data)
            if self.comm.world_size == 1 and error is not None:
                raise error
            commit.collect_by_collective(self.comm, result, self._decide, self.rec)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._record(error)

    def run_background(self, workers: Workers, data: Sequence[torch.Tensor], board: commit.MarkerBoard,
                       queued: Optional[float] = None) -> None:
        """On a background thread: write, then commit through marker objects (no collectives:
        training may tear its process group down while this runs). A save of one rank commits
        directly: nobody needs its markers. `queued`: when the job was handed over (perf_counter)."""
        if queued is not None:
            self.rec.add("queue", queued, time.perf_counter())
        error: Optional[BaseException] = None
        try:
            self._commit_background(workers, data, board)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._record(error)

    def _commit_background(self, workers: Workers, data: Sequence[torch.Tensor], board: commit.MarkerBoard) -> None:
        result, error = self._write(workers, data)
        if self.comm.world_size == 1:
            if error is not None:
                raise error
            self._decide([result])
            return
        try:
            board.publish(result)
            if not self.comm.is_coordinator:
                with self.rec.span("commit.outcome"):
                    board.outcome()
                return
        except BaseException as exc:
            # this rank's own write failed first (a full disk, EIO): that is the cause to report, not the
            # marker it could not write or the outcome a coordinator on the same failing storage never wrote
            if error is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise error from exc
            raise
        error: Optional[BaseException] = None
        try:
            with self.rec.span("commit.wait"):
                results = board.collect()
            self._decide(results)
        except BaseException as exc:  # noqa: BLE001 - announced to every rank, then re-raised here
            error = exc
        try:
            board.announce(error)
        except Exception as exc:  # the storage failing the outcome marker too: the first cause stays the error
            if error is not None:
                raise error from exc
            raise
        if error is not None:
            raise error


@dataclass
class Written:
    """How a target writes and commits one planned save: `run_sync(workers, data)` on the caller's
    thread, or `start_background()` -> (run(workers, data), start_heartbeat or None) for an async
    save (the heartbeat starts on the background thread: peers can tell this rank is alive)."""
    run_sync: Callable[[Workers, Sequence[torch.Tensor]], None]
    start_background: Callable[[], Tuple[Callable[[Workers, Sequence[torch.Tensor]], None], Optional[Callable]]]


class PersistentTarget:
    """A save to a checkpoint directory or object-store prefix (the usual target)."""

    def __init__(self, open_store: Callable[[], Storage], overwrite: bool,
                 read_metadata: Callable[[Storage], Metadata], timeout_s: float, dead_peer_s: float,
                 rec: Recorder = OFF, before_commit: Optional[Callable[[Metadata], None]] = None) -> None:
        self._open_store, self.overwrite, self._read_metadata = open_store, overwrite, read_metadata
        self.timeout_s, self.dead_peer_s, self.rec = timeout_s, dead_peer_s, rec
        self.before_commit = before_commit
        self.store: Optional[Storage] = None

    def open(self, comm: Comm) -> None:
        """Foreground, after the walk: the storage, and every rank's arrival (bounded)."""
        store = self.store = self._open_store()
        if store.read_only:
            raise CheckpointError(f"{store.url!r} is read-only ({store.scheme}://): save to a local path, s3:// "
                                  f"or gs://")
        comm.arrive(self.timeout_s, f"save to {store.url!r}")

    def begin(self) -> Tuple[str, Optional[str]]:
        return begin(self.store, self.overwrite, self._read_metadata)

    def writer(self, comm: Comm, local: LocalPlan, full: Optional[SavePlan], save_id: str, old_data: Optional[str],
               structure: Any, objects_blob: bytes, info: Dict[str, Any]) -> Written:
        job = Job(comm, self.store, local, full, save_id, old_data, structure, self.overwrite, objects_blob,
                  info=info, rec=self.rec, before_commit=self.before_commit)

        def start_background():
            board = job.board(self.timeout_s, self.dead_peer_s)
            queued = time.perf_counter()
            return ((lambda workers, data: job.run_background(workers, data, board, queued)),
                    lambda: board.heartbeat().start())
        return Written(job.run_sync, start_background)


class WarmUpTarget:
    """warm_up's target: planning only (no storage, nothing written)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def open(self, comm: Comm) -> None:
        comm.arrive(self.timeout_s, "warm-up")

    def begin(self) -> Tuple[str, Optional[str]]:
        return new_save_id(), None
