"""Pure region math: boxes of a global tensor, flat ranges, intersections, chunk grids.

A box is (offsets, lengths), both tuples of ints with one entry per dimension.
No torch, no I/O: everything here is unit-tested directly.
"""
from __future__ import annotations

import math
from functools import reduce
from typing import Iterable, List, Optional, Sequence, Tuple

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]


def volume(lengths: Sequence[int]) -> int:
    return math.prod(lengths) if lengths else 1


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The overlap of two boxes, or None when they do not overlap."""
    offsets, lengths = [], []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return tuple(offsets), tuple(lengths)


def relative(inner: Box, outer_offsets: Sequence[int]) -> Tuple[slice, ...]:
    """Slices selecting `inner` inside a buffer that starts at `outer_offsets`."""
    return tuple(slice(o - oo, o - oo + l) for o, l, oo in zip(inner[0], inner[1], outer_offsets))


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> List[Box]:
    """Decompose elements [start, stop) of a row-major tensor into boxes.

    Each box is contiguous in row-major order, and the boxes appear in order, so box k
    covers a contiguous run of the flat range. At most 2*ndim - 1 boxes.
    """
    shape = tuple(int(s) for s in shape)
    total = volume(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of {total} elements")
    if start == stop:
        return []
    if len(shape) == 0:
        return [((), ())]
    return _decompose(shape, start, stop)


def _decompose(shape: Tuple[int, ...], start: int, stop: int) -> List[Box]:
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    row = volume(shape[1:])
    first_row, last_row = start // row, (stop - 1) // row
    boxes: List[Box] = []

    def partial(r: int, lo: int, hi: int) -> None:
        for offs, lens in _decompose(shape[1:], lo, hi):
            boxes.append(((r,) + offs, (1,) + lens))

    if start % row == 0 and stop % row == 0:
        return [((first_row,) + (0,) * (len(shape) - 1), (last_row - first_row + 1,) + shape[1:])]
    if first_row == last_row:
        partial(first_row, start - first_row * row, stop - first_row * row)
        return boxes
    full_lo = first_row
    if start % row:
        partial(first_row, start % row, row)
        full_lo = first_row + 1
    full_hi = last_row + 1 if stop % row == 0 else last_row
    if full_hi > full_lo:
        boxes.append(((full_lo,) + (0,) * (len(shape) - 1), (full_hi - full_lo,) + shape[1:]))
    if stop % row:
        partial(last_row, 0, stop - last_row * row)
    return boxes


def chunk_grid(shape: Sequence[int], boxes: Iterable[Box]) -> Tuple[int, ...]:
    """The coarsest regular chunk shape whose chunk boundaries include every box edge inside
    the tensor (the tensor's end needs none: zarr cuts edge chunks there).

    Every chunk then lies inside exactly one box, so each chunk has exactly one writer.
    """
    shape = tuple(shape)
    edges = [set() for _ in shape]
    for offsets, lengths in boxes:
        for d, (o, l) in enumerate(zip(offsets, lengths)):
            edges[d].update(e for e in (o, o + l) if 0 < e < shape[d])
    return tuple(max(1, reduce(math.gcd, sorted(e), 0) or s) for e, s in zip(edges, shape))


def refine_chunks(grid: Tuple[int, ...], shape: Sequence[int], itemsize: int, target_bytes: int,
                  exact: bool = False) -> Tuple[int, ...]:
    """Split chunks along dim 0 towards `target_bytes`. With no box edge inside dim 0 (grid[0] is
    the whole dim) the tensor's end needs no boundary: ceil-divided rows, at most one short edge
    chunk (unless `exact`: chunks that tile the tensor with no padded edge chunk). Otherwise the
    chunk rows must divide grid[0]: the divisor nearest the target (a prime row count once gave
    one-row chunks, thousands of files for one tensor)."""
    if not grid:
        return grid
    chunk_bytes = volume(grid) * itemsize
    rows = grid[0]
    if chunk_bytes <= target_bytes or rows < 2:
        return grid
    if len(shape) and rows == shape[0] and not exact:
        pieces = min(rows, -(-chunk_bytes // target_bytes))
        return (-(-rows // pieces),) + tuple(grid[1:])
    row_bytes = chunk_bytes / rows
    divisors = {d for i in range(1, math.isqrt(rows) + 1) if rows % i == 0 for d in (i, rows // i)}
    best = min(sorted(divisors), key=lambda per: abs(math.log(per * row_bytes / target_bytes)))
    return (best,) + tuple(grid[1:])


def chunk_count(shape: Sequence[int], chunks: Sequence[int]) -> int:
    return volume([-(-s // c) if s else 1 for s, c in zip(shape, chunks)])


def find_layout_problem(shape: Sequence[int], boxes: Sequence[Box]) -> Optional[Tuple[str, List[int]]]:
    """Why distinct `boxes` do not tile `shape` exactly (message, indices of the boxes at fault),
    or None if they do."""
    for i, (offs, lens) in enumerate(boxes):
        if len(offs) != len(shape) or any(o < 0 or l < 0 or o + l > s for o, l, s in zip(offs, lens, shape)):
            return f"box {_fmt(boxes[i])} lies outside global shape {list(shape)}", [i]
    if shape and all(o[1:] == (0,) * (len(shape) - 1) and l[1:] == tuple(shape[1:]) for o, l in boxes):
        # Fast path, row slabs (FSDP, ZeRO rows): sorted starts must follow each other exactly.
        order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
        pos = 0
        for i in order:
            start, n = boxes[i][0][0], boxes[i][1][0]
            if n == 0:
                continue
            if start != pos:
                break
            pos += n
        else:
            if pos == shape[0] or volume(shape) == 0:
                return None
    # Sweep along dim 0: only boxes whose dim-0 intervals overlap are compared, so the
    # common layouts (FSDP rows, TP columns within a row block) stay near-linear.
    ordered = sorted(range(len(boxes)), key=lambda i: boxes[i][0][:1])
    active: List[int] = []
    for i in ordered:
        start0 = boxes[i][0][0] if shape else 0
        active = [j for j in active if not shape or boxes[j][0][0] + boxes[j][1][0] > start0]
        for j in active:
            if intersect(boxes[i], boxes[j]) is not None:
                return f"box {_fmt(boxes[j])} overlaps box {_fmt(boxes[i])}", [j, i]
        active.append(i)
    covered = sum(volume(b[1]) for b in boxes)
    if covered != volume(shape):
        return (f"the shards cover {covered} of {volume(shape)} elements of global shape {list(shape)}",
                list(range(len(boxes))))
    return None


def _fmt(box: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + l}" for o, l in zip(*box)) + "]"
