"""What each rank tells the save planner, and how it travels small.

A rank's manifest lists, per tensor, the boxes it holds, and for a regular (DTensor) layout the
layout itself: mesh shape, the tensor dim each mesh dim shards (-1: replicates) and the rank's
mesh coordinate. For the gather that is split in two:
- a *table* (key, dtype, shape, layout, mesh, dims, slot per tensor) that is the same on every
  rank of an SPMD job, sent by the coordinator and by any rank whose table differs from it
  (compared by digest), and
- per rank only what differs: one mesh coordinate per slot and the boxes of irregular tensors.
An FSDP rank with 1000 tensors then sends ~100 bytes instead of ~65 KB. `collect` turns the
gathered payloads into, per tensor, groups of holders with numpy arrays of their coordinates.
Pure: no torch, no I/O.
"""
from __future__ import annotations

import hashlib
import math
import pickle
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..common.errors import ShardLayoutError
from ..geometry.grids import cell_box, valid_layout
from ..geometry.regions import Box

Grid = Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]   # (mesh shape, dims, coordinate)


@dataclass(frozen=True)
class TensorManifest:
    """What one rank holds of one tensor. `grid`, when set, describes the boxes as a DTensor
    layout (checked against `boxes` when packed; a mismatch falls back to the boxes)."""
    key: str
    dtype: str
    shape: Tuple[int, ...]
    layout: str
    boxes: Tuple[Box, ...]
    grid: Optional[Grid] = None


RankManifest = Tuple[TensorManifest, ...]
# key, dtype, shape, layout, mesh (None: irregular), dims, slot (coordinate or boxes index)
Entry = Tuple[str, str, Tuple[int, ...], str, Optional[Tuple[int, ...]], Optional[Tuple[int, ...]], int]


@dataclass(frozen=True)
class PackedManifest:
    digest: str                                 # of the table
    table: Optional[Tuple[Entry, ...]]          # None: same as the coordinator's (same digest)
    coords: Tuple[Tuple[int, ...], ...]         # per slot: this rank's mesh coordinate
    boxes: Tuple[Tuple[Box, ...], ...]          # per irregular entry: this rank's boxes

    def without_table(self) -> "PackedManifest":
        return PackedManifest(self.digest, None, self.coords, self.boxes)


def regular_grid(m: TensorManifest) -> Optional[Grid]:
    """The manifest's layout if its boxes are exactly what the layout gives; a whole-tensor box
    without a layout is the trivial one (mesh ()), so replicated plain tensors are regular too."""
    if m.grid is not None:
        mesh, dims, coord = (tuple(int(x) for x in part) for part in m.grid)
        if not (valid_layout(m.shape, mesh, dims) and len(coord) == len(mesh)
                and all(0 <= c < n for c, n in zip(coord, mesh))):
            return None
        box = cell_box(m.shape, mesh, dims, coord)
        if tuple(m.boxes) != ((box,) if math.prod(box[1]) > 0 else ()):
            return None
        return mesh, dims, coord
    whole = ((0,) * len(m.shape), tuple(m.shape))
    if len(m.boxes) == 1 and tuple(map(tuple, m.boxes[0])) == whole and math.prod(m.shape) > 0:
        return (), (), ()
    return None


def pack_manifest(manifest: Sequence[TensorManifest], reference: Optional[str] = None) -> PackedManifest:
    """This rank's payload; the table is left out when its digest equals `reference`."""
    table: List[Entry] = []
    coords: List[Tuple[int, ...]] = []
    boxes: List[Tuple[Box, ...]] = []
    slots: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], int] = {}
    for m in manifest:
        shape = tuple(int(s) for s in m.shape)
        grid = regular_grid(m)
        if grid is None:
            table.append((m.key, m.dtype, shape, m.layout, None, None, len(boxes)))
            boxes.append(tuple(m.boxes))
            continue
        mesh, dims, coord = grid
        slot = slots.setdefault((mesh, coord), len(slots))
        if slot == len(coords):
            coords.append(coord)
        table.append((m.key, m.dtype, shape, m.layout, mesh, dims, slot))
    frozen = tuple(table)
    digest = hashlib.sha1(pickle.dumps(frozen, protocol=4)).hexdigest()
    return PackedManifest(digest, None if digest == reference else frozen, tuple(coords), tuple(boxes))


@dataclass
class Holding:
    """One tensor as held by a group of ranks that share a table entry."""
    ranks: np.ndarray                       # int64, the group's ranks in rank order
    dtype: str
    shape: Tuple[int, ...]
    layout: str
    mesh: Optional[Tuple[int, ...]]         # None: irregular, see boxes
    dims: Optional[Tuple[int, ...]]
    coords: Optional[np.ndarray]            # (len(ranks), len(mesh)) mesh coordinates
    boxes: Optional[List[Tuple[Box, ...]]]  # per rank, irregular only
    source: Tuple[str, int]                 # (table digest, slot): equal sources have equal coords

    def rank_boxes(self) -> List[Tuple[int, Tuple[Box, ...]]]:
        """(rank, boxes) for every rank of the group, spelling out a regular layout."""
        if self.boxes is not None:
            return list(zip(self.ranks.tolist(), self.boxes))
        if not self.mesh:  # the whole tensor on every rank
            whole = (((0,) * len(self.shape), tuple(self.shape)),)
            return [(rank, whole) for rank in self.ranks.tolist()]
        out = []
        for rank, coord in zip(self.ranks.tolist(), self.coords.tolist()):
            box = cell_box(self.shape, self.mesh, self.dims, coord)
            out.append((rank, (box,) if math.prod(box[1]) > 0 else ()))
        return out


def collect(manifests: Sequence[Union[PackedManifest, Sequence[TensorManifest]]]) -> Dict[str, List[Holding]]:
    """Per tensor key, the groups of ranks holding it. Accepts packed payloads (what save_plan.plan
    gathers) or plain manifests (tests, tools), which are packed here."""
    packed = [m if isinstance(m, PackedManifest) else pack_manifest(m) for m in manifests]
    tables: Dict[str, Tuple[Entry, ...]] = {}
    groups: Dict[str, List[int]] = defaultdict(list)
    for rank, p in enumerate(packed):
        if p.table is not None:
            tables.setdefault(p.digest, p.table)
        groups[p.digest].append(rank)
    by_key: Dict[str, List[Holding]] = defaultdict(list)
    for digest, ranks in groups.items():
        table = tables.get(digest)
        if table is None:
            raise ShardLayoutError(f"internal: ranks {ranks[:8]} sent no manifest table and none matches theirs")
        members = [packed[r] for r in ranks]
        n_slots = len(members[0].coords)
        if any(len(p.coords) != n_slots or len(p.boxes) != len(members[0].boxes) for p in members):
            raise ShardLayoutError(f"internal: ranks {ranks[:8]} sent manifests of different shapes for one table")
        rank_arr = np.array(ranks, dtype=np.int64)
        coords = [np.array([p.coords[s] for p in members], dtype=np.int64).reshape(
            len(members), len(members[0].coords[s])) for s in range(n_slots)]
        for key, dtype, shape, layout, mesh, dims, slot in table:
            if mesh is None:
                by_key[key].append(Holding(rank_arr, dtype, shape, layout, None, None, None,
                                           [p.boxes[slot] for p in members], (digest, -1)))
            else:
                by_key[key].append(Holding(rank_arr, dtype, shape, layout, mesh, dims, coords[slot], None,
                                           (digest, slot)))
    return by_key
