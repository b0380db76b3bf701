"""Save at W in {1,2,3,4}, load at every other W: every layout, real gloo processes."""
import os

import pytest

import bytecheckpoint as bcp

from launcher import run_ranks

WORLDS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("matrix")
    paths = {}
    for w in WORLDS:
        paths[w] = str(base / f"saved_at_{w}")
        # W=2 and W=4 save asynchronously and mutate the state right after save() returns.
        run_ranks("scenarios_reshard:save_all", w, {"path": paths[w], "async_save": w % 2 == 0}, timeout=120)
    return paths


@pytest.mark.timeout(600)
@pytest.mark.parametrize("load_world", WORLDS)
def test_load_at_other_world_sizes(saved, load_world):
    others = [saved[w] for w in WORLDS if w != load_world]
    # W=2 and W=3 also load with zero-redundancy forced on (shared chunks read once, broadcast)
    outs = run_ranks("scenarios_reshard:load_all", load_world,
                     {"paths": others, "zero_redundancy": load_world in (2, 3)}, timeout=180)
    assert all("ok" in o for o in outs)


@pytest.mark.timeout(300)
def test_corrupt_shared_chunk_fails_every_rank(saved, tmp_path):
    """Zero-redundancy load: the one reader of a chunk finds it corrupt; every rank raises."""
    import json
    import shutil
    copy = tmp_path / "corrupt"
    shutil.copytree(saved[1], copy)
    body = json.loads((copy / "metadata.json").read_text())
    key = next(k for k in body["tensors"] if k.startswith("replicated"))
    array = body["tensors"][key]["array"] or body["tensors"][key]["regions"][0][3]
    from bytecheckpoint.storage.chunks import chunk_bytes_len
    meta = bcp.Checkpointer().metadata(copy).arrays[array]
    _, (pack, low, high) = next(iter(meta.locations.items()))   # format 5: a chunk inside a pack file
    chunk = copy / meta.pack_files[pack]
    raw = bytearray(chunk.read_bytes())
    raw[(low | high << 32) + chunk_bytes_len(meta) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    outs = run_ranks("scenarios_reshard:load_corrupt_shared", 2, {"path": str(copy)}, timeout=180)
    assert all("raised" in o and "crc32" in o for o in outs), outs


def test_regular_layouts_are_stored_as_grids(saved):
    """DTensor layouts (and plain tensors) saved by real ranks take the compact path; FlatShard
    and user Shard boxes keep explicit regions."""
    import json
    for w in WORLDS:
        with open(os.path.join(saved[w], "metadata.json")) as f:
            tensors = json.load(f)["tensors"]
        for key in ("replicated", "scalar", "fsdp", "fsdp_bf16", "tp", "mesh2d", "hsdp", "fp8"):
            assert "grid" in tensors[key], (w, key)
        assert tensors["fsdp"]["grid"]["mesh"] == [w] and tensors["fsdp"]["grid"]["dims"] == [0]
        for key in ("flat", "box"):
            assert "regions" in tensors[key] or w == 1, (w, key)
