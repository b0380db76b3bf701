"""Pure math of DTensor-regular layouts: a tensor split over a device mesh, described once.

A layout is (mesh shape, dims): mesh dim i either shards tensor dim dims[i] or (-1) replicates.
Splits follow torch (DTensor `Shard`, `torch.chunk`): ceil-div sized parts, the last ones possibly
short or empty; mesh dims sharding the same tensor dim split it one after the other, left to
right. A *cell* is one box of that split, identified by its coordinates on the sharding mesh dims
(row-major); the ranks on the replicating mesh dims at those coordinates are its holders.
A region is a cell, or one of the row blocks a cell is cut into so that its holders share its
write (the save planner's balance rule, `split_rows`). Everything is vectorised over cells and
regions with numpy, so a layout over 16384 ranks costs a few array operations, not 16384 Python
objects. No torch, no I/O.
"""
from __future__ import annotations

import itertools
import math
from functools import cached_property
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]


def partition(size: int, levels: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of `size` split by each level in turn (torch.chunk rule), in order."""
    starts = np.zeros(1, dtype=np.int64)
    lens = np.array([size], dtype=np.int64)
    for m in levels:
        full = -(-lens // m)
        edges = np.minimum(lens[:, None], full[:, None] * np.arange(m + 1, dtype=np.int64))
        starts = (starts[:, None] + edges[:, :-1]).reshape(-1)
        lens = (edges[:, 1:] - edges[:, :-1]).reshape(-1)
    return starts, lens


def cell_box(shape: Sequence[int], mesh: Sequence[int], dims: Sequence[int], coordinate: Sequence[int]) -> Box:
    """The box a rank at `coordinate` holds (what torch's compute_local_shape_and_global_offset
    gives, except that empty boxes keep an in-range offset)."""
    offsets, lengths = [0] * len(shape), list(shape)
    for m, d, c in zip(mesh, dims, coordinate):
        if d < 0:
            continue
        full = -(-lengths[d] // m)
        lo, hi = min(lengths[d], full * c), min(lengths[d], full * (c + 1))
        offsets[d] += lo
        lengths[d] = hi - lo
    return tuple(offsets), tuple(lengths)


def valid_layout(shape: Sequence[int], mesh: Sequence[int], dims: Sequence[int]) -> bool:
    return (len(mesh) == len(dims) and all(isinstance(m, int) and m >= 1 for m in mesh)
            and all(isinstance(d, int) and -1 <= d < len(shape) for d in dims))


class RankTable:
    """The rank at each coordinate of a mesh (row-major, -1: none), shared by every tensor on
    that mesh; caches its holders matrix per layout so 1000 tensors on one mesh compute it once."""

    def __init__(self, ranks: Sequence[int]):
        self.array = np.array(ranks, dtype=np.int64).reshape(-1)
        self.array.flags.writeable = False
        self._hash: Optional[int] = None
        self._inverse: Optional[np.ndarray] = None
        self._holders: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], Tuple[np.ndarray, np.ndarray]] = {}

    def holders(self, mesh: Tuple[int, ...], dims: Tuple[int, ...]) -> Tuple[np.ndarray, np.ndarray]:
        key = (tuple(mesh), tuple(dims))
        if key not in self._holders:
            self._holders[key] = holders_matrix(self.array, mesh, dims)
        return self._holders[key]

    def position(self, rank: int) -> int:
        """The mesh coordinate index (row-major) of `rank`, or -1."""
        if self._inverse is None:
            present = np.flatnonzero(self.array >= 0)
            inverse = np.full(int(self.array.max(initial=-1)) + 1, -1, dtype=np.int64)
            inverse[self.array[present]] = present
            self._inverse = inverse
        return int(self._inverse[rank]) if 0 <= rank < len(self._inverse) else -1

    def tolist(self) -> List[int]:
        return self.array.tolist()

    def __len__(self) -> int:
        return len(self.array)

    def __eq__(self, other) -> bool:
        return isinstance(other, RankTable) and (other is self or np.array_equal(self.array, other.array))

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self.array.tobytes())
        return self._hash

    def __repr__(self) -> str:
        return f"RankTable({len(self)} coordinates)"

    def __reduce__(self):
        return RankTable, (self.array,)


class Geometry:
    """Cells of one tensor's layout: boxes, holders, and the regions they are cut into.

    Cheap to build (per-dimension splits only); the per-cell arrays the save planner needs are
    computed on first use, while `overlapping` answers from the per-dimension splits, so
    planning one rank's load does not pay for every cell of a 16384-rank layout."""

    def __init__(self, shape: Sequence[int], itemsize: int, mesh: Sequence[int], dims: Sequence[int],
                 table: RankTable, split_bytes: int):
        self.shape, self.ndim, self.itemsize = tuple(int(s) for s in shape), len(shape), itemsize
        self.mesh, self.dims, self.split_bytes = tuple(mesh), tuple(dims), split_bytes
        self.shard_axes = [i for i, d in enumerate(self.dims) if d >= 0]
        self.cell_shape = tuple(self.mesh[i] for i in self.shard_axes)
        self.cells = math.prod(self.cell_shape)
        self.by_dim: List[Optional[Tuple[List[int], List[int], np.ndarray, np.ndarray]]] = []
        for d in range(self.ndim):
            sub = [k for k, i in enumerate(self.shard_axes) if self.dims[i] == d]
            levels = [self.cell_shape[k] for k in sub]
            self.by_dim.append((sub, levels, *partition(self.shape[d], levels)) if sub else None)
        self.holders, self.counts = table.holders(self.mesh, self.dims)

    # ------------------------------------------------------------ all cells at once (save planner)
    @cached_property
    def cell_boxes(self) -> Tuple[np.ndarray, np.ndarray]:
        offsets = np.zeros((self.cells, self.ndim), dtype=np.int64)
        lengths = np.tile(np.array(self.shape, dtype=np.int64), (self.cells, 1))
        coords = None
        for d, part in enumerate(self.by_dim):
            if part is None:
                continue
            sub, levels, starts, lens = part
            if len(sub) == len(self.cell_shape):  # only this dim is sharded: cells are its parts, in order
                offsets[:, d], lengths[:, d] = starts, lens
                continue
            if coords is None:
                coords = np.indices(self.cell_shape, dtype=np.int64).reshape(len(self.cell_shape), self.cells)
            idx = np.ravel_multi_index(tuple(coords[sub]), levels)
            offsets[:, d], lengths[:, d] = starts[idx], lens[idx]
        return offsets, lengths

    @cached_property
    def split(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row blocks per cell, their height, index of each cell's first region; cells + 1)."""
        lengths = self.cell_boxes[1]
        volume = row_volumes(lengths)
        rows = lengths[:, 0] if self.ndim else np.ones(self.cells, dtype=np.int64)
        nparts, step = split_rows(rows, volume, volume * self.itemsize, self.counts, self.split_bytes, self.ndim)
        return nparts, step, np.concatenate([[0], np.cumsum(nparts)]).astype(np.int64)

    @property
    def n_regions(self) -> int:
        return int(self.split[2][-1])

    @cached_property
    def _regions(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        nparts, step, first = self.split
        cell_offsets, cell_lengths = self.cell_boxes
        if nparts.max(initial=0) <= 1:  # no cell cut into row blocks: regions are the non-empty cells
            if first[-1] == self.cells:
                return np.arange(self.cells, dtype=np.int64), cell_offsets, cell_lengths
            cell = np.flatnonzero(nparts)
            return cell, cell_offsets[cell], cell_lengths[cell]
        cell = np.repeat(np.arange(self.cells, dtype=np.int64), nparts)
        offsets, lengths = cell_offsets[cell], cell_lengths[cell]
        if self.ndim:
            start = (np.arange(len(cell), dtype=np.int64) - first[cell]) * step[cell]
            offsets[:, 0] += start
            lengths[:, 0] = np.minimum(step[cell], cell_lengths[cell, 0] - start)
        return cell, offsets, lengths

    def regions(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cell, offsets, lengths) of every region, cells in order, row blocks in order."""
        return self._regions

    def chunk_grid(self) -> Tuple[int, ...]:
        """The coarsest regular chunk shape with a boundary at every region edge inside the
        tensor (regions.chunk_grid: 0 and the tensor's end need none)."""
        _, offsets, lengths = self.regions()
        out = []
        for d, size in enumerate(self.shape):
            ends = offsets[:, d] + lengths[:, d]
            g = int(np.gcd.reduce(np.concatenate([offsets[:, d], np.where(ends < size, ends, 0)])))
            out.append(max(1, g or size))
        return tuple(out)

    def writers(self, choices: Optional[np.ndarray]) -> np.ndarray:
        cell = self.regions()[0]
        col = np.zeros(len(cell), dtype=np.int64) if choices is None else choices.astype(np.int64)
        return self.holders[cell, col]

    def uncovered(self) -> np.ndarray:
        """Cells with elements but no holder."""
        empty = np.flatnonzero(self.counts == 0)
        if not empty.size:
            return empty
        return np.array([g for g in empty.tolist() if math.prod(self.cell(g)[1]) > 0], dtype=np.int64)

    # ------------------------------------------------------------ one cell at a time (load planner)
    def cell_of(self, table: RankTable, rank: int) -> int:
        """The cell `rank` holds, or -1."""
        pos = table.position(rank)
        if pos < 0:
            return -1
        coord = np.unravel_index(pos, self.mesh)
        return int(np.ravel_multi_index([int(coord[i]) for i in self.shard_axes], self.cell_shape)) \
            if self.cell_shape else 0

    def cell(self, g: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        coord = np.unravel_index(g, self.cell_shape) if self.cell_shape else ()
        offs, lens = [0] * self.ndim, list(self.shape)
        for d, part in enumerate(self.by_dim):
            if part is not None:
                sub, levels, starts, lengths = part
                i = int(np.ravel_multi_index([int(coord[k]) for k in sub], levels))
                offs[d], lens[d] = int(starts[i]), int(lengths[i])
        return tuple(offs), tuple(lens)

    def cell_regions(self, g: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        """The region boxes of cell g, in order (same rule as `split`, for one cell)."""
        offs, lens = self.cell(g)
        vol = math.prod(lens)
        if not vol:
            return []
        if not self.ndim:
            return [(offs, lens)]
        n, s = split_one(lens[0], vol * self.itemsize, int(self.counts[g]), self.split_bytes)
        return [((offs[0] + j * s,) + offs[1:], (min(s, lens[0] - j * s),) + lens[1:]) for j in range(n)]

    def overlapping_cells(self, piece: Box) -> Iterator[int]:
        """The cells whose box overlaps `piece`: a bisection per sharded dimension."""
        if any(n == 0 for n in piece[1]) and self.ndim:
            return
        per_dim = []
        for d, part in enumerate(self.by_dim):
            if part is None:
                continue
            sub, levels, starts, lens = part
            lo, hi = piece[0][d], piece[0][d] + piece[1][d]
            a = int(np.searchsorted(starts + lens, lo, side="right"))
            b = int(np.searchsorted(starts, hi, side="left"))
            per_dim.append([(sub, np.unravel_index(i, levels)) for i in range(a, b) if lens[i] > 0])
        coord = [0] * len(self.cell_shape)
        for combo in itertools.product(*per_dim):
            for sub, idx in combo:
                for k, c in zip(sub, idx):
                    coord[k] = int(c)
            yield int(np.ravel_multi_index(coord, self.cell_shape)) if self.cell_shape else 0


def holders_matrix(table: np.ndarray, mesh: Sequence[int], dims: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Per cell, the ranks holding it (in mesh coordinate order, padded with -1), and their count.
    `table[i]` is the rank at mesh coordinate i (row-major), -1 where no rank reported one."""
    shard = [i for i, d in enumerate(dims) if d >= 0]
    rep = [i for i, d in enumerate(dims) if d < 0]
    cells = math.prod(mesh[i] for i in shard)
    t = np.asarray(table, dtype=np.int64).reshape(tuple(mesh)).transpose(shard + rep).reshape(cells, -1)
    if (t < 0).any():
        t = np.take_along_axis(t, np.argsort(t < 0, axis=1, kind="stable"), axis=1)
    else:
        t = np.ascontiguousarray(t)
    return t, (t >= 0).sum(axis=1)


def row_volumes(lengths: np.ndarray) -> np.ndarray:
    """Product along each row of a (n, ndim) array (a column loop: much faster than prod(axis=1))."""
    out = np.ones(len(lengths), dtype=np.int64)
    for d in range(lengths.shape[1]):
        out *= lengths[:, d]
    return out


def split_one(rows: int, nbytes: int, holders: int, split_bytes: int) -> Tuple[int, int]:
    """`split_rows` for one non-empty cell of a tensor with 1+ dims: (row blocks, their height)."""
    parts = 1
    if split_bytes > 0 and holders >= 2 and rows >= 2 and nbytes >= 2 * split_bytes:
        parts = min(holders, rows, nbytes // split_bytes)
    step = max(1, -(-rows // parts))
    return -(-rows // step), step


def split_rows(rows: np.ndarray, volume: np.ndarray, nbytes: np.ndarray, counts: np.ndarray, split_bytes: int,
               ndim: int) -> Tuple[np.ndarray, np.ndarray]:
    """Row blocks per cell (0 for an empty cell) and their height: a cell of at least
    2*split_bytes held by 2+ ranks is cut along dim 0 into min(holders, rows, nbytes//split_bytes)
    blocks of ceil-div height, so that its holders can share the write (planner._split_for_balance)."""
    if split_bytes > 0 and ndim and counts.max(initial=0) >= 2:
        cut = (counts >= 2) & (rows >= 2) & (nbytes >= 2 * split_bytes)
        parts = np.where(cut, np.minimum(np.minimum(counts, rows), nbytes // split_bytes), 1)
    else:  # nothing to cut: one region per non-empty cell
        return (volume > 0).astype(np.int64), np.maximum(rows, 1).astype(np.int64)
    step = np.maximum(1, -(-rows // np.maximum(parts, 1)))
    nparts = np.where(volume > 0, -(-rows // step), 0) if ndim else np.where(volume > 0, 1, 0)
    return nparts.astype(np.int64), step.astype(np.int64)

