"""core/geometry/placements.py against torch's own sharding: for every mesh coordinate, the boxes we compute
must rebuild exactly the local tensor torch's placements cut out (Shard, _StridedShard, Replicate,
even and uneven), and agree with torch's local shape / first global offset."""
import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from bytecheckpoint.geometry import placements as pm


def desc(p):
    if isinstance(p, _StridedShard):
        return ("strided", p.dim, p.split_factor)
    if isinstance(p, Shard):
        return ("shard", p.dim)
    return ("replicate",)


def torch_local(full, mesh_shape, coord, placements):
    """The local tensor torch's placements give `coord`, applied left to right as distribute_tensor does."""
    t = full
    for k, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, (Shard, _StridedShard)):
            t = p._split_tensor(t, k, with_padding=False)[0][c]
    return t


def ours(full, mesh_shape, coord, placements):
    runs = pm.local_runs(full.shape, mesh_shape, coord, [desc(p) for p in placements])
    local = torch.empty(pm.local_shape(runs), dtype=full.dtype)
    for offs, lens, sl in pm.local_boxes(runs):
        local[tuple(slice(lo, hi) for lo, hi in sl)] = full[tuple(slice(o, o + n) for o, n in zip(offs, lens))]
    return runs, local


SS = _StridedShard
CASES = [
    ((8,), (2, 2), [Shard(0), SS(0, split_factor=2)]),            # torch's docstring: rank 0 holds rows 0 and 2
    ((8, 4), (2, 2), [SS(0, split_factor=2), Shard(0)]),          # FSDP2 over colwise TP (torchtitan)
    ((10, 3), (2, 2), [SS(0, split_factor=2), Shard(0)]),         # uneven
    ((7, 5), (2, 3), [SS(0, split_factor=3), Shard(0)]),          # uneven, tp=3
    ((13, 6), (3, 2), [SS(0, split_factor=2), Shard(0)]),
    ((10,), (2, 3), [SS(0, split_factor=2), Shard(0)]),           # sf != tp: union of boxes per rank
    ((6, 9), (2, 2), [Shard(0), Shard(1)]),                       # FSDP2 over rowwise TP
    ((9, 6), (2, 2), [Shard(1), SS(1, split_factor=2)]),
    ((5, 12), (2, 2, 2), [Replicate(), SS(1, split_factor=2), Shard(1)]),  # HSDP + TP
    ((12, 4), (2, 2, 2), [SS(0, split_factor=4), Shard(0), Shard(0)]),
    ((3, 4), (4,), [Shard(0)]),                                   # a rank with nothing
    ((2, 3), (2, 2), [SS(0, split_factor=2), Shard(0)]),          # tiny: empty pieces
    ((), (2,), [Replicate()]),                                    # 0-dim
]


@pytest.mark.parametrize("shape,mesh_shape,placements", CASES)
def test_boxes_rebuild_torch_local_tensor(shape, mesh_shape, placements):
    full = torch.arange(max(1, torch.Size(shape).numel())).reshape(shape)
    for coord in itertools.product(*(range(k) for k in mesh_shape)):
        expect = torch_local(full, mesh_shape, coord, placements)
        runs, got = ours(full, mesh_shape, coord, placements)
        assert torch.equal(got, expect), (coord, got, expect)
        ref_shape, ref_offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        assert pm.local_shape(runs) == tuple(ref_shape), coord
        if all(ref_shape):
            assert tuple(r[0][0] for r in runs) == tuple(ref_offsets), coord


def test_union_of_boxes_and_exact_tiling():
    """Every element is held by exactly one coordinate of a fully sharded layout, even when a rank's
    part is a union of several boxes."""
    shape, mesh_shape, placements = (10, 4), (2, 3), [("strided", 0, 2), ("shard", 0)]
    seen = torch.zeros(shape, dtype=torch.int64)
    multi = 0
    for coord in itertools.product(range(2), range(3)):
        boxes = pm.local_boxes(pm.local_runs(shape, mesh_shape, coord, placements))
        multi += len(boxes) > 1
        for offs, lens, _ in boxes:
            seen[tuple(slice(o, o + n) for o, n in zip(offs, lens))] += 1
    assert multi > 0
    assert torch.equal(seen, torch.ones(shape, dtype=torch.int64))


def test_take_and_merge():
    assert pm.take([(0, 3), (10, 4)], 2, 5) == [(2, 1), (10, 2)]
    assert pm.merge([(0, 2), (2, 3), (7, 1), (8, 0)]) == [(0, 5), (7, 1)]
    assert pm.chunk_bounds(10, 4, 3) == (9, 10) and pm.chunk_bounds(3, 4, 3) == (3, 3)
    with pytest.raises(ValueError):
        pm.local_runs((4,), (2,), (0,), [("shard", 1)])
