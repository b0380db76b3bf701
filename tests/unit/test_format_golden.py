"""Pins the on-disk format v2 (docs/format.md). A change here is a format change: bump
FORMAT_VERSION and document it instead of editing the expectations. Format 1 checkpoints (one
written by the v1 code is kept under data/format_v1) must still load and verify."""
import base64
import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import tensorstore as ts
import torch

import bytecheckpoint as bcp


def _save(tmp_path):
    state = {"model": {"w": torch.arange(12, dtype=torch.float32).view(3, 4),
                       "b": torch.arange(3, dtype=torch.bfloat16)},
             "step": 7}
    bcp.save(tmp_path / "ck", state)
    return tmp_path / "ck"


def test_layout_and_metadata(tmp_path):
    root = _save(tmp_path)
    body = json.loads((root / "metadata.json").read_text())
    assert sorted(body) == ["arrays", "checksum", "format", "info", "objects", "save_id", "structure", "tensors",
                            "version", "world_size"]
    assert body["format"] == "bytecheckpoint" and body["version"] == 2 and body["world_size"] == 1
    data_dir = body["info"]["data_dir"]
    assert data_dir == f"data-{body['save_id']}" and (root / data_dir).is_dir()
    w = body["tensors"]["model/w"]
    name = f"model.w~{zlib.crc32(b'model/w'):08x}"
    assert w == {"dtype": "float32", "shape": [3, 4], "layout": "replicated", "holders": 1,
                 "array": f"{data_dir}/{name}", "regions": [[[0, 0], [3, 4], 0]]}
    raw = (root / data_dir / name / "c" / "0" / "0").read_bytes()
    assert raw == torch.arange(12, dtype=torch.float32).numpy().tobytes()  # zarr "bytes" codec, little-endian
    arr = body["arrays"][f"{data_dir}/{name}"]
    # per-block crc32 (1 MiB blocks; this chunk is one block): base64 of little-endian uint32s
    assert arr == {"path": f"{data_dir}/{name}", "shape": [3, 4], "chunks": [3, 4], "dtype": "float32",
                   "block_bytes": 1 << 20,
                   "checksums": {"0.0": base64.b64encode(struct.pack("<I", zlib.crc32(raw))).decode()}}
    assert json.loads((root / data_dir / name / "zarr.json").read_text()) == {
        "zarr_format": 3, "node_type": "array", "shape": [3, 4], "data_type": "float32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [3, 4]}},
        "chunk_key_encoding": {"name": "default"}, "fill_value": 0.0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]}
    assert body["structure"] == {"dict": [["model", {"dict": [["w", {"tensor": "model/w"}],
                                                              ["b", {"tensor": "model/b"}]]}],
                                          ["step", {"object": "step"}]]}
    assert body["objects"][0]["path"] == f"{data_dir}/objects/rank_0.json"
    assert json.loads((root / body["objects"][0]["path"]).read_text()) == {"step": 7}


def test_arrays_open_with_tensorstore_alone(tmp_path):
    root = _save(tmp_path)
    body = json.loads((root / "metadata.json").read_text())
    for key, t in body["tensors"].items():
        path = t["array"]
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / path) + "/"}}).result()
        got = arr.read().result()
        if key == "model/w":
            assert got.tolist() == torch.arange(12.0).view(3, 4).tolist()
        else:
            assert str(arr.dtype.name) == "bfloat16" and got.astype("float32").tolist() == [0.0, 1.0, 2.0]


def test_metadata_checksum_detects_edits(tmp_path):
    root = _save(tmp_path)
    p = root / "metadata.json"
    p.write_text(p.read_text().replace('"world_size":1', '"world_size":2'))
    try:
        bcp.load(root, {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 0})
    except bcp.MetadataError as exc:
        assert "checksum" in str(exc)
    else:
        raise AssertionError("edited metadata was accepted")


V1 = Path(__file__).parent / "data" / "format_v1"
V1_STATE = lambda: {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.bfloat16)},  # noqa: E731
                    "big": torch.zeros(64, 32), "step": 0}


def test_format_v1_checkpoint_still_loads_and_verifies(tmp_path):
    body = json.loads((V1 / "metadata.json").read_text())
    assert body["version"] == 1 and all(isinstance(v, int) for a in body["arrays"].values()
                                         for v in a["checksums"].values())
    state = bcp.load(V1, V1_STATE())
    assert state["step"] == 7 and torch.equal(state["model"]["w"], torch.arange(12.0).view(3, 4))
    assert torch.equal(state["model"]["b"], torch.arange(3, dtype=torch.bfloat16))
    assert torch.equal(state["big"], torch.arange(2048.0).view(64, 32))
    assert bcp.verify(V1).ok
    # a part of a v1 chunk is read as the whole chunk (one crc32 per chunk) and still checked
    part = bcp.Shard(torch.zeros(8, 32), (64, 32), (16, 0))
    ck = bcp.Checkpointer()
    ck.load(V1, {"big": part}, strict=False)
    assert torch.equal(part.local, torch.arange(2048.0).view(64, 32)[16:24])
    assert ck.last_load_stats.bytes_read == 64 * 32 * 4
    copy = tmp_path / "v1"
    shutil.copytree(V1, copy)
    chunk = next((copy / body["info"]["data_dir"]).glob("big~*/c/0/0"))
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 1  # outside the rows loaded above: still caught, the whole chunk is checked
    chunk.write_bytes(bytes(raw))
    try:
        bcp.Checkpointer().load(copy, {"big": bcp.Shard(torch.zeros(8, 32), (64, 32), (16, 0))}, strict=False)
    except bcp.CorruptCheckpointError as exc:
        assert "big" in str(exc)
    else:
        raise AssertionError("a flipped byte in a v1 chunk was not caught")
