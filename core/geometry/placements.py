"""Pure math of DTensor placements: which elements of the global tensor a mesh coordinate holds.

A placement is described by a plain tuple, so that this module needs no torch and is unit-tested
against torch's own `compute_local_shape_and_global_offset`:

    ("replicate",)                  Replicate()
    ("shard", dim)                  Shard(dim)
    ("strided", dim, split_factor)  _StridedShard(dim, split_factor=...)  (FSDP2 over TP)

Placements are applied left to right over the mesh dimensions, each one cutting the indices the
previous ones left along its tensor dim, exactly as torch does:
- Shard(d) on n indices: torch.chunk into k pieces (ceil(n/k) each, the tail shorter or empty).
- _StridedShard(d, sf) on n indices: torch.chunk into sf pieces, each of those into k pieces;
  coordinate c holds piece c of every one of the sf pieces, in order. That is a union of up to
  sf separate ranges, so one rank's part of a strided tensor is a union of boxes, not one box.

Along each dim the indices a rank holds are kept as runs (global_start, length), in local order.
The local tensor is the cartesian product of the runs of every dim; each product is a box, and
`local_boxes` returns every box with the slice of the local tensor that holds it.
"""
from __future__ import annotations

import itertools
import math
from typing import List, Sequence, Tuple

Run = Tuple[int, int]                         # (global start, length)
PlacementDesc = Tuple                         # see module docstring
LocalBox = Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[Tuple[int, int], ...]]  # offsets, lengths, local [lo, hi) per dim


def chunk_bounds(n: int, k: int, i: int) -> Tuple[int, int]:
    """[lo, hi) of piece i when torch.chunk cuts n items into k pieces (empty pieces at the end)."""
    size = -(-n // k) if n else 0
    lo = min(n, size * i)
    return lo, min(n, lo + size)


def take(runs: Sequence[Run], lo: int, hi: int) -> List[Run]:
    """Local positions [lo, hi) of the index sequence that `runs` describes."""
    out: List[Run] = []
    pos = 0
    for start, length in runs:
        a, b = max(lo, pos), min(hi, pos + length)
        if a < b:
            out.append((start + a - pos, b - a))
        pos += length
        if pos >= hi:
            break
    return out


def merge(runs: Sequence[Run]) -> List[Run]:
    """Join runs that continue each other (global end of one == start of the next)."""
    out: List[Run] = []
    for start, length in runs:
        if length == 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def total(runs: Sequence[Run]) -> int:
    return sum(length for _, length in runs)


def cut(runs: Sequence[Run], placement: PlacementDesc, k: int, c: int) -> List[Run]:
    """What coordinate c of a mesh dim of size k keeps of `runs` under `placement`."""
    n = total(runs)
    kind = placement[0]
    if kind == "shard":
        return merge(take(runs, *chunk_bounds(n, k, c)))
    if kind == "strided":
        split_factor = int(placement[2])
        out: List[Run] = []
        for j in range(split_factor):
            lo1, hi1 = chunk_bounds(n, split_factor, j)
            lo2, hi2 = chunk_bounds(hi1 - lo1, k, c)
            out.extend(take(runs, lo1 + lo2, lo1 + hi2))
        return merge(out)
    raise ValueError(f"placement {placement!r} does not shard")


def local_runs(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
               placements: Sequence[PlacementDesc]) -> List[List[Run]]:
    """Per tensor dim: the runs of global indices that `coordinate` holds, in local order."""
    if not (len(mesh_shape) == len(coordinate) == len(placements)):
        raise ValueError(f"mesh shape {list(mesh_shape)}, coordinate {list(coordinate)} and placements "
                         f"{list(placements)} must have one entry per mesh dim")
    runs: List[List[Run]] = [[(0, int(s))] if s else [] for s in global_shape]
    for k, c, placement in zip(mesh_shape, coordinate, placements):
        if placement[0] == "replicate":
            continue
        dim = int(placement[1])
        if not 0 <= dim < len(runs):
            raise ValueError(f"placement {placement!r} shards dim {dim} of a {len(runs)}-dim tensor")
        runs[dim] = cut(runs[dim], placement, int(k), int(c))
    return runs


def local_shape(runs: Sequence[Sequence[Run]]) -> Tuple[int, ...]:
    return tuple(total(r) for r in runs)


def local_boxes(runs: Sequence[Sequence[Run]]) -> List[LocalBox]:
    """Every box the local tensor holds: (global offsets, lengths, local [lo, hi) per dim).

    Empty when the rank holds nothing. A 0-dim tensor is one box with empty tuples."""
    if any(total(r) == 0 for r in runs):
        return []
    per_dim = []
    for dim_runs in runs:
        pos, items = 0, []
        for start, length in dim_runs:
            items.append((start, length, (pos, pos + length)))
            pos += length
        per_dim.append(items)
    out: List[LocalBox] = []
    for combo in itertools.product(*per_dim):
        out.append((tuple(s for s, _, _ in combo), tuple(n for _, n, _ in combo), tuple(r for _, _, r in combo)))
    return out


def box_count(runs: Sequence[Sequence[Run]]) -> int:
    return math.prod(len(r) for r in runs)
