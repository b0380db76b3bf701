"""The load pipeline: load in place, and load_full without a template.

The Checkpointer reads the metadata once (coordinator, through its cache) and broadcasts it; each
rank plans its reads from metadata alone, reads only the chunks it needs with many reads in
flight, and copies each result into its target as soon as it arrives. Bytes that several ranks
need are read once and shared when the Checkpointer's policy says it pays (dist/zero_redundancy.py).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..common import dtypes
from ..common.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
    partly_written,
)
from ..collectives import zero_redundancy
from ..collectives.comm import Comm
from ..format.metadata import METADATA_FILE, Metadata, dtype_itemsize
from ..monitor import OFF, Phase, Recorder, load_metrics, record_key, write_record
from ..planning.planner import ReadItem, TargetSpec, check_targets, plan_load
from ..state.flatten import Flat, TypeRegistry, build_from_structure, find_subtree, flatten_for_load, structure_leaves
from ..storage import Storage, chunks, packs
from . import device_reads, plain_values
from .plain_values import read_objects
from .workers import Workers
from .write import DATA_PREFIX


class LoadStats:
    """Bytes this rank read from storage and received from peers during the last load, how long
    it took (total_s) and, with recording on, its phases (docs/monitoring.md)."""

    def __init__(self, rec: Recorder = OFF) -> None:
        self.rec = rec
        self.total_s: Optional[float] = None
        self.bytes_read = 0
        self.bytes_received = 0
        self.reads = 0
        self.pinned_bytes = 0      # page-locked host memory the load's device path used (its slabs)
        self.device_bytes = 0      # bytes that went to device tensors through those slabs
        self.optimizer_state: Dict[str, str] = {}  # optimizer key -> how its fresh state was made

    @property
    def phases(self) -> Dict[str, Phase]:
        return self.rec.phases()

    @property
    def record(self) -> Optional[Dict[str, Any]]:
        """This rank's record of the load (None with recording off)."""
        return self.rec.to_json() if self.rec.enabled and self.rec.done else None

    def metrics(self, prefix: str = "checkpoint/") -> Dict[str, float]:
        """checkpoint/load_s, load_bytes (read + received), load_mb_s."""
        return load_metrics(self.total_s, self.bytes_read + self.bytes_received, prefix)

    @contextlib.contextmanager
    def finishing(self, store: Storage, md: Metadata, keep: bool) -> Iterator[None]:
        """Around a load: finish() with its outcome."""
        try:
            yield
        except BaseException as exc:
            self.finish(store, md, keep, exc)
            raise
        self.finish(store, md, keep)

    def finish(self, store: Optional[Storage], md: Optional[Metadata], keep: bool,
               error: Optional[BaseException] = None) -> None:
        """The load ended on this rank: its time, and (keep) its record beside the checkpoint in
        data-<id>/stats/load/ (one per rank, replaced by the next load; never raises)."""
        self.total_s = time.perf_counter() - self.rec.perf0 if self.rec.enabled else self.total_s
        data_dir = md.info.get("data_dir") if md is not None else None
        if keep and isinstance(data_dir, str) and data_dir:
            write_record(self.rec, store, record_key(data_dir, "load", self.rec.rank), error)
        else:
            self.rec.finish(error)

    def __repr__(self) -> str:
        return (f"LoadStats(total_s={self.total_s}, bytes_read={self.bytes_read}, "
                f"bytes_received={self.bytes_received}, reads={self.reads}, "
                f"pinned_bytes={self.pinned_bytes}, device_bytes={self.device_bytes}, "
                f"optimizer_state={self.optimizer_state})")


def missing_metadata_error(store: Storage) -> Exception:
    """Why a root without metadata.json is not loaded: incomplete save, or no checkpoint at all."""
    if store.exists_any() and any(k.startswith(DATA_PREFIX) for k in store.list()):
        return IncompleteCheckpointError(
            f"{store.url!r} holds checkpoint data but no {METADATA_FILE}: the save that wrote it did not "
            f"finish (it crashed, or is still running). It is not loaded; use an earlier checkpoint")
    return CheckpointNotFoundError(
        f"{store.url!r} is not a bytecheckpoint checkpoint (no {METADATA_FILE}); check the path")


def parse_metadata(store: Storage, raw: bytes) -> Metadata:
    return Metadata.from_json(raw, f"{store.url.rstrip('/')}/{METADATA_FILE}", fetch=store.get)


def read_metadata(store: Storage) -> Metadata:
    raw = store.get(METADATA_FILE)
    if raw is None:
        raise missing_metadata_error(store)
    return parse_metadata(store, raw)


# ------------------------------------------------------------------ reading tensors

Needs = Dict[Tuple[str, Tuple[int, ...]], List[Tuple[Any, torch.Tensor]]]


def chunk_needs(md: Metadata, reads: Sequence[ReadItem], dests: Sequence[torch.Tensor]) -> Needs:
    """Group the read items by the stored chunks they touch: chunk -> [(part, destination view)].

    Chunks are the unit of reading: each is read whole (so its checksum is checked) and once."""
    needs: Needs = {}
    for r, dest in zip(reads, dests):
        meta = md.arrays[r.array]
        for index, part, view in chunks.chunk_parts(meta, r.array_box, dest):
            needs.setdefault((r.array, index), []).append((part, view))
    return needs


def read_chunks(store: Storage, workers: Workers, md: Metadata, needs: Needs, stats: LoadStats, what: str,
                slabs: Optional[device_reads.PinnedSlabs] = None) -> None:
    """Read every needed chunk (all in flight at once), check it, copy its parts into place. A
    chunk that fills one contiguous target is read straight into it; a chunk needed only in part
    is read as the checksum blocks that hold that part (chunks.ChunkRead). Whole chunks that lie
    near each other in one pack file (format 5) are read by one request (packs.plan_runs).
    Chunks bound for device tensors go through `slabs` (pinned, overlapped: pipeline/device_reads.py)."""
    if slabs is not None:
        staged, needs = device_reads.split_needs(md.arrays, needs, slabs.slab_bytes, device_reads.staged_destination)
        if staged:
            before = stats.bytes_read
            mover = device_reads.mover_for(staged, slabs)
            device_reads.read_staged(store, workers, md.arrays, staged, slabs, mover, what, stats)
            stats.device_bytes += stats.bytes_read - before
            stats.pinned_bytes = max(stats.pinned_bytes, slabs.nbytes)
    located, rest = [], []
    for ref, parts in needs.items():
        meta = md.arrays[ref[0]]
        if meta.locations and chunks.lands_whole(meta, parts):
            key, offset = chunks.chunk_location(meta, ref[1])
            located.append((key, offset, chunks.chunk_bytes_len(meta), (ref, parts[0][1])))
        else:
            rest.append((ref, parts))
    started = [(ref, chunks.ChunkRead(store, md.arrays[ref[0]], ref[1], parts)) for ref, parts in rest]

    rec = stats.rec

    def finish(ref, read) -> int:  # I/O, checksum and copy release the GIL: run on the worker pool
        t0 = time.perf_counter()
        n = read.finish(f"{what} {ref[0]!r}", dtypes.to_torch(md.arrays[ref[0]].dtype))
        rec.add("read.partial", t0, time.perf_counter(), n, 1)
        return n

    def finish_run(run: packs.Run, views, request) -> int:
        t0 = time.perf_counter()
        chunks.wait_for(request, run.key, what)
        t1 = time.perf_counter()
        for (_, (ref, _)), view in zip(run.members, views):
            chunks.check(view, md.arrays[ref[0]], ref[1], f"{what} {ref[0]!r}")
        n = sum(len(v) for v in views)
        rec.add("read.io", t0, t1, n, len(views))
        rec.add("read.check", t1, time.perf_counter(), n, len(views))
        return n

    runs = []  # every request started at once (object stores: all in flight; local files: run lazily by a worker)
    for run in packs.plan_runs(located):
        views = [chunks.uint8_view(dest) for _, (_, dest) in run.members]
        runs.append((run, views, store.read_range_into(run.key, run.start, packs.scatter_list(run, views))))
    for nbytes in workers.map(finish_run, runs):
        stats.bytes_read += nbytes
        stats.reads += 1
    for nbytes in workers.map(finish, started):
        stats.bytes_read += nbytes
        stats.reads += 1


def target_view(piece: torch.Tensor, box) -> torch.Tensor:
    offs, lens = box
    if not lens:
        return piece
    return piece[tuple(slice(o, o + n) for o, n in zip(offs, lens))]


def full_target(md: Metadata, key: str) -> Tuple[torch.Tensor, TargetSpec]:
    """A new tensor for the whole of a saved tensor, and its load target (sizes checked first:
    the metadata is untrusted input)."""
    meta = md.tensors[key]
    stored = sum(math.prod(r.lengths) for r in meta.regions) * max(1, dtype_itemsize(meta.dtype))
    if meta.nbytes > stored or meta.nbytes > _physical_memory():
        raise CheckpointError(f"tensor {key!r}: metadata claims shape {list(meta.shape)} ({meta.nbytes} bytes), "
                              f"more than is stored or fits in memory; the checkpoint is damaged")
    t = torch.empty(meta.shape, dtype=dtypes.to_torch(meta.dtype))
    return t, TargetSpec(key, meta.dtype, meta.shape, (((0,) * len(meta.shape), meta.shape),))


def read_full_tensors(store: Storage, workers: Workers, md: Metadata, keys: Sequence[str],
                      stats: Optional[LoadStats] = None) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    reads: List[ReadItem] = []
    dest: List[torch.Tensor] = []
    targets = []
    for key in keys:
        out[key], spec = full_target(md, key)
        targets.append(spec)
    for r in plan_load(md.tensors, targets):
        reads.append(r)
        dest.append(target_view(out[r.key], r.target_box))
    read_chunks(store, workers, md, chunk_needs(md, reads, dest), stats or LoadStats(), "reading")
    return out


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


# ------------------------------------------------------------------ load

def _check_keys(flat: Flat, md: Metadata, strict: bool, ranks: int = 1) -> Tuple[List[str], List[str]]:
    """(missing, unexpected) keys of this rank's state against the checkpoint; a strict load raises
    for missing ones here. Unexpected ones are this rank's view only: with ranks holding different
    parts (pipeline stages, experts) a key another rank loads is not unexpected (global_unexpected)."""
    saved = structure_leaves(md.structure)
    for key in md.tensors:
        saved.setdefault(key, "tensor")
    wanted = set(flat.tensors) | set(flat.setters)
    # a plain value in the target may stand for a whole saved container of values
    for k in [k for k in flat.setters if k not in saved and find_subtree(md.structure, k) is not None]:
        wanted.discard(k)
        prefixes_extra = k + "/"
        saved = {s: kind for s, kind in saved.items() if not s.startswith(prefixes_extra)}
    missing = sorted(k for k in wanted if k not in saved)
    prefixes = tuple(p + "/" for p in flat.subtrees)
    unexpected = sorted(k for k in saved if k not in wanted and k not in flat.subtrees
                        and not (prefixes and k.startswith(prefixes)))
    missing_sub = sorted(p for p in flat.subtrees if find_subtree(md.structure, p) is None)
    missing += missing_sub
    if strict and missing:
        _mismatch(missing, unexpected, "the state" if ranks == 1 else "this rank's state")
    for k in flat.tensors:
        if k in saved and saved[k] != "tensor":
            raise StateMismatchError(f"key {k!r}: the state has a tensor but the checkpoint stored a plain value")
    return missing, unexpected


def _mismatch(missing: List[str], unexpected: List[str], state: str = "the state") -> None:
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {_list(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in {state}: {_list(unexpected)}")
    raise StateMismatchError("keys do not match (strict=True): " + "; ".join(parts) +
                             ". Pass strict=False to load the keys both have")


def global_unexpected(comm: Comm, md: Metadata, unexpected: List[str]) -> List[str]:
    """Collective: the keys no rank loads among this rank's `unexpected` (the same list on every
    rank). One all-reduce when no rank has any; else one more over a flag per saved key."""
    if comm.min_int(0 if unexpected else 1) == 1:
        return []
    keys = sorted(set(structure_leaves(md.structure)) | set(md.tensors))
    mine = set(unexpected)
    left = comm.all_of([k in mine for k in keys])
    return [k for k, flag in zip(keys, left) if flag]


def _raise_unexpected(unexpected: List[str]) -> None:
    if unexpected:
        _mismatch([], unexpected, "the state of any rank")


def _list(keys: List[str], n: int = 20) -> str:
    return ", ".join(repr(k) for k in keys[:n]) + (f" (and {len(keys) - n} more)" if len(keys) > n else "")


def load(comm: Comm, store: Storage, workers: Workers, md: Metadata, state: Dict[str, Any], *, strict: bool,
         allow_pickle: bool, shared, stats: LoadStats, registry: TypeRegistry,
         fsdp1_route: str = "flat", slabs: Optional[device_reads.PinnedSlabs] = None) -> Dict[str, Any]:
    """Load `md`'s checkpoint into `state` in place (collective over comm); returns `state`.
    `shared(comm, md, needs)` plans which chunks one rank reads for others and broadcasts
    (zero-redundancy; or `zero_redundancy.no_sharing`): every other chunk is read locally."""

    prepared: List[Flat] = []  # what preparing made is taken back if the load fails, on any rank

    def prepare():
        prepared.append(flatten_for_load(state, registry, md.structure, fsdp1_route))
        return plan(prepared[0])

    def plan(flat: Flat):
        missing, unexpected = _check_keys(flat, md, strict, comm.world_size)
        saved = structure_leaves(md.structure)
        # a plain value in the target that the checkpoint holds as a container is read whole
        for key in [k for k in flat.setters if saved.get(k) != "object" and find_subtree(md.structure, k) is not None]:
            flat.subtrees.setdefault(key, flat.setters.pop(key))
        targets = []
        for e in flat.tensors.values():
            if e.key in md.tensors:
                targets.append(TargetSpec(e.key, dtypes.name_of(e.dtype), e.shape,
                                          tuple((p.offsets, p.lengths) for p in e.pieces)))
        check_targets(md.tensors, targets)
        # tensors of values read whole (placeholders, Stateful objects) join the same read plan,
        # so they are shared and resharded like any other target
        whole: Dict[str, torch.Tensor] = {}
        for prefix in flat.subtrees:
            node = find_subtree(md.structure, prefix)
            for key, kind in (structure_leaves(node).items() if node is not None else ()):
                if kind == "tensor" and key not in flat.tensors and key not in whole:
                    whole[key], spec = full_target(md, key)
                    targets.append(spec)
        return flat, missing, unexpected, plan_load(md.tensors, targets), whole

    try:
        flat, missing, unexpected, reads, whole = timed_run(comm, stats.rec, "plan.load", prepare,
                                                            f"planning the load of {store.url!r}")
        if strict:
            _raise_unexpected(global_unexpected(comm, md, unexpected))
        stats.optimizer_state.update(flat.notes)
        _read_into(comm, store, workers, md, flat, reads, whole, shared, stats, allow_pickle, slabs, strict)
    except BaseException:
        for flat in prepared:
            _undo(flat)
        raise
    return state


def _undo(flat: Flat) -> None:
    """Take back what preparing the load made (a fresh optimizer's state): a failed load leaves it
    as it was."""
    for fn in reversed(flat.undo):
        fn()


def _read_into(comm: Comm, store: Storage, workers: Workers, md: Metadata, flat: Flat, reads, whole, shared,
               stats: LoadStats, allow_pickle: bool, slabs, strict: bool = True) -> None:
    """Read the planned chunks into their targets, then the plain values; run the finalizers."""

    def dest_of(r: ReadItem) -> torch.Tensor:
        if r.key in whole:
            return target_view(whole[r.key], r.target_box)
        return target_view(flat.tensors[r.key].pieces[r.piece].tensor, r.target_box)

    rec = stats.rec

    def read_values():
        """The plain values, read and checked against the template before any tensor is written."""
        if not (flat.setters or flat.subtrees):
            return {}, {}
        saved = structure_leaves(md.structure)
        needed = list(flat.setters) + [k for prefix in flat.subtrees
                                       for k, kind in structure_leaves(find_subtree(md.structure, prefix)).items()
                                       if kind == "object"]
        notes: List[str] = []
        objects = read_objects(store, md, comm.rank, allow_pickle, needed, comm.world_size, notes)
        plain_values.report(notes, comm.rank)
        filled = {}
        for key in flat.setters:
            if saved.get(key) == "object" and key not in objects:
                raise CorruptCheckpointError(f"{store.url!r}: plain value {key!r} is listed in the metadata but "
                                             f"missing from its rank file; the checkpoint is damaged")
            if key in objects:
                filled[key] = plain_values.filled(flat.templates.get(key), objects[key], key, strict)
        return objects, filled

    objects, filled = timed_run(comm, rec, "values", read_values, f"loading {store.url!r}")
    needs = chunk_needs(md, reads, [dest_of(r) for r in reads])
    with rec.span("share.plan"):
        shared = shared(comm, md, needs)

    # the chunks only this rank needs, then the shared ones (read once, broadcast, pipelined)
    try:
        before = (stats.bytes_read, stats.reads)
        timed_run(comm, rec, "read", lambda: read_chunks(store, workers, md, shared.local_needs(needs), stats,
                                                         "loading", slabs),
                  f"reading {store.url!r}", lambda: (stats.bytes_read - before[0], stats.reads - before[1]))
        if shared.by_reader:
            with rec.span("exchange") as span:
                zero_redundancy.exchange(comm, store, workers, md, shared, needs, stats)
                span.nbytes = stats.bytes_received
    except CheckpointError as exc:  # the state's tensors were being written: say so
        raise partly_written(exc)

    def assign_all():
        for key, assign in flat.setters.items():
            if key in filled:
                assign(filled[key])
        if flat.subtrees:
            tensors = {**whole, **{k: e.pieces[0].tensor for k, e in flat.tensors.items() if len(e.pieces) == 1}}
            for prefix, consume in flat.subtrees.items():
                node = find_subtree(md.structure, prefix)
                if node is not None:
                    consume(build_from_structure(node, tensors, objects))
        for fin in flat.finalizers + flat.after:
            fin()

    timed_run(comm, rec, "objects", assign_all, f"loading {store.url!r}")


def timed_run(comm: Comm, rec: Recorder, name: str, fn, what: str, measure=None):
    """comm.run(fn) recorded as `name` (fn on this rank; `measure()` -> (bytes, count) after it) and
    `name`.wait (from there until every rank agreed)."""
    if not rec.enabled:
        return comm.run(fn, what)
    ended: List[float] = []

    def timed():
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            ended.append(time.perf_counter())
            rec.add(name, t0, ended[0], *(measure() if measure is not None else ()))
    try:
        return comm.run(timed, what)
    finally:
        if ended:
            rec.add(name + ".wait", ended[0], time.perf_counter())


def load_full(comm: Comm, store: Storage, workers: Workers, md: Metadata, *, keys: Optional[Sequence[str]],
              allow_pickle: bool, stats: Optional[LoadStats] = None, per_rank: bool = False) -> Any:
    """The saved state as nested dicts/lists with full CPU tensors and plain values (no template).
    `keys` limits it to some top-level keys. Every rank reads what it returns. Plain values that
    differ between the saved ranks are merged (plain_values.py); `per_rank`: a list with each saved
    rank's state as it saved its plain values (the tensors shared between them)."""

    def read() -> Dict[str, Any]:
        root = md.structure
        if keys is not None:
            nodes = {}
            for k in keys:
                node = find_subtree(root, str(k))
                if node is None:
                    top = sorted(structure_leaves(root))
                    raise StateMismatchError(f"key {k!r} is not in the checkpoint; top-level keys: "
                                             f"{_list(sorted({t.split('/')[0] for t in top}))}")
                nodes[k] = node
        else:
            nodes = None
        wanted = structure_leaves(root) if nodes is None else {
            k: v for n in nodes.values() for k, v in structure_leaves(n).items()}
        tensors = read_full_tensors(store, workers, md, [k for k, kind in wanted.items() if kind == "tensor"], stats)
        object_keys = [k for k, kind in wanted.items() if kind == "object"]

        def build(objects: Dict[str, Any]) -> Dict[str, Any]:
            if nodes is None:
                return build_from_structure(root, tensors, objects)
            return {k: build_from_structure(n, tensors, objects) for k, n in nodes.items()}
        if per_rank and md.foreign is None:
            return [build(read_objects(store, md, r, allow_pickle, object_keys) if object_keys else {})
                    for r in range(md.world_size)]
        notes: List[str] = []
        objects = read_objects(store, md, comm.rank, allow_pickle, object_keys, comm.world_size, notes) \
            if object_keys else {}
        plain_values.report(notes, comm.rank)
        return [build(objects)] if per_rank else build(objects)

    stats = stats if stats is not None else LoadStats()
    return timed_run(comm, stats.rec, "read", read, f"reading {store.url!r}", lambda: (stats.bytes_read, stats.reads))
