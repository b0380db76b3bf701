"""Regular (DTensor) layouts planned once per tensor: simulated ranks 0..N, no processes.

Every case builds what each rank's flatten would produce (boxes from torch's own DTensor math,
plus the layout), plans it through the compact path and through the general path over explicit
boxes (regular=False), and checks they agree region for region, with balanced writers; then
plans loads at other world sizes against the compact metadata (after a JSON round trip) and
executes them on numpy arrays to check the bytes land where they belong.
"""
import itertools
import math
import pickle

import numpy as np
import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from bytecheckpoint.common.errors import ShardLayoutError
from bytecheckpoint.geometry.grids import cell_box, partition
from bytecheckpoint.planning.manifests import TensorManifest, pack_manifest
from bytecheckpoint.format.metadata import FORMAT_VERSION, ArrayMeta, Metadata
from bytecheckpoint.planning.planner import (TargetSpec, local_plan, plan_load, plan_save, rank_part, split_for_ranks)
from bytecheckpoint.storage.chunks import chunk_name

# (name, shape, dtype, mesh, placements): placements as torch objects
CASES = [
    ("fsdp-even", (16, 8), "float32", (4,), (Shard(0),)),
    ("fsdp-uneven", (10, 6), "float32", (3,), (Shard(0),)),
    ("fsdp-empty-ranks", (5, 3), "float32", (8,), (Shard(0),)),
    ("tp-cols", (6, 10), "bfloat16", (4,), (Shard(1),)),
    ("mesh2d", (9, 7), "float32", (2, 3), (Shard(0), Shard(1))),
    ("mesh2d-same-dim", (11, 4), "float32", (2, 3), (Shard(0), Shard(0))),
    ("mesh2d-transposed", (7, 9), "float32", (3, 2), (Shard(1), Shard(0))),
    ("hsdp", (10, 6), "float32", (2, 4), (Replicate(), Shard(0))),
    ("hsdp-split", (1024, 1024), "float32", (4, 2), (Replicate(), Shard(0))),       # 2 MiB cells, split
    ("hsdp-uneven-split", (1031, 1100), "float32", (3, 2), (Replicate(), Shard(0))),
    ("coprime-edges", (1001, 2), "float32", (2, 2), (Shard(0), Shard(0))),               # one array per region
    ("ddp-dtensor", (12, 5), "float32", (3,), (Replicate(),)),
    ("ddp-big", (2000, 600), "float32", (5,), (Replicate(),)),                      # 4.6 MiB, split 4 ways
    ("3d", (6, 8, 10), "float16", (2, 2, 2), (Shard(2), Replicate(), Shard(0))),
    ("scalar", (), "float32", (3,), (Replicate(),)),
    ("vector-1d", (13,), "int64", (4,), (Shard(0),)),
]


def torch_box(shape, mesh, placements, coord):
    lshape, offs = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
    return tuple(int(o) for o in offs), tuple(int(s) for s in lshape)


def dims_of(placements, ndim):
    return tuple(p.dim % ndim if isinstance(p, Shard) else -1 for p in placements)


def rank_manifests(key, shape, dtype, mesh, placements, with_grid=True):
    """What save_plan.manifest_of gives on each rank (row-major mesh: rank = coordinate index)."""
    out = []
    for rank, coord in enumerate(itertools.product(*(range(m) for m in mesh))):
        offs, lens = torch_box(shape, mesh, placements, coord)
        boxes = ((offs, lens),) if math.prod(lens) > 0 else ()  # flatten drops empty pieces
        grid = (tuple(mesh), dims_of(placements, len(shape)), tuple(coord)) if with_grid else None
        layout = "sharded" if any(isinstance(p, Shard) for p in placements) else "replicated"
        out.append(TensorManifest(key, dtype, tuple(shape), layout, boxes, grid))
    return out


def per_rank(*tensors):
    return [tuple(t[r] for t in tensors) for r in range(len(tensors[0]))]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cell_boxes_match_torch(case):
    _, shape, _, mesh, placements = case
    dims = dims_of(placements, len(shape))
    for coord in itertools.product(*(range(m) for m in mesh)):
        mine, theirs = cell_box(shape, mesh, dims, coord), torch_box(shape, mesh, placements, coord)
        assert mine[1] == theirs[1]
        if math.prod(theirs[1]):
            assert mine[0] == theirs[0]


def test_partition_is_torch_chunk():
    import torch
    for size, m in itertools.product(range(0, 14), range(1, 6)):
        starts, lens = partition(size, [m])
        chunks = list(torch.arange(size).chunk(m)) if size else []
        got = [(int(s), int(n)) for s, n in zip(starts, lens) if n]
        assert got == [(int(c[0]), len(c)) for c in chunks if len(c)]


def regions_of(plan, key):
    t = plan.tensors[key]
    arrays = {}
    for r in t.regions:
        a = plan.arrays[r.array]
        arrays[(r.offsets, r.lengths)] = (a.shape, a.chunks, r.array_offsets, r.array == r.array.split("/r")[0])
    return {(r.offsets, r.lengths) for r in t.regions}, arrays


def assert_same_plan(grid_plan, general_plan, keys):
    for key in keys:
        g, b = grid_plan.tensors[key], general_plan.tensors[key]
        assert g.grid is not None, f"{key}: the regular path was not taken"
        assert (g.dtype, g.shape, g.layout, g.holders) == (b.dtype, b.shape, b.layout, b.holders)
        (g_regions, g_arrays), (b_regions, b_arrays) = regions_of(grid_plan, key), regions_of(general_plan, key)
        assert g_regions == b_regions
        assert g_arrays == b_arrays, "same chunk grid, same array shapes, same offsets"
        writes = [w for ws in grid_plan.writes for w in ws if w.key == key]
        assert sorted((w.offsets, w.lengths) for w in writes) == sorted(g_regions), "each region written once"
        for r in g.regions:  # the writer holds the region
            assert (r.offsets, r.lengths) in {(w.offsets, w.lengths) for w in grid_plan.writes[r.writer]}
    assert sum(grid_plan.bytes_per_rank) == sum(general_plan.bytes_per_rank)
    largest = max((math.prod(r.lengths) * 4 for k in keys for r in general_plan.tensors[k].regions), default=0)
    assert max(grid_plan.bytes_per_rank) <= max(general_plan.bytes_per_rank) + largest // 2 + 1, \
        (grid_plan.bytes_per_rank, general_plan.bytes_per_rank)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_grid_plan_equals_general_plan(case):
    name, shape, dtype, mesh, placements = case
    grid = plan_save(per_rank(rank_manifests("w", shape, dtype, mesh, placements)))
    general = plan_save(per_rank(rank_manifests("w", shape, dtype, mesh, placements, with_grid=False)), regular=False)
    assert_same_plan(grid, general, ["w"])
    assert grid.bytes_per_rank == general.bytes_per_rank or "split" in name or "big" in name
    assert grid.creates == tuple(tuple(c) for c in grid.creates)
    created = [a for cs in grid.creates for a in cs]
    assert sorted(created) == sorted(set(created)) and set(created) == {r.array for r in grid.tensors["w"].regions}


def test_many_tensors_balanced_like_the_general_path():
    """Replicated (DDP) and HSDP tensors of many sizes: LPT over whole batches stays balanced."""
    tensors = []
    for i in range(16):
        rows = 300 + 97 * i
        tensors.append(rank_manifests(f"rep{i}", (rows, 512), "float32", (6,), (Replicate(),)))
        tensors.append(rank_manifests(f"hsdp{i}", (rows, 256), "float32", (2, 3), (Replicate(), Shard(0))))
    plain = [[TensorManifest(f"plain{i}", "float32", (64 * i + 1, 1024), "replicated",
                             (((0, 0), (64 * i + 1, 1024)),)) for _ in range(6)] for i in range(1, 20)]
    ms = per_rank(*tensors, *plain)
    grid, general = plan_save(ms), plan_save([tuple(dict_replace(m) for m in r) for r in ms], regular=False)
    assert_same_plan(grid, general, sorted(grid.tensors))
    ideal = sum(grid.bytes_per_rank) / 6
    assert max(grid.bytes_per_rank) <= 1.05 * ideal, (grid.bytes_per_rank, ideal)


def dict_replace(m):
    return TensorManifest(m.key, m.dtype, m.shape, m.layout, m.boxes, None)


def test_packed_gather_is_small_and_plans_the_same():
    world, tensors = 64, 200
    shapes = [(4096 + 8 * t, 1024) for t in range(tensors)]
    ms = per_rank(*[rank_manifests(f"layers.{t}.w", s, "bfloat16", (world,), (Shard(0),)) for t, s in enumerate(shapes)])
    first = pack_manifest(ms[0])
    packed = [first] + [pack_manifest(m, first.digest) for m in ms[1:]]
    assert all(p.table is None for p in packed[1:])
    assert max(len(pickle.dumps(p)) for p in packed[1:]) < 300
    assert plan_save(packed) == plan_save(ms)
    # a rank whose table differs (another tensor set) sends its table and is still planned
    odd = list(ms)
    odd[5] = odd[5] + (TensorManifest("extra", "float32", (4,), "replicated", (((0,), (4,)),)),)
    packed = [first] + [pack_manifest(m, first.digest) for m in odd[1:]]
    assert packed[5].table is not None
    plan = plan_save(packed)
    assert [r.writer for r in plan.tensors["extra"].regions] == [5]


def test_missing_coordinate_is_named():
    ms = rank_manifests("w", (8, 4), "float32", (4,), (Shard(0),))
    with pytest.raises(ShardLayoutError, match=r"'w'.*cover 24 of 32 elements.*no rank holds \[2:4, 0:4\]"):
        plan_save([(ms[0],), (), (ms[2],), (ms[3],)])  # rank 1 does not report the tensor


def test_box_disagreeing_with_its_layout_is_not_trusted():
    ms = rank_manifests("w", (8, 4), "float32", (2,), (Shard(0),))
    bad = TensorManifest("w", "float32", (8, 4), "sharded", (((0, 0), (4, 4)),), ((2,), (0,), (1,)))  # box of rank 0
    assert pack_manifest([bad]).table[0][4] is None, "packed as irregular boxes"
    with pytest.raises(ShardLayoutError, match="cover 16 of 32"):
        plan_save([(ms[0],), (bad,)])


def test_duplicate_coordinates_fall_back_to_boxes():
    ms = rank_manifests("w", (8, 4), "float32", (2,), (Shard(0),))
    plan = plan_save([(ms[0],), (ms[1],), (ms[1],)])  # two ranks claim coordinate 1
    t = plan.tensors["w"]
    assert t.grid is None and sorted(r.offsets for r in t.regions) == [(0, 0), (4, 0)]


def test_mixed_regular_and_irregular_holders_fall_back():
    ms = rank_manifests("w", (8, 4), "float32", (2,), (Shard(0),))
    flat = TensorManifest("w", "float32", (8, 4), "flat", (((4, 0), (4, 4)),))
    plan = plan_save([(ms[0],), (flat,)])
    assert plan.tensors["w"].grid is None and plan.tensors["w"].layout == "flat"


def test_rank_parts_from_the_broadcast_plan():
    ms = per_rank(rank_manifests("a", (40, 8), "float32", (2, 2), (Replicate(), Shard(0))),
                  rank_manifests("b", (9, 3), "float32", (2, 2), (Shard(1), Shard(0))),
                  rank_manifests("big", (1024, 1024), "float32", (2, 2), (Replicate(), Shard(0))),  # choices
                  rank_manifests("odd", (1001, 2), "float32", (2, 2), (Shard(0), Shard(0))),       # region arrays
                  rank_manifests("few", (3, 2), "float32", (4,), (Shard(0),)),                     # rank 3 empty
                  [TensorManifest("c", "float32", (4, 4), "flat", (((r, 0), (1, 4)),)) for r in range(4)])
    plan = plan_save(ms)
    shared, extras = split_for_ranks(plan)
    assert set(shared.tensors) == set(plan.tensors) - {"c"} and extras is not None
    shared = pickle.loads(pickle.dumps(shared))
    created = []
    for r in range(4):
        mine = local_plan(shared, extras[r], r)
        full = rank_part(plan, r)
        assert sorted(map(repr, mine.writes)) == sorted(map(repr, full.writes))
        assert sorted(mine.creates) == sorted(full.creates) and mine.arrays == full.arrays
        # the reference: the regions the metadata says this rank wrote
        want = sorted((k, x.offsets, x.lengths, x.array, x.array_offsets) for k, t in plan.tensors.items()
                      for x in t.regions if x.writer == r)
        assert sorted((w.key, w.offsets, w.lengths, w.array, w.array_offsets) for w in mine.writes) == want
        assert set(mine.arrays) == {w.array for w in mine.writes} | set(mine.creates)
        created += mine.creates
    assert sorted(created) == sorted(plan.arrays), "every array created once"
    for t in plan.tensors.values():  # by the writer of its first region
        first = t.regions[0]
        assert first.array in local_plan(shared, extras[first.writer], first.writer).creates


# ------------------------------------------------------------------ load planning, N -> M

def metadata_of(plan, world, version=FORMAT_VERSION):
    """The metadata a commit would write (with checksums), through JSON and the parser."""
    arrays = {}
    for path, a in plan.arrays.items():
        names = [chunk_name(i) for i in itertools.product(*[range(-(-s // c)) for s, c in zip(a.shape, a.chunks)])]
        arrays[path] = ArrayMeta(a.path, a.shape, a.chunks, a.dtype, {n: i for i, n in enumerate(names)})
    md = Metadata(version, "t", world, plan.tensors, arrays, (), {"dict": [[f'"{k}"', {"tensor": k}]
                                                                        for k in plan.tensors]}, {})
    return Metadata.from_json(md.to_json())


def execute(md, key, reads, target_pieces, source):
    """Apply the reads: arrays hold the saved data as the save would have written it."""
    def at(box):
        return tuple(slice(o, o + l) for o, l in zip(*box)) + (Ellipsis,)  # (Ellipsis,): views of 0-d too

    arrays = {}
    for r in md.tensors[key].regions:
        arr = arrays.setdefault(r.array, np.full(md.arrays[r.array].shape, -1.0))
        arr[at((r.array_offsets, r.lengths))] = source[at((r.offsets, r.lengths))]
    out = [np.full(p[1], np.nan) for p in target_pieces]
    for r in reads:
        assert r.array_box[1] == r.target_box[1]
        view = out[r.piece][at(r.target_box)]
        assert np.isnan(view).all(), "two reads wrote the same element"
        view[...] = arrays[r.array][at(r.array_box)]
    return out


LOAD_CASES = [c for c in CASES if c[0] in ("fsdp-uneven", "fsdp-empty-ranks", "mesh2d", "mesh2d-same-dim", "hsdp",
                                           "hsdp-uneven-split", "coprime-edges", "ddp-big", "3d", "scalar",
                                           "vector-1d")]


@pytest.mark.parametrize("case", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_load_plan_against_compact_metadata_resharded(case):
    name, shape, dtype, mesh, placements = case
    plan = plan_save(per_rank(rank_manifests("w", shape, dtype, mesh, placements)))
    md = metadata_of(plan, math.prod(mesh))
    assert md.tensors["w"].grid is not None
    v1 = metadata_of(plan, math.prod(mesh), version=1)   # the same checkpoint spelled out as regions
    assert v1.tensors["w"].grid is None and list(v1.tensors["w"].regions) == list(md.tensors["w"].regions)
    source = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    targets = [((0,) * len(shape), tuple(shape))]  # load on one rank
    if shape:
        for m in (1, 2, 3, 5):  # FSDP rows at M ranks, and columns where there are any
            targets += [torch_box(shape, (m,), (Shard(0),), (i,)) for i in range(m)]
            if len(shape) > 1:
                targets += [torch_box(shape, (m,), (Shard(1),), (i,)) for i in range(m)]
            targets += [torch_box(shape, (2, m), (Shard(0), Shard(len(shape) - 1)), (i, j))
                        for i in range(2) for j in range(m)]
    for piece in targets:
        spec = [TargetSpec("w", dtype, tuple(shape), (piece,))]
        reads = plan_load(md.tensors, spec)
        general = plan_load(v1.tensors, spec)
        assert sorted(map(repr, reads)) == sorted(map(repr, general)), piece
        got = execute(md, "w", reads, [piece], source)[0]
        want = source[tuple(slice(o, o + l) for o, l in zip(*piece)) + (Ellipsis,)]
        assert np.array_equal(got, want), piece


def test_load_overlaps_only_nearby_regions():
    """A rank's piece at 1024 saved ranks touches O(1) regions and is planned without per-rank work."""
    world = 1024
    plan = plan_save(per_rank(rank_manifests("w", (4100, 16), "float32", (world,), (Shard(0),))))
    md = metadata_of(plan, world)
    piece = torch_box((4100, 16), (3,), (Shard(0),), (1,))
    reads = plan_load(md.tensors, [TargetSpec("w", "float32", (4100, 16), (piece,))])
    assert sum(math.prod(r.global_box[1]) for r in reads) == math.prod(piece[1])
    assert len(reads) <= -(-piece[1][0] // 5) + 1   # saved rows per rank: ceil(4100/1024) = 5


def test_empty_and_scalar_tensors_round_trip(tmp_path):
    """Edge shapes through a real single-process save: an empty tensor has an array with no
    chunks (and no checksums), a 0-d tensor one chunk "c"."""
    import torch
    import bytecheckpoint as bcp
    state = {"empty": torch.zeros(0, 4), "empty3": torch.zeros(2, 0, 3), "scalar": torch.tensor(2.5),
             "w": torch.arange(6.0).view(2, 3)}
    bcp.save(str(tmp_path / "ck"), state)
    md = Metadata.from_json((tmp_path / "ck" / "metadata.json").read_bytes())
    assert len(md.arrays[md.tensors["empty"].regions[0].array].checksums) == 0
    assert list(md.arrays[md.tensors["scalar"].grid.array].checksums) == ["c"]
    target = {"empty": torch.ones(0, 4), "empty3": torch.ones(2, 0, 3), "scalar": torch.tensor(0.0),
              "w": torch.zeros(2, 3)}
    bcp.load(str(tmp_path / "ck"), target)
    assert target["scalar"].item() == 2.5 and torch.equal(target["w"], state["w"])
    assert bcp.verify(str(tmp_path / "ck")).ok
