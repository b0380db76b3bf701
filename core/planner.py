"""Pure planners: gather -> pure function -> scatter, the DCP way.

`plan_save` turns every rank's manifest (which boxes of which tensors it holds) into who writes
what where: replicated boxes are written once, big replicated boxes are split so that the
writes are spread over their holders, and each written box gets a chunk-aligned place in a
zarr array. `plan_load` turns the metadata and one rank's targets into the sub-boxes to read.
`assign_readers` picks one reader for bytes several ranks need (zero-redundancy load).
Nothing here does I/O or talks to other processes: unit tests build "rank 0..N" plans directly.
"""
from __future__ import annotations

import bisect
import gc
import heapq
import math
import re
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .errors import ShardLayoutError, StateMismatchError
from .metadata import DTYPES, ArrayMeta, RegionMeta, TensorMeta, dtype_itemsize
from .regions import Box, chunk_count, chunk_grid, find_layout_problem, intersect, volume

# Replicated boxes at least this big are split among their holders so writes are balanced.
SPLIT_MIN_BYTES = 1 << 20
# Chunks are refined (along dim 0) towards this size so one rank's writes run in parallel.
CHUNK_TARGET_BYTES = 16 << 20
# Per-tensor chunk grids with more than this many chunks per saved region fall back to one zarr
# array per region (avoids millions of tiny chunk files).
MAX_CHUNKS_PER_REGION = 16


@dataclass(frozen=True)
class TensorManifest:
    """What one rank holds of one tensor."""
    key: str
    dtype: str
    shape: Tuple[int, ...]
    layout: str
    boxes: Tuple[Box, ...]


RankManifest = Tuple[TensorManifest, ...]


@dataclass(frozen=True)
class WriteItem:
    key: str
    offsets: Tuple[int, ...]
    lengths: Tuple[int, ...]
    array: str                      # array path relative to the save's data directory
    array_offsets: Tuple[int, ...]


@dataclass(frozen=True)
class SavePlan:
    writes: Tuple[Tuple[WriteItem, ...], ...]   # per rank
    creates: Tuple[Tuple[str, ...], ...]        # per rank: arrays whose zarr.json it writes
    tensors: Mapping[str, TensorMeta]           # array paths relative to the data directory
    arrays: Mapping[str, ArrayMeta]
    bytes_per_rank: Tuple[int, ...]


def plan_save(manifests: Sequence[RankManifest]) -> SavePlan:
    # Millions of small tuples at scale: the cyclic GC would rescan them over and over (2x time).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan_save(manifests)
    finally:
        if was_enabled:
            gc.enable()


def _plan_save(manifests: Sequence[RankManifest]) -> SavePlan:
    world = len(manifests)
    by_key: Dict[str, List[Tuple[int, TensorManifest]]] = defaultdict(list)
    for rank, manifest in enumerate(manifests):
        for item in manifest:
            by_key[item.key].append((rank, item))

    loads = [0] * world
    writes: List[List[WriteItem]] = [[] for _ in range(world)]
    creates: List[List[str]] = [[] for _ in range(world)]
    tensors: Dict[str, TensorMeta] = {}
    arrays: Dict[str, ArrayMeta] = {}
    units_by_key: Dict[str, List[Tuple[Box, Tuple[int, ...]]]] = {}

    # 1. validate and dedup; boxes held by a single rank are fixed load for that rank.
    flexible: List[Tuple[int, str, Box, Tuple[int, ...]]] = []
    for key in sorted(by_key):
        entries = by_key[key]
        first_rank, first = entries[0]
        for rank, item in entries[1:]:
            if item.dtype != first.dtype or item.shape != first.shape:
                raise ShardLayoutError(
                    f"tensor {key!r}: rank {first_rank} has dtype {first.dtype} shape {list(first.shape)} but "
                    f"rank {rank} has dtype {item.dtype} shape {list(item.shape)}; every rank must describe the "
                    f"same global tensor")
        holders: Dict[Box, List[int]] = {}
        for rank, item in entries:
            for box in item.boxes:
                holders.setdefault(box, []).append(rank)
        boxes = list(holders)
        problem = find_layout_problem(first.shape, boxes)
        if problem is not None:
            msg, idx = problem
            who = ", ".join(f"{_fmt_box(boxes[i])} on ranks {holders[boxes[i]]}" for i in idx[:4])
            raise ShardLayoutError(f"tensor {key!r}: {msg} ({who}); shards must tile the global shape "
                                   f"exactly (identical copies are fine)")
        itemsize = dtype_itemsize(first.dtype)
        units: List[Tuple[Box, Tuple[int, ...]]] = []
        for box, ranks in holders.items():
            for part in _split_for_balance(box, len(ranks), itemsize):
                units.append((part, tuple(ranks)))
        units_by_key[key] = units
        for part, ranks in units:
            nbytes = volume(part[1]) * itemsize
            if len(ranks) == 1:
                loads[ranks[0]] += nbytes
            else:
                flexible.append((nbytes, key, part, ranks))

    # 2. spread the replicated pieces: largest first, each to its least-loaded holder (LPT).
    #    One lazy min-heap per holder set (stale entries are refreshed when popped), so a tensor
    #    replicated on 4096 ranks costs log(4096), not 4096, per piece.
    writer_of: Dict[Tuple[str, Box], int] = {}
    heaps: Dict[Tuple[int, ...], List[Tuple[int, int]]] = {}
    for nbytes, key, part, ranks in sorted(flexible, key=lambda u: (-u[0], u[1], u[2])):
        heap = heaps.get(ranks)
        if heap is None:
            heap = heaps[ranks] = [(loads[r], r) for r in ranks]
            heapq.heapify(heap)
        while True:
            load, rank = heap[0]
            if load == loads[rank]:
                break
            heapq.heapreplace(heap, (loads[rank], rank))
        loads[rank] += nbytes
        heapq.heapreplace(heap, (loads[rank], rank))
        writer_of[(key, part)] = rank

    # 3. arrays and chunk grids; every chunk lies inside one written box.
    used_names: Dict[str, str] = {}
    for key, units in units_by_key.items():
        first = by_key[key][0][1]
        name = array_name(key, used_names)
        boxes = [box for box, _ in units]
        grid = _refine(chunk_grid(first.shape, boxes), first.shape, dtype_itemsize(first.dtype))
        one_array = chunk_count(first.shape, grid) <= MAX_CHUNKS_PER_REGION * max(1, len(units))
        regions: List[RegionMeta] = []
        for i, (box, ranks) in enumerate(sorted(units)):
            writer = writer_of.get((key, box), ranks[0])
            if one_array:
                array, aoffs = name, box[0]
                if i == 0:
                    arrays[name] = ArrayMeta(name, first.shape, grid, first.dtype)
                    creates[writer].append(name)
            else:
                array, aoffs = f"{name}/r{i}", (0,) * len(box[0])
                chunks = _refine(tuple(max(1, l) for l in box[1]), box[1], dtype_itemsize(first.dtype))
                arrays[array] = ArrayMeta(array, box[1], chunks, first.dtype)
                creates[writer].append(array)
            regions.append(RegionMeta(box[0], box[1], array, tuple(aoffs), writer))
            writes[writer].append(WriteItem(key, box[0], box[1], array, tuple(aoffs)))
        layouts = {item.layout for _, item in by_key[key]}
        layout = "flat" if "flat" in layouts else "sharded" if "sharded" in layouts else "replicated"
        tensors[key] = TensorMeta(key, first.dtype, first.shape, layout, len(by_key[key]), tuple(regions))
    return SavePlan(tuple(tuple(w) for w in writes), tuple(tuple(c) for c in creates), tensors, arrays,
                    tuple(loads))


def _split_for_balance(box: Box, holders: int, itemsize: int) -> List[Box]:
    """Cut a replicated box into row blocks of at least SPLIT_MIN_BYTES (never more blocks than
    holders), so that LPT can spread big replicated tensors without shredding them."""
    offsets, lengths = box
    nbytes = volume(lengths) * itemsize if lengths else 0
    if holders < 2 or not lengths or nbytes < 2 * SPLIT_MIN_BYTES or lengths[0] < 2:
        return [box]
    parts, rows = min(holders, lengths[0], nbytes // SPLIT_MIN_BYTES), lengths[0]
    step = -(-rows // parts)
    out = []
    for start in range(0, rows, step):
        n = min(step, rows - start)
        out.append(((offsets[0] + start,) + offsets[1:], (n,) + lengths[1:]))
    return out


def _refine(grid: Tuple[int, ...], shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    """Divide the dim-0 chunk size by a whole factor until chunks are near CHUNK_TARGET_BYTES."""
    if not grid:
        return grid
    chunk_bytes = volume(grid) * itemsize
    rows = grid[0]
    if chunk_bytes <= CHUNK_TARGET_BYTES or rows < 2:
        return grid
    want = max(1, rows * CHUNK_TARGET_BYTES // chunk_bytes)
    for f in range(max(2, -(-rows // want)), rows + 1):
        if rows % f == 0:
            return (rows // f,) + tuple(grid[1:])
    return grid


_UNSAFE = re.compile(r"[^A-Za-z0-9_.=+-]")


def array_name(key: str, used: Dict[str, str]) -> str:
    """A readable, filesystem-safe, collision-free directory name for a tensor key."""
    base = _UNSAFE.sub("_", key.replace("/", "."))[:120].strip(".") or "t"
    name = f"{base}~{zlib.crc32(key.encode()):08x}"
    while name in used and used[name] != key:
        name += "_"
    used[name] = key
    return name


def _fmt_box(box: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + l}" for o, l in zip(*box)) + "]"


# ------------------------------------------------------------------ load planning

@dataclass(frozen=True)
class ReadItem:
    key: str
    piece: int                        # index of the target piece on this rank
    array: str                        # array path relative to the checkpoint root
    array_box: Box                    # box inside that array
    target_box: Box                   # box inside the target piece (relative offsets)
    region: Box                       # the saved region it comes from, in global coordinates
    global_box: Box                   # the box read, in global coordinates


@dataclass(frozen=True)
class TargetSpec:
    key: str
    dtype: str
    shape: Tuple[int, ...]
    pieces: Tuple[Box, ...]


def check_targets(tensors: Mapping[str, TensorMeta], targets: Iterable[TargetSpec]) -> None:
    for t in targets:
        meta = tensors[t.key]
        if tuple(meta.shape) != tuple(t.shape):
            raise StateMismatchError(
                f"tensor {t.key!r}: the checkpoint has global shape {list(meta.shape)} but the target has "
                f"{list(t.shape)}; build the model with the same configuration, or load with strict=False and "
                f"drop this key from the state")
        if meta.dtype != t.dtype:
            raise StateMismatchError(
                f"tensor {t.key!r}: the checkpoint has dtype {meta.dtype} but the target has {t.dtype}; cast the "
                f"model (e.g. model.to(torch.{meta.dtype})) before loading, then cast back")


def plan_load(tensors: Mapping[str, TensorMeta], targets: Iterable[TargetSpec]) -> List[ReadItem]:
    """For each target piece: the overlapping saved regions and the sub-box to read from each."""
    reads: List[ReadItem] = []
    for t in targets:
        meta = tensors[t.key]
        candidates = _RegionIndex(meta.regions)
        for pi, piece in enumerate(t.pieces):
            for region in candidates.overlapping(piece):
                rbox = (region.offsets, region.lengths)
                inter = intersect(piece, rbox)
                if inter is None or volume(inter[1]) == 0 and volume(piece[1]) != 0:
                    continue
                if not meta.shape:
                    inter = ((), ())
                a_offs = tuple(io - ro + ao for io, ro, ao in zip(inter[0], region.offsets, region.array_offsets))
                t_offs = tuple(io - po for io, po in zip(inter[0], piece[0]))
                reads.append(ReadItem(t.key, pi, region.array, (a_offs, inter[1]), (t_offs, inter[1]), rbox, inter))
    return reads


class _RegionIndex:
    """Saved regions by dim-0 start (the planner emits them sorted), so a piece only looks at the
    regions that can overlap it instead of all of them (4096 ranks x 1000 tensors: 4M regions)."""

    def __init__(self, regions: Sequence[RegionMeta]):
        self.regions = regions
        self.sorted = bool(regions) and bool(regions[0].offsets) and all(
            a.offsets[0] <= b.offsets[0] for a, b in zip(regions, regions[1:]))
        if self.sorted:
            self.starts = [r.offsets[0] for r in regions]
            self.max_len = max(r.lengths[0] for r in regions)

    def overlapping(self, piece: Box) -> Sequence[RegionMeta]:
        if not self.sorted or not piece[0]:
            return self.regions
        lo, hi = piece[0][0], piece[0][0] + piece[1][0]
        first = bisect.bisect_left(self.starts, lo - self.max_len + 1)
        last = bisect.bisect_left(self.starts, hi)
        return self.regions[first:last]


def assign_readers(requests: Sequence[Sequence[Tuple[str, Box]]], sizes: Mapping[Tuple[str, Box], int]
                   ) -> Dict[Tuple[str, Box], Tuple[int, Tuple[int, ...]]]:
    """Zero-redundancy load: for every (array, box) wanted by 2+ ranks, one reader.

    requests[r] lists the (array, box) pairs rank r needs. Returns, for shared pairs only,
    (reader rank, all ranks that need it). Readers are chosen largest-first by least bytes read.
    """
    wanted: Dict[Tuple[str, Box], List[int]] = defaultdict(list)
    for rank, reqs in enumerate(requests):
        for req in dict.fromkeys(reqs):
            wanted[req].append(rank)
    load = [0] * len(requests)
    for req, ranks in wanted.items():
        if len(ranks) == 1:
            load[ranks[0]] += sizes[req]
    out: Dict[Tuple[str, Box], Tuple[int, Tuple[int, ...]]] = {}
    for req in sorted((r for r, ranks in wanted.items() if len(ranks) > 1), key=lambda r: (-sizes[r], r)):
        ranks = wanted[req]
        reader = min(ranks, key=lambda r: (load[r], r))
        load[reader] += sizes[req]
        out[req] = (reader, tuple(ranks))
    return out
