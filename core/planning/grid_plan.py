"""Save planning for regular (DTensor) layouts, once per tensor, vectorised over its cells.

`try_grid` takes the holders of one tensor (groups of ranks with their mesh coordinates) and,
if they form one regular layout, returns its cells, regions (cells cut into row blocks when
several ranks share the write), chunk grid and fixed writers as numpy arrays: the same regions,
chunks and arrays the general planner would derive from every rank's boxes
(tests/unit/test_planner_grid.py checks that), without a Python object per rank.
`assign_batch` is the LPT step for the shared regions: one tensor's row block j of every cell at
once, each to its least-loaded holder (the cells' holders are disjoint, so one argmin per row).
Pure: no I/O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..common.errors import ShardLayoutError
from ..format.metadata import dtype_itemsize
from ..geometry.grids import Geometry, RankTable, row_volumes
from ..geometry.regions import chunk_count, refine_chunks
from .manifests import Holding

BIG = np.iinfo(np.int64).max


@dataclass
class GridPlan:
    key: str
    dtype: str
    shape: Tuple[int, ...]
    mesh: Tuple[int, ...]
    dims: Tuple[int, ...]
    table: RankTable                    # rank at each mesh coordinate, -1: none
    geometry: Geometry
    chunks: Optional[Tuple[int, ...]]   # None: one array per region
    nbytes: np.ndarray                  # per region
    writers: np.ndarray                 # per region; -1 until assigned
    choices: np.ndarray                 # per region: column in its cell's holders row

    def batches(self) -> List[Tuple[int, np.ndarray]]:
        """(largest size, region indices) of the shared regions, one batch per row-block index."""
        geo = self.geometry
        cell = geo.regions()[0]
        shared = np.flatnonzero(geo.counts[cell] >= 2)
        if not shared.size:
            return []
        j = shared - geo.split[2][cell[shared]]
        out = []
        for v in np.unique(j):
            idx = shared[j == v]
            out.append((int(self.nbytes[idx].max()), idx))
        return out

    def choice_bytes(self) -> Tuple[Optional[bytes], int]:
        if not self.choices.any():
            return None, 1
        top = int(self.choices.max())
        width = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
        return self.choices.astype(f"<u{width}").tobytes(), width


class TableCache:
    """Rank tables by holder source, so tensors on one mesh share one table (and its holders)."""

    def __init__(self) -> None:
        self.tables: Dict[tuple, Optional[RankTable]] = {}

    def get(self, holdings: Sequence[Holding], mesh: Tuple[int, ...], world: int) -> Optional[RankTable]:
        src = (mesh,) + tuple(h.source for h in holdings)
        if src not in self.tables:
            self.tables[src] = _table(holdings, mesh, world)
        return self.tables[src]


def _table(holdings: Sequence[Holding], mesh: Tuple[int, ...], world: int) -> Optional[RankTable]:
    ranks = np.concatenate([h.ranks for h in holdings])
    if not mesh:  # replicated plain tensor: a virtual 1-D mesh of its holders, all replicating
        return RankTable(np.sort(ranks))
    size = math.prod(mesh)
    if size > world:
        return None
    coords = np.concatenate([h.coords for h in holdings])
    lin = np.ravel_multi_index(tuple(coords.T), mesh)
    if len(np.unique(lin)) != len(lin):
        return None  # two ranks claim one coordinate: not a DTensor layout, use the boxes
    table = np.full(size, -1, dtype=np.int64)
    table[lin] = ranks
    return RankTable(table)


def try_grid(key: str, holdings: Sequence[Holding], world: int, cache: TableCache, split_bytes: int,
             chunk_bytes: int, max_chunks_per_region: int) -> Optional[GridPlan]:
    """The regular plan of one tensor, or None when its holders do not form one regular layout."""
    first = holdings[0]
    if first.mesh is None or any(h.mesh != first.mesh or h.dims != first.dims for h in holdings):
        return None
    if math.prod(first.shape) == 0:
        return None
    table = cache.get(holdings, first.mesh, world)
    if table is None:
        return None
    mesh, dims = (first.mesh, first.dims) if first.mesh else ((len(table),), (-1,))
    itemsize = dtype_itemsize(first.dtype)
    geo = Geometry(first.shape, itemsize, mesh, dims, table, split_bytes)
    missing = geo.uncovered()
    if missing.size:
        total = math.prod(first.shape)
        covered = total - sum(math.prod(geo.cell(g)[1]) for g in missing.tolist())
        who = ", ".join(_fmt(*geo.cell(g)) for g in missing[:4].tolist())
        raise ShardLayoutError(f"tensor {key!r}: the shards cover {covered} of {total} elements of global shape "
                               f"{list(first.shape)} (no rank holds {who}); shards must tile the global shape "
                               f"exactly (identical copies are fine)")
    chunks: Optional[Tuple[int, ...]] = refine_chunks(geo.chunk_grid(), first.shape, itemsize, chunk_bytes)
    n = geo.n_regions
    if chunk_count(first.shape, chunks) > max_chunks_per_region * max(1, n):
        chunks = None  # too many chunks for one grid: one array per region (like the general path)
    cell, _, lengths = geo.regions()
    nbytes = row_volumes(lengths) * itemsize
    single = geo.counts[cell] == 1
    writers = np.where(single, geo.holders[cell, 0], -1)
    return GridPlan(key, first.dtype, first.shape, mesh, dims, table, geo, chunks, nbytes, writers,
                    np.zeros(n, dtype=np.int64))


def assign_batch(plan: GridPlan, idx: np.ndarray, loads: np.ndarray) -> None:
    """Each region in idx to its least-loaded holder (lowest mesh coordinate on ties)."""
    geo = plan.geometry
    cand = geo.holders[geo.regions()[0][idx]]
    vals = np.where(cand >= 0, loads[np.maximum(cand, 0)], BIG)
    col = np.argmin(vals, axis=1)
    chosen = cand[np.arange(len(idx)), col]
    loads[chosen] += plan.nbytes[idx]      # the cells' holders are disjoint: no repeated index
    plan.writers[idx] = chosen
    plan.choices[idx] = col


def _fmt(offsets, lengths) -> str:
    return "[" + ", ".join(f"{o}:{o + l}" for o, l in zip(offsets, lengths)) + "]"
