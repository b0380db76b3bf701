"""How many pack files a rank writes (storage/packs.py): on local files 1 to 4 by its bytes, then more
once a pack would pass 1 GiB (FILES); on object stores smaller ones, 16 at most until they would pass
256 MiB (OBJECTS: one PUT each, in parallel); a checkpoint with more than 4 packs per rank loads."""
import json

import torch

import bytecheckpoint as bcp
from bytecheckpoint.storage import packs

MiB, GiB = 1 << 20, 1 << 30


def _pack_bytes(sizes, sizing=packs.FILES):
    n, slots = packs.layout(sizes, sizing)
    ends = [0] * n
    for size, slot in zip(sizes, slots):
        ends[slot.pack] = max(ends[slot.pack], slot.offset + size)
    return ends


def test_small_ranks_keep_one_to_four_packs():
    assert len(_pack_bytes([MiB] * 10)) == 1
    assert len(_pack_bytes([16 * MiB] * 12)) == 3
    assert len(_pack_bytes([16 * MiB] * 64)) == 4     # 1 GiB: four packs of 256 MiB
    assert len(_pack_bytes([GiB] * 4)) == 4           # 4 GiB: four packs of 1 GiB


def test_a_large_rank_writes_packs_of_at_most_a_gib():
    ends = _pack_bytes([16 * MiB] * 640)              # 10 GiB
    assert len(ends) == 10
    assert max(ends) <= packs.FILES.max_bytes
    ends = _pack_bytes([40 * MiB + 3] * 300 + [MiB] * 7)   # ~11.7 GiB, uneven chunks
    assert len(ends) == 12 and max(ends) <= packs.FILES.max_bytes + 40 * MiB


def test_a_chunk_larger_than_the_cap_is_one_pack_of_its_own():
    ends = _pack_bytes([3 * GiB, MiB])
    assert len(ends) == 2 and sorted(ends)[-1] == 3 * GiB


def test_object_stores_write_smaller_packs_in_parallel():
    o = packs.OBJECTS
    assert packs.sizing_for(type("S", (), {"scheme": "s3"})()) is o
    assert packs.sizing_for(type("S", (), {"scheme": "file"})()) is packs.FILES
    assert packs.sizing_for(type("S", (), {"scheme": "memory"})()) is packs.FILES
    assert len(_pack_bytes([MiB] * 10, o)) == 1
    assert len(_pack_bytes([4 * MiB] * 50, o)) == 13            # 200 MiB: 13 packs of ~16 MiB
    ends = _pack_bytes([16 * MiB] * 640, o)                      # 10 GiB: 40 packs of 256 MiB
    assert len(ends) == 40 and max(ends) <= o.max_bytes


def test_more_than_four_packs_load_and_verify(tmp_path, monkeypatch):
    monkeypatch.setattr(packs, "FILES", packs.Sizing(64 * MiB, 4, 1 * MiB))
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(256, 256) for i in range(24)}   # 24 x 256 KiB = 6 MiB
    path = tmp_path / "ckpt"
    bcp.save(path, {"model": state})
    body = json.loads((path / "metadata.json").read_text())
    assert len(body["packs"]) >= 5, body["packs"]
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(path, {"model": loaded})
    for k in state:
        assert torch.equal(loaded[k], state[k]), k
    report = bcp.verify(path)
    assert report.ok, report.problems
