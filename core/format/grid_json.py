"""Grid tensors in the metadata: regular (DTensor) layouts stored as their layout, not as a list
of regions (docs/format.md, "grid"). Their JSON form with its validation (as strict as for region
lists: bounded by the world size); the records (GridMeta, GridRegions) are in format/records.py.
"""
from __future__ import annotations

import base64
import math
from typing import Any, Dict, List, Mapping, Tuple

import numpy as np

from ..common.dtypes import itemsize as dtype_itemsize
from ..geometry.grids import Geometry, RankTable, valid_layout
from .records import (
    ArrayMeta,
    GridMeta,
    TensorMeta,
    check_int,
    check_ints,
    expect,
    fail,
    grid_tensor,
    safe_relative_path,
)


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
    expect(isinstance(raw, list), w, "meshes is not a list of rank tables")
    tables = []
    for t in raw:
        expect(isinstance(t, list) and 1 <= len(t) <= world, w, "rank table malformed")
        expect(all(type(r) is int and -1 <= r < world for r in t), w, "rank table entries must be ranks or -1")
        present = [r for r in t if r >= 0]
        expect(len(set(present)) == len(present), w, "a rank appears twice in a rank table")
        tables.append(RankTable(t))
    return tables


def parse_grid_tensor(key: str, t: Dict[str, Any], shape: Tuple[int, ...], holders: int,
                       arrays: Mapping[str, ArrayMeta], tables: List[RankTable], world: int,
                       w: str) -> TensorMeta:
    """As strict as the region form: the layout must be valid, its mesh no larger than the world
    (so generated regions are bounded by the world size), every cell with elements held by a
    rank, the array the tensor's own shape and dtype, and every writer choice in range."""
    g = t.get("grid")
    expect(isinstance(g, dict), w, "grid is not an object")
    mesh = check_ints(g.get("mesh"), w)
    dims = g.get("dims")
    expect(isinstance(dims, list) and len(dims) == len(mesh), w, "grid dims malformed")
    dims = tuple(check_int(d, w, -1, len(shape) - 1) for d in dims)
    expect(valid_layout(shape, mesh, dims) and math.prod(mesh) <= world, w, "grid mesh malformed or larger than the world")
    table = tables[check_int(g.get("ranks"), w, 0, len(tables) - 1)] if tables else None
    expect(table is not None and len(table) == math.prod(mesh), w, "grid rank table missing or of the wrong size")
    split = check_int(g.get("split"), w, 0, 1 << 62)
    name = safe_relative_path(t.get("array"), w)
    per_region = g.get("region_arrays", False)
    expect(per_region in (True, False), w, "grid region_arrays is not a boolean")
    if not per_region:
        arr = arrays.get(name)
        expect(arr is not None, w, f"grid names unknown array {name!r:.60}")
        expect(arr.shape == shape and arr.dtype == t["dtype"], w, "grid array has another shape or dtype")
    choices, width = None, 1
    if "choices" in g:
        width = check_int(g.get("choice_bytes"), w, 1, 4)
        expect(width in (1, 2, 4) and isinstance(g["choices"], str), w, "grid choices malformed")
        try:
            choices = base64.b64decode(g["choices"].encode("ascii"), validate=True)
        except ValueError:
            raise fail(w, "grid choices are not base64") from None
    grid = GridMeta(name, mesh, dims, table, split, choices, width, per_region)
    geo = Geometry(shape, dtype_itemsize(t["dtype"]), mesh, dims, table, split)
    expect(geo.uncovered().size == 0, w, "a cell of the grid has elements but no holder")
    if per_region:  # one array per region, each exactly the region's shape
        for k, lens in enumerate(geo.regions()[2].tolist()):
            arr = arrays.get(grid.array_of(k))
            expect(arr is not None and arr.shape == tuple(lens) and arr.dtype == t["dtype"], w,
                    f"grid region {k} has no array of its shape")
    if choices is not None:
        picks = grid.choice_array()
        expect(len(choices) == width * geo.n_regions, w, "grid choices: one per region expected")
        expect(bool(np.all(picks < geo.counts[geo.regions()[0]])), w, "grid choice names no holder")
    return grid_tensor(key, t["dtype"], shape, t["layout"], holders, grid)
