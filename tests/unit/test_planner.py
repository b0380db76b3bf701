"""Pure planner tests with simulated ranks: no processes."""
import pytest

from bytecheckpoint.common.errors import ShardLayoutError, StateMismatchError
from bytecheckpoint.planning.planner import (TargetSpec, TensorManifest, assign_readers, check_targets, plan_load,
                                    plan_save)


def replicated(key, shape, world, dtype="float32"):
    box = ((0,) * len(shape), tuple(shape))
    return [TensorManifest(key, dtype, tuple(shape), "replicated", (box,)) for _ in range(world)]


def row_sharded(key, shape, world, dtype="float32"):
    step = -(-shape[0] // world)
    out = []
    for r in range(world):
        lo, hi = min(shape[0], r * step), min(shape[0], (r + 1) * step)
        boxes = (((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:])),) if hi > lo else ()
        out.append(TensorManifest(key, dtype, tuple(shape), "sharded", boxes))
    return out


def manifests(*per_tensor):
    world = len(per_tensor[0])
    return [tuple(t[r] for t in per_tensor) for r in range(world)]


def test_replicated_written_once_and_balanced():
    world = 4
    tensors = [replicated(f"w{i}", (256, 1024), world) for i in range(8)]  # 1 MiB each
    plan = plan_save(manifests(*tensors))
    total = sum(len(w) for w in plan.writes)
    written = sum(l[0] * l[1] for ws in plan.writes for w in ws for l in [w.lengths])
    assert written == 8 * 256 * 1024, "each element written exactly once"
    ideal = 8 * 256 * 1024 * 4 / world
    assert max(plan.bytes_per_rank) <= 1.1 * ideal, plan.bytes_per_rank
    assert total >= world


def test_one_big_replicated_tensor_is_split_across_writers():
    plan = plan_save(manifests(replicated("big", (4096, 4096), 2)))
    assert plan.bytes_per_rank[0] == plan.bytes_per_rank[1] == 4096 * 4096 * 4 // 2
    regions = plan.tensors["big"].regions
    assert {r.writer for r in regions} == {0, 1}


def test_sharded_keeps_writers_and_uneven_chunks():
    plan = plan_save(manifests(row_sharded("w", (10, 6), 3)))
    regions = plan.tensors["w"].regions
    assert [(r.offsets, r.lengths, r.writer) for r in regions] == [
        ((0, 0), (4, 6), 0), ((4, 0), (4, 6), 1), ((8, 0), (2, 6), 2)]
    arr = plan.arrays[regions[0].array]
    assert arr.shape == (10, 6) and arr.chunks == (4, 6)  # last chunk: rows 8..10, a zarr edge chunk
    assert plan.creates[0] == (regions[0].array,)


def test_hsdp_replicated_dim_deduplicated():
    # 2 replicas x 2 shards
    shards = row_sharded("w", (8, 4), 2)
    plan = plan_save([(shards[0],), (shards[1],), (shards[0],), (shards[1],)])
    regions = plan.tensors["w"].regions
    assert len(regions) == 2
    assert sorted(r.writer for r in regions) != [0, 0]


def test_overlapping_shards_named():
    bad = [TensorManifest("w", "float32", (4, 4), "sharded", ((((0, 0), (3, 4))),)),
           TensorManifest("w", "float32", (4, 4), "sharded", ((((2, 0), (2, 4))),))]
    with pytest.raises(ShardLayoutError, match=r"'w'.*overlaps.*ranks \[0\].*ranks \[1\]|'w'.*overlaps"):
        plan_save([(bad[0],), (bad[1],)])


def test_non_covering_shards_named():
    bad = [TensorManifest("w", "float32", (4, 4), "sharded", ((((0, 0), (2, 4))),)),
           TensorManifest("w", "float32", (4, 4), "sharded", ())]
    with pytest.raises(ShardLayoutError, match="'w'.*cover 8 of 16"):
        plan_save([(bad[0],), (bad[1],)])


def test_shape_disagreement_between_ranks():
    a = TensorManifest("w", "float32", (4, 4), "replicated", ((((0, 0), (4, 4))),))
    b = TensorManifest("w", "float32", (4, 5), "replicated", ((((0, 0), (4, 5))),))
    with pytest.raises(ShardLayoutError, match="rank 0 .* rank 1"):
        plan_save([(a,), (b,)])


def test_load_plan_reads_only_overlaps():
    plan = plan_save(manifests(row_sharded("w", (10, 6), 3)))
    # target: rows 3..7 on one rank
    reads = plan_load(plan.tensors, [TargetSpec("w", "float32", (10, 6), (((3, 0), (5, 6)),))])
    assert [(r.global_box, r.target_box) for r in reads] == [
        (((3, 0), (1, 6)), ((0, 0), (1, 6))), (((4, 0), (4, 6)), ((1, 0), (4, 6)))]
    assert sum(r.array_box[1][0] * r.array_box[1][1] for r in reads) == 30


def test_check_targets_names_key_and_shapes():
    plan = plan_save(manifests(replicated("w", (4, 4), 1)))
    with pytest.raises(StateMismatchError, match=r"'w'.*\[4, 4\].*\[4, 5\]"):
        check_targets(plan.tensors, [TargetSpec("w", "float32", (4, 5), ())])
    with pytest.raises(StateMismatchError, match="'w'.*float32.*bfloat16"):
        check_targets(plan.tensors, [TargetSpec("w", "bfloat16", (4, 4), ())])


def test_assign_readers_balanced_and_only_for_shared():
    reqs = [[("a", 1), ("b", 1), ("c", 1)], [("a", 1), ("b", 1), ("c", 1)], [("d", 1)]]
    sizes = {("a", 1): 10, ("b", 1): 10, ("c", 1): 10, ("d", 1): 5}
    out = assign_readers(reqs, sizes)
    assert set(out) == {("a", 1), ("b", 1), ("c", 1)}
    readers = [out[k][0] for k in sorted(out)]
    assert set(readers) == {0, 1}
