"""Pure planners: gather -> pure function -> scatter, the DCP way.

`plan_save` turns every rank's manifest (which boxes of which tensors it holds) into who writes
what where: replicated boxes are written once, big replicated boxes are split so that the
writes are spread over their holders, and each written box gets a chunk-aligned place in a
zarr array. Regular (DTensor) layouts, including plain replicated tensors, are planned once per
tensor from their layout (planning/grid_plan.py) and stay compact in the plan and the metadata; other
layouts (FlatShard pieces, user Shards, mixtures) take the general path over explicit boxes.
`plan_load` turns the metadata and one rank's targets into the sub-boxes to read.
`assign_readers` picks one reader for bytes several ranks need (zero-redundancy load).
Nothing here does I/O or talks to other processes: unit tests build "rank 0..N" plans directly.
"""
from __future__ import annotations

import bisect
import gc
import heapq
import operator
import re
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..common.errors import ShardLayoutError, StateMismatchError
from ..format.records import ArrayMeta, GridMeta, RegionMeta, TensorMeta, dtype_itemsize, grid_tensor
from ..geometry.regions import Box, chunk_count, chunk_grid, find_layout_problem, intersect, refine_chunks, volume
from .grid_plan import GridPlan, TableCache, assign_batch, try_grid
from .manifests import Holding, PackedManifest, RankManifest, TensorManifest, collect, pack_manifest  # noqa: F401

# Replicated boxes at least this big are split among their holders so writes are balanced.
SPLIT_MIN_BYTES = 1 << 20
# Chunks are refined (along dim 0) towards this size so one rank's writes run in parallel.
CHUNK_TARGET_BYTES = 16 << 20
# Per-tensor chunk grids with more than this many chunks per saved region fall back to one zarr
# array per region (avoids millions of tiny chunk files).
MAX_CHUNKS_PER_REGION = 16


@dataclass(frozen=True)
class WriteItem:
    key: str
    offsets: Tuple[int, ...]
    lengths: Tuple[int, ...]
    array: str                      # array path relative to the save's data directory
    array_offsets: Tuple[int, ...]


@dataclass(frozen=True)
class LocalPlan:
    """One rank's part of a save plan."""
    writes: Tuple[WriteItem, ...]
    creates: Tuple[str, ...]
    arrays: Mapping[str, ArrayMeta]        # the arrays this rank touches (data-dir relative)
    safetensors: Tuple[str, ...] = ()      # key paths written as safetensors packs (storage/packs.py)
    chunk_bases: Mapping[str, int] = field(default_factory=dict)  # format/chunk_tables.py: every array's


@dataclass(frozen=True)
class SavePlan:
    """Grid tensors are kept as layouts: a rank's writes are derived on demand (`rank_part`), so
    the plan of 16384 ranks x 1000 tensors holds 1000 layouts, not 16M write items."""
    tensors: Mapping[str, TensorMeta]           # array paths relative to the data directory
    arrays: Mapping[str, ArrayMeta]
    bytes_per_rank: Tuple[int, ...]
    general_writes: Mapping[int, Tuple[WriteItem, ...]] = field(default_factory=dict)  # general path, by rank
    general_creates: Mapping[int, Tuple[str, ...]] = field(default_factory=dict)
    safetensors: Tuple[str, ...] = ()   # key paths whose tensors are planned whole, rows tiled exactly

    @property
    def world_size(self) -> int:
        return len(self.bytes_per_rank)

    @property
    def writes(self) -> Tuple[Tuple[WriteItem, ...], ...]:
        """Per rank (derives every rank's part: for tests and small worlds)."""
        return tuple(rank_part(self, r).writes for r in range(self.world_size))

    @property
    def creates(self) -> Tuple[Tuple[str, ...], ...]:
        return tuple(rank_part(self, r).creates for r in range(self.world_size))


def rank_part(plan: SavePlan, rank: int) -> LocalPlan:
    """What `rank` writes and creates, with the arrays it touches: O(tensors) vectorised work."""
    writes: List[WriteItem] = []
    creates: List[str] = []
    for key in sorted(plan.tensors):
        t = plan.tensors[key]
        if t.grid is None:
            continue
        g = t.grid
        geo = t.regions.geometry()
        if g.choices is None and not g.region_arrays:
            # every region is written by its cell's first holder: look up this rank's cell, O(1)
            cell = geo.cell_of(g.ranks, rank)
            if cell < 0 or geo.holders[cell, 0] != rank:
                continue
            writes += [WriteItem(key, o, l, g.array, o) for o, l in geo.cell_regions(cell)]
            if cell == 0:  # region 0 lies in cell 0 (a tensor with elements has a non-empty first cell)
                creates.append(g.array)
            continue
        writers = geo.writers(g.choice_array())
        mine = np.flatnonzero(writers == rank)
        if not mine.size:
            continue
        _, offsets, lengths = geo.regions()
        zero = (0,) * len(t.shape)
        for k, o, l in zip(mine.tolist(), offsets[mine].tolist(), lengths[mine].tolist()):
            writes.append(WriteItem(key, tuple(o), tuple(l), g.array_of(k), zero if g.region_arrays else tuple(o)))
            if g.region_arrays:
                creates.append(g.array_of(k))
        if writers[0] == rank and not g.region_arrays:
            creates.append(g.array)
    writes += plan.general_writes.get(rank, ())
    creates += plan.general_creates.get(rank, ())
    touched = {w.array for w in writes} | set(creates)
    return LocalPlan(tuple(writes), tuple(creates), {a: plan.arrays[a] for a in sorted(touched)}, plan.safetensors)


def split_for_ranks(plan: SavePlan) -> Tuple[SavePlan, Optional[List[LocalPlan]]]:
    """What the coordinator sends: the grid part, the same for every rank (broadcast, ~1 MB at
    4096 ranks x 1000 tensors), and per rank its general-path part (scatter; None if there is none)."""
    grid = {k: t for k, t in plan.tensors.items() if t.grid is not None}
    arrays = {}
    for t in grid.values():
        for k in range(len(t.regions) if t.grid.region_arrays else 1):
            arrays[t.grid.array_of(k)] = plan.arrays[t.grid.array_of(k)]
    shared = SavePlan(grid, arrays, plan.bytes_per_rank, safetensors=plan.safetensors)
    if not plan.general_writes and not plan.general_creates:
        return shared, None
    extras = []
    for r in range(plan.world_size):
        writes, creates = plan.general_writes.get(r, ()), plan.general_creates.get(r, ())
        touched = {w.array for w in writes} | set(creates)
        extras.append(LocalPlan(writes, creates, {a: plan.arrays[a] for a in sorted(touched)}, plan.safetensors))
    return shared, extras


def local_plan(shared: SavePlan, extra: Optional[LocalPlan], rank: int) -> LocalPlan:
    """A rank's part from the broadcast grid part and its scattered general part."""
    mine = rank_part(shared, rank)
    if extra is None:
        return mine
    return LocalPlan(mine.writes + extra.writes, mine.creates + extra.creates, {**mine.arrays, **extra.arrays},
                     mine.safetensors)


def plan_save(manifests: Sequence, *, regular: bool = True, safetensors: Sequence[str] = ()) -> SavePlan:
    """manifests[r]: rank r's PackedManifest (what save_plan.plan gathers) or tuple of TensorManifest.
    regular=False plans every tensor through the general path (the reference in tests). Tensors under
    the key paths `safetensors` are written whole by one holder, in row chunks that tile them exactly."""
    # Many small tuples at scale: the cyclic GC would rescan them over and over (2x time).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan_save(manifests, regular, tuple(safetensors))
    finally:
        if was_enabled:
            gc.enable()


def _check_agreement(key: str, holdings: Sequence[Holding]) -> None:
    first = holdings[0]
    for h in holdings[1:]:
        if h.dtype != first.dtype or h.shape != first.shape:
            raise ShardLayoutError(
                f"tensor {key!r}: rank {int(first.ranks[0])} has dtype {first.dtype} shape {list(first.shape)} but "
                f"rank {int(h.ranks[0])} has dtype {h.dtype} shape {list(h.shape)}; every rank must describe the "
                f"same global tensor")


def _layout_name(holdings: Sequence[Holding]) -> str:
    layouts = {h.layout for h in holdings}
    return "flat" if "flat" in layouts else "sharded" if "sharded" in layouts else "replicated"


def _plan_save(manifests: Sequence, regular: bool, safetensors: Tuple[str, ...] = ()) -> SavePlan:
    world = len(manifests)
    by_key = collect(manifests)
    loads = np.zeros(world, dtype=np.int64)
    grids: Dict[str, GridPlan] = {}
    general: Dict[str, List[Tuple[Box, Tuple[int, ...]]]] = {}
    cache = TableCache()

    # 1. validate; regular layouts are planned per tensor, the rest deduplicated box by box.
    #    Boxes held by a single rank are fixed load for that rank; shared ones are flexible.
    flexible: List[tuple] = []
    for key in sorted(by_key):
        holdings = by_key[key]
        _check_agreement(key, holdings)
        whole = key.startswith(tuple(g + "/" for g in safetensors))
        gp = try_grid(key, holdings, world, cache, SPLIT_MIN_BYTES, CHUNK_TARGET_BYTES,
                      MAX_CHUNKS_PER_REGION) if regular and not whole else None
        if gp is not None:
            grids[key] = gp
            fixed = gp.writers >= 0
            loads += np.bincount(gp.writers[fixed], weights=gp.nbytes[fixed], minlength=world).astype(np.int64)
            flexible += [(-size, key, (j,), gp, idx) for j, (size, idx) in enumerate(gp.batches())]
            continue
        units = general[key] = _general_units(key, holdings, split=not whole)
        itemsize = dtype_itemsize(holdings[0].dtype)
        for part, ranks in units:
            nbytes = volume(part[1]) * itemsize
            if len(ranks) == 1:
                loads[ranks[0]] += nbytes
            else:
                flexible.append((-nbytes, key, part, None, ranks))

    # 2. spread the shared pieces: largest first, each to its least-loaded holder (LPT). A grid
    #    batch (one row block of every cell of a tensor) is one vectorised step. Single pieces
    #    (general ones, and a grid batch of one cell: a replicated tensor's row blocks) use one
    #    lazy min-heap per holder set (stale entries are refreshed when popped), so a tensor
    #    replicated on 4096 ranks costs log(4096), not 4096, per piece.
    writer_of: Dict[Tuple[str, Box], int] = {}
    heaps: Dict[tuple, List[Tuple[int, int]]] = {}
    columns: Dict[tuple, Dict[int, int]] = {}
    for neg, key, part, gp, what in sorted(flexible, key=lambda u: u[:3]):
        if gp is None:
            rank = _least_loaded(heaps, what, what, loads)
            loads[rank] -= neg
            writer_of[(key, part)] = rank
        elif len(what) > 1:
            assign_batch(gp, what, loads)
        else:
            k = int(what[0])
            cell = int(gp.geometry.regions()[0][k])
            holder_set = (id(gp.table), gp.dims, cell)  # the same for every tensor on this mesh
            if holder_set not in columns:
                row = gp.geometry.holders[cell]
                columns[holder_set] = {r: c for c, r in enumerate(row[row >= 0].tolist())}
            rank = _least_loaded(heaps, holder_set, columns[holder_set], loads)
            loads[rank] += gp.nbytes[k]
            gp.writers[k], gp.choices[k] = rank, columns[holder_set][rank]
        # the chosen rank's heap entry is now stale; _least_loaded refreshes it when it surfaces

    # 3. arrays and chunk grids; every chunk lies inside one written box.
    tensors: Dict[str, TensorMeta] = {}
    arrays: Dict[str, ArrayMeta] = {}
    writes: Dict[int, List[WriteItem]] = defaultdict(list)
    creates: Dict[int, List[str]] = defaultdict(list)
    used_names: Dict[str, str] = {}
    for key in sorted(by_key):
        holdings = by_key[key]
        first = holdings[0]
        name = array_name(key, used_names)
        n_holders = sum(len(h.ranks) for h in holdings)
        gp = grids.get(key)
        if gp is not None:
            choices, width = gp.choice_bytes()
            meta = GridMeta(name, gp.mesh, gp.dims, gp.table, SPLIT_MIN_BYTES, choices, width, gp.chunks is None)
            tensors[key] = grid_tensor(key, first.dtype, first.shape, _layout_name(holdings), n_holders, meta)
            if gp.chunks is not None:
                arrays[name] = ArrayMeta(name, first.shape, gp.chunks, first.dtype)
                continue
            itemsize = dtype_itemsize(first.dtype)
            for k, lens in enumerate(map(tuple, gp.geometry.regions()[2].tolist())):
                chunks = refine_chunks(tuple(max(1, l) for l in lens), lens, itemsize, CHUNK_TARGET_BYTES)
                arrays[meta.array_of(k)] = ArrayMeta(meta.array_of(k), lens, chunks, first.dtype)
            continue
        regions = _place_general(key, first, name, general[key], writer_of, arrays, writes, creates,
                                 key.startswith(tuple(g + "/" for g in safetensors)))
        tensors[key] = TensorMeta(key, first.dtype, first.shape, _layout_name(holdings), n_holders, regions)
    return SavePlan(tensors, arrays, tuple(loads.tolist()), {r: tuple(w) for r, w in writes.items()},
                    {r: tuple(c) for r, c in creates.items()}, safetensors)


def _least_loaded(heaps: Dict[tuple, List[Tuple[int, int]]], key: tuple, ranks: Iterable[int],
                  loads: np.ndarray) -> int:
    """The least-loaded rank of a holder set (lowest rank on ties), from its lazy heap."""
    heap = heaps.get(key)
    if heap is None:
        heap = heaps[key] = [(int(loads[r]), r) for r in ranks]
        heapq.heapify(heap)
    while True:
        load, rank = heap[0]
        if load == loads[rank]:
            return rank
        heapq.heapreplace(heap, (int(loads[rank]), rank))


def _general_units(key: str, holdings: Sequence[Holding], split: bool = True) -> List[Tuple[Box, Tuple[int, ...]]]:
    """Distinct boxes (tiling checked) with their holders, big shared ones split for balance."""
    first = holdings[0]
    holders: Dict[Box, List[int]] = {}
    for h in holdings:
        for rank, boxes in h.rank_boxes():
            for box in boxes:
                holders.setdefault(box, []).append(rank)
    boxes = list(holders)
    problem = find_layout_problem(first.shape, boxes)
    if problem is not None:
        msg, idx = problem
        who = ", ".join(f"{_fmt_box(boxes[i])} on ranks {sorted(holders[boxes[i]])}" for i in idx[:4])
        raise ShardLayoutError(f"tensor {key!r}: {msg} ({who}); shards must tile the global shape "
                               f"exactly (identical copies are fine)")
    itemsize = dtype_itemsize(first.dtype)
    units: List[Tuple[Box, Tuple[int, ...]]] = []
    for box, ranks in holders.items():
        for part in _split_for_balance(box, len(ranks) if split else 1, itemsize):
            units.append((part, tuple(sorted(ranks))))
    return units


def _place_general(key: str, first: Holding, name: str, units, writer_of, arrays, writes, creates, exact=False
                   ) -> Tuple[RegionMeta, ...]:
    boxes = [box for box, _ in units]
    itemsize = dtype_itemsize(first.dtype)
    grid = refine_chunks(chunk_grid(first.shape, boxes), first.shape, itemsize, CHUNK_TARGET_BYTES, exact)
    one_array = exact or chunk_count(first.shape, grid) <= MAX_CHUNKS_PER_REGION * max(1, len(units))
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
            chunks = refine_chunks(tuple(max(1, l) for l in box[1]), box[1], itemsize, CHUNK_TARGET_BYTES, exact)
            arrays[array] = ArrayMeta(array, box[1], chunks, first.dtype)
            creates[writer].append(array)
        regions.append(RegionMeta(box[0], box[1], array, tuple(aoffs), writer))
        writes[writer].append(WriteItem(key, box[0], box[1], array, tuple(aoffs)))
    return tuple(regions)


def _split_for_balance(box: Box, holders: int, itemsize: int) -> List[Box]:
    """Cut a replicated box into row blocks of at least SPLIT_MIN_BYTES (never more blocks than
    holders), so that LPT can spread big replicated tensors without shredding them.
    grids.split_rows is the same rule, vectorised, for regular layouts."""
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
        if meta.grid is not None:
            reads += _plan_grid_load(meta, t)
            continue
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


def _plan_grid_load(meta: TensorMeta, t: "TargetSpec") -> List[ReadItem]:
    """Against a regular layout: per dimension a bisection finds the overlapping cells, so a
    piece costs O(overlapping regions), not O(saved regions), and no per-cell arrays are built."""
    g = meta.grid
    geo = meta.regions.geometry()
    out = []
    for pi, piece in enumerate(t.pieces):
        p_lo = piece[0]
        p_hi = tuple(map(operator.add, p_lo, piece[1]))
        for cell in geo.overlapping_cells(piece):
            first = int(geo.split[2][cell]) if g.region_arrays else 0  # region index names the array
            for j, rbox in enumerate(geo.cell_regions(cell)):
                r_lo = rbox[0]
                r_hi = tuple(map(operator.add, r_lo, rbox[1]))
                if all(map(operator.le, p_lo, r_lo)) and all(map(operator.le, r_hi, p_hi)):
                    inter = rbox  # inside the piece (every region, for a whole-tensor load)
                else:
                    lo = tuple(map(max, p_lo, r_lo))
                    lens = tuple(map(operator.sub, map(min, p_hi, r_hi), lo))
                    if min(lens) <= 0:
                        continue
                    inter = (lo, lens)
                lo, lens = inter
                target = (tuple(map(operator.sub, lo, p_lo)), lens)
                if g.region_arrays:
                    out.append(ReadItem(t.key, pi, g.array_of(first + j), (tuple(map(operator.sub, lo, r_lo)), lens),
                                        target, rbox, inter))
                else:
                    out.append(ReadItem(t.key, pi, g.array, inter, target, rbox, inter))
    return out


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
