"""Grid tensors in the metadata: regular (DTensor) layouts stored as their layout, not as a list
of regions (docs/format.md, "grid"). The dataclasses, the lazily generated region sequence, and
the JSON form with its validation (as strict as for region lists: bounded by the world size).
"""
from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from .grids import Geometry, RankTable, valid_layout
from .metadata import (ArrayMeta, RegionMeta, TensorMeta, _expect, _fail, _int, _ints, dtype_itemsize,
                       safe_relative_path)


@dataclass(frozen=True)
class GridMeta:
    """A regular (DTensor) layout, stored in one array at global offsets (docs/format.md, "grid").

    Mesh dim i shards tensor dim dims[i] (-1: replicates); `ranks[c]` is the rank at mesh
    coordinate c (row-major, -1: none). Each cell of the split is one region, cut into row blocks
    when its holders shared the write (`split_bytes`, see grids.split_rows); `choices[k]` says
    which of its cell's holders (in mesh coordinate order) wrote region k (None: the first)."""
    array: str
    mesh: Tuple[int, ...]
    dims: Tuple[int, ...]
    ranks: RankTable
    split_bytes: int
    choices: Optional[bytes] = None     # little-endian unsigned ints of `choice_width` bytes
    choice_width: int = 1
    region_arrays: bool = False         # True: region k is the whole array `<array>/r<k>`

    def array_of(self, k: int) -> str:
        return f"{self.array}/r{k}" if self.region_arrays else self.array

    def choice_array(self) -> Optional[np.ndarray]:
        if self.choices is None:
            return None
        return np.frombuffer(self.choices, dtype=f"<u{self.choice_width}")


class GridRegions(Sequence):
    """The regions of a grid tensor, generated on demand (a Sequence of RegionMeta).

    Nothing per region or per cell is kept: planners use the numpy form (`geometry()`, computed
    afresh; at 16384 ranks x 1000 tensors keeping it would hold ~1 GiB), and iterating generates
    RegionMeta objects as it goes (inspect, verify, export walk one tensor at a time)."""

    def __init__(self, shape: Tuple[int, ...], dtype: str, grid: GridMeta):
        self.shape, self.dtype, self.grid = tuple(shape), dtype, grid
        self._len: Optional[int] = None

    def geometry(self) -> Geometry:
        g = self.grid
        return Geometry(self.shape, dtype_itemsize(self.dtype), g.mesh, g.dims, g.ranks, g.split_bytes)

    def _generate(self, picks: Optional[Sequence[int]] = None) -> List[RegionMeta]:
        geo, g = self.geometry(), self.grid
        _, offsets, lengths = geo.regions()
        writers = geo.writers(g.choice_array())
        idx = range(len(writers)) if picks is None else picks
        zero = (0,) * len(self.shape)
        out = []
        for k in idx:
            o = tuple(offsets[k].tolist())
            out.append(RegionMeta(o, tuple(lengths[k].tolist()), g.array_of(k), zero if g.region_arrays else o,
                                  int(writers[k])))
        return out

    def __len__(self) -> int:
        if self._len is None:
            self._len = self.geometry().n_regions
        return self._len

    def __getitem__(self, k):
        if isinstance(k, slice):
            return self._generate(range(len(self))[k])
        n = len(self)
        if not -n <= k < n:
            raise IndexError(k)
        return self._generate([k % n])[0]

    def __iter__(self) -> Iterator[RegionMeta]:
        return iter(self._generate())

    def __eq__(self, other) -> bool:
        if isinstance(other, GridRegions) and (self.shape, self.dtype, self.grid) == (other.shape, other.dtype,
                                                                                     other.grid):
            return True
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash((self.shape, self.grid))

    def __repr__(self) -> str:
        return f"GridRegions({len(self)} regions of {self.grid.array!r})"

    def __reduce__(self):
        return GridRegions, (self.shape, self.dtype, self.grid)


def grid_tensor(key: str, dtype: str, shape: Tuple[int, ...], layout: str, holders: int, grid: GridMeta) -> TensorMeta:
    return TensorMeta(key, dtype, tuple(shape), layout, holders, GridRegions(tuple(shape), dtype, grid), grid)


def grid_to_json(g: GridMeta, tables: Dict[Any, int]) -> Dict[str, Any]:
    """The `grid` entry; the rank table goes to the top-level `meshes` (index from `tables`)."""
    grid = {"mesh": list(g.mesh), "dims": list(g.dims), "ranks": tables.setdefault(g.ranks, len(tables)),
            "split": g.split_bytes}
    if g.choices is not None:
        grid.update(choices=base64.b64encode(g.choices).decode("ascii"), choice_bytes=g.choice_width)
    if g.region_arrays:
        grid["region_arrays"] = True
    return grid


def parse_tables(raw: Any, world: int, where: str) -> List[RankTable]:
    """`meshes`: rank tables, each a list of distinct ranks (or -1) no longer than the world."""
    w = f"{where}.meshes"
    _expect(isinstance(raw, list), w, "meshes is not a list of rank tables")
    tables = []
    for t in raw:
        _expect(isinstance(t, list) and 1 <= len(t) <= world, w, "rank table malformed")
        _expect(all(type(r) is int and -1 <= r < world for r in t), w, "rank table entries must be ranks or -1")
        present = [r for r in t if r >= 0]
        _expect(len(set(present)) == len(present), w, "a rank appears twice in a rank table")
        tables.append(RankTable(t))
    return tables


def parse_grid_tensor(key: str, t: Dict[str, Any], shape: Tuple[int, ...], holders: int,
                       arrays: Mapping[str, ArrayMeta], tables: List[RankTable], world: int,
                       w: str) -> TensorMeta:
    """As strict as the region form: the layout must be valid, its mesh no larger than the world
    (so generated regions are bounded by the world size), every cell with elements held by a
    rank, the array the tensor's own shape and dtype, and every writer choice in range."""
    g = t.get("grid")
    _expect(isinstance(g, dict), w, "grid is not an object")
    mesh = _ints(g.get("mesh"), w)
    dims = g.get("dims")
    _expect(isinstance(dims, list) and len(dims) == len(mesh), w, "grid dims malformed")
    dims = tuple(_int(d, w, -1, len(shape) - 1) for d in dims)
    _expect(valid_layout(shape, mesh, dims) and math.prod(mesh) <= world, w, "grid mesh malformed or larger than the world")
    table = tables[_int(g.get("ranks"), w, 0, len(tables) - 1)] if tables else None
    _expect(table is not None and len(table) == math.prod(mesh), w, "grid rank table missing or of the wrong size")
    split = _int(g.get("split"), w, 0, 1 << 62)
    name = safe_relative_path(t.get("array"), w)
    per_region = g.get("region_arrays", False)
    _expect(per_region in (True, False), w, "grid region_arrays is not a boolean")
    if not per_region:
        arr = arrays.get(name)
        _expect(arr is not None, w, f"grid names unknown array {name!r:.60}")
        _expect(arr.shape == shape and arr.dtype == t["dtype"], w, "grid array has another shape or dtype")
    choices, width = None, 1
    if "choices" in g:
        width = _int(g.get("choice_bytes"), w, 1, 4)
        _expect(width in (1, 2, 4) and isinstance(g["choices"], str), w, "grid choices malformed")
        try:
            choices = base64.b64decode(g["choices"].encode("ascii"), validate=True)
        except ValueError:
            raise _fail(w, "grid choices are not base64") from None
    grid = GridMeta(name, mesh, dims, table, split, choices, width, per_region)
    geo = Geometry(shape, dtype_itemsize(t["dtype"]), mesh, dims, table, split)
    _expect(geo.uncovered().size == 0, w, "a cell of the grid has elements but no holder")
    if per_region:  # one array per region, each exactly the region's shape
        for k, lens in enumerate(geo.regions()[2].tolist()):
            arr = arrays.get(grid.array_of(k))
            _expect(arr is not None and arr.shape == tuple(lens) and arr.dtype == t["dtype"], w,
                    f"grid region {k} has no array of its shape")
    if choices is not None:
        picks = grid.choice_array()
        _expect(len(choices) == width * geo.n_regions, w, "grid choices: one per region expected")
        _expect(bool(np.all(picks < geo.counts[geo.regions()[0]])), w, "grid choice names no holder")
    return grid_tensor(key, t["dtype"], shape, t["layout"], holders, grid)
