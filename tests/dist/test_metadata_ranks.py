"""Issue 48: the metadata path bench_planner simulates is the one a real job takes. 8 gloo ranks save
its fsdp layout (scaled down) twice (a first save, then a repeated one through the cached layout);
metadata.json's layout (tensors, arrays, meshes) equals the simulation's for the same shapes, and each
save's tables hold every chunk (the load checks each one's crc32)."""
import json
import os
import random
import sys

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.format.metadata import ObjectFileMeta
from bytecheckpoint.pipeline import commit
from bytecheckpoint.planning.planner import plan_save
from bytecheckpoint.state.structure_union import SavedStructure

from launcher import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import bench_planner  # noqa: E402
from scenarios_metadata_ranks import global_value  # noqa: E402

WORLD, TENSORS, SCALE = 8, 12, 16


def layout_of(raw: bytes, data_dir: str) -> dict:
    """metadata.json's layout entries, the per-save values (table contents, data directory) left out."""
    body = json.loads(raw.decode().replace(data_dir, "DATA"))
    for a in body["arrays"].values():
        a.pop("crc32", None)
        a.pop("at", None)
    return {k: body[k] for k in ("tensors", "arrays", "meshes", "world_size")}


def simulated(data_dir: str) -> bytes:
    plan = plan_save([bench_planner.rank_manifest(WORLD, TENSORS, "fsdp", r, SCALE) for r in range(WORLD)])
    counts, nblocks, crcs = bench_planner.chunk_arrays(plan, random.Random(0))
    tables = bench_planner.rank_tables(counts, nblocks, crcs, WORLD)
    results = [((ObjectFileMeta(r, f"{data_dir}/objects/rank_{r}.json", 2, 0), t, None), None)
               for r, t in enumerate(tables)]
    raw, _ = commit.metadata_files("sim://", plan, "sim", data_dir, WORLD, SavedStructure({"dict": []}), results,
                                   {}, f"{data_dir}/checksums.bin")
    return raw


@pytest.mark.slow  # 8 processes on the 2-core machine: ~20 s alone, ~65 s beside make test's other workers
@pytest.mark.timeout(400)
def test_eight_ranks_write_the_simulated_layout(tmp_path):
    run_ranks("scenarios_metadata_ranks:save_fsdp", WORLD,
              {"path": str(tmp_path), "tensors": TENSORS, "scale": SCALE, "saves": 2}, timeout=300)
    for i in range(2):
        root = tmp_path / f"save_{i}"
        raw = (root / "metadata.json").read_bytes()
        data_dir = json.loads(raw)["info"]["data_dir"]
        assert layout_of(raw, data_dir) == layout_of(simulated("data-sim"), "data-sim")
        report = bcp.Checkpointer().verify(str(root))  # every stored chunk against its crc32s
        assert report.ok and report.checked_bytes > 0, report.problems
        shapes = bench_planner.shapes(TENSORS, SCALE)
        state = {f"layers.{t}.w": torch.zeros(shape, dtype=torch.bfloat16) for t, shape in enumerate(shapes)}
        bcp.load(str(root), state)  # every chunk read and checked against its crc32 and location
        for t, shape in enumerate(shapes):
            assert torch.equal(state[f"layers.{t}.w"], global_value(t, shape)), t
