"""Pins the on-disk format v1 (docs/format.md). A change here is a format change: bump
FORMAT_VERSION and document it instead of editing the expectations."""
import json
import os
import zlib

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
    assert body["format"] == "bytecheckpoint" and body["version"] == 1 and body["world_size"] == 1
    data_dir = body["info"]["data_dir"]
    assert data_dir == f"data-{body['save_id']}" and (root / data_dir).is_dir()
    w = body["tensors"]["model/w"]
    name = f"model.w~{zlib.crc32(b'model/w'):08x}"
    assert w == {"dtype": "float32", "shape": [3, 4], "layout": "replicated", "holders": 1,
                 "array": f"{data_dir}/{name}", "regions": [[[0, 0], [3, 4], 0]]}
    raw = (root / data_dir / name / "c" / "0" / "0").read_bytes()
    assert raw == torch.arange(12, dtype=torch.float32).numpy().tobytes()  # zarr "bytes" codec, little-endian
    arr = body["arrays"][f"{data_dir}/{name}"]
    assert arr == {"path": f"{data_dir}/{name}", "shape": [3, 4], "chunks": [3, 4], "dtype": "float32",
                   "checksums": {"0.0": zlib.crc32(raw)}}
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
