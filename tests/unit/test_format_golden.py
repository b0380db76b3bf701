"""Pins the on-disk format v5 and v6 (docs/format.md). A change here is a format change: bump
FORMAT_VERSION and document it instead of editing the expectations. A save without safetensors
packs is still written as format 5, byte for byte; format 6 adds them (`safetensors=`). Format 1
to 5 checkpoints (written by the code of those versions, kept under data/format_v1 .. format_v5)
must still load and verify."""
import base64
import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import pytest
import tensorstore as ts
import torch

import bytecheckpoint as bcp


@pytest.fixture(autouse=True)
def _fixtures_stay_as_committed(monkeypatch):
    """The checkpoints under data/ belong to the repository: loading them writes no load record
    beside them (record_stats="save": records in memory only; bcp.load's engine made anew)."""
    import bytecheckpoint.checkpointer as engine
    monkeypatch.setenv("BCP_RECORD_STATS", "save")
    monkeypatch.setattr(engine, "_DEFAULT", None)


def _save(tmp_path):
    state = {"model": {"w": torch.arange(12, dtype=torch.float32).view(3, 4),
                       "b": torch.arange(3, dtype=torch.bfloat16)},
             "step": 7}
    bcp.save(tmp_path / "ck", state)
    return tmp_path / "ck"


def _at(arr):
    """(pack index, byte offset) of each chunk of an array entry, from its packed `at` table."""
    raw = base64.b64decode(arr["at"])
    vals = struct.unpack(f"<{len(raw) // 4}I", raw)
    return [(vals[i], vals[i + 1] | (vals[i + 2] << 32)) for i in range(0, len(vals), 3)]


def test_layout_and_metadata(tmp_path):
    root = _save(tmp_path)
    body = json.loads((root / "metadata.json").read_text())
    assert sorted(body) == ["arrays", "checksum", "format", "info", "meshes", "objects", "packs", "save_id",
                            "structure", "tensors", "version", "world_size"]
    assert body["format"] == "bytecheckpoint" and body["version"] == 5 and body["world_size"] == 1
    data_dir = body["info"]["data_dir"]
    assert data_dir == f"data-{body['save_id']}" and (root / data_dir).is_dir()
    # format 5: every chunk of the rank in one pack file (a rank with more bytes writes up to 4)
    assert body["packs"] == [f"{data_dir}/pack/0-0.bin"]
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    # + this rank's stats record (informational, never part of the commit: docs/format.md "stats/")
    assert files == sorted(["metadata.json", f"{data_dir}/objects/rank_0.json", f"{data_dir}/pack/0-0.bin",
                            f"{data_dir}/stats/save/rank_0.json"])
    w = body["tensors"]["model/w"]
    name = f"model.w~{zlib.crc32(b'model/w'):08x}"
    # a plain tensor is the trivial regular layout: a 1-D mesh of its holders, all replicating
    assert w == {"dtype": "float32", "shape": [3, 4], "layout": "replicated", "holders": 1,
                 "array": f"{data_dir}/{name}", "grid": {"mesh": [1], "dims": [-1], "ranks": 0, "split": 1048576}}
    assert body["meshes"] == [[0]]
    arr = body["arrays"][f"{data_dir}/{name}"]
    ((pack, offset),) = _at(arr)
    assert pack == 0 and offset % 64 == 0   # chunks start at 64-byte aligned offsets
    raw = (root / body["packs"][pack]).read_bytes()[offset:offset + 48]
    assert raw == torch.arange(12, dtype=torch.float32).numpy().tobytes()  # C order, little-endian
    # per-block crc32 (1 MiB blocks; this chunk is one block), every chunk's blocks in row-major
    # chunk order in one base64 string of little-endian uint32s; `at`: 3 uint32 per chunk
    assert arr == {"path": f"{data_dir}/{name}", "shape": [3, 4], "chunks": [3, 4], "dtype": "float32",
                   "block_bytes": 1 << 20, "crc32": base64.b64encode(struct.pack("<I", zlib.crc32(raw))).decode(),
                   "at": base64.b64encode(struct.pack("<3I", 0, offset, 0)).decode()}
    assert body["structure"] == {"dict": [["model", {"dict": [["w", {"tensor": "model/w"}],
                                                              ["b", {"tensor": "model/b"}]]}],
                                          ["step", {"object": "step"}]]}
    assert body["objects"][0]["path"] == f"{data_dir}/objects/rank_0.json"
    assert json.loads((root / body["objects"][0]["path"]).read_text()) == {"step": 7}


def test_pack_files_read_without_this_library(tmp_path):
    """docs/format.md is enough: metadata.json + the pack files give every tensor with json,
    base64, struct and numpy alone (what another implementation would do)."""
    import numpy as np
    root = _save(tmp_path)
    body = json.loads((root / "metadata.json").read_text())
    for key, want in (("model/w", torch.arange(12.0).view(3, 4)), ("model/b", torch.arange(3.0))):
        t = body["tensors"][key]
        arr = body["arrays"][t["array"]]
        ((pack, offset),) = _at(arr)
        n = 1
        for d in arr["shape"]:
            n *= d
        if t["dtype"] == "bfloat16":   # numpy has no bfloat16: widen the upper 16 bits of a float32
            bits = np.frombuffer((root / body["packs"][pack]).read_bytes(), dtype="<u2", count=n, offset=offset)
            got = (bits.astype("<u4") << 16).view("<f4")
        else:
            got = np.frombuffer((root / body["packs"][pack]).read_bytes(), dtype="<f4", count=n, offset=offset)
        assert got.reshape(arr["shape"]).tolist() == want.tolist()


V3 = Path(__file__).parent / "data" / "format_v3"
V4 = Path(__file__).parent / "data" / "format_v4"


@pytest.mark.parametrize("fixture,version", [(V3, 3), (V4, 4)])
def test_format_v3_v4_checkpoints_still_load_verify_and_open_with_tensorstore(fixture, version):
    """Written by the format-3/4 code (one zarr v3 array per tensor, one file per chunk): they load,
    verify, read a part as the blocks that hold it, and their arrays still open with tensorstore."""
    body = json.loads((fixture / "metadata.json").read_text())
    assert body["version"] == version and ("checksum_table" in body) == (version == 4)
    state = bcp.load(fixture, V1_STATE())
    assert state["step"] == 7 and torch.equal(state["model"]["w"], torch.arange(12.0).view(3, 4))
    assert torch.equal(state["model"]["b"], torch.arange(3, dtype=torch.bfloat16))
    assert torch.equal(state["big"], torch.arange(2048.0).view(64, 32))
    assert bcp.verify(fixture).ok and bcp.inspect(fixture).format_version == version
    part = bcp.Shard(torch.zeros(8, 32), (64, 32), (16, 0))
    bcp.Checkpointer(record_stats="save").load(fixture, {"big": part}, strict=False)
    assert torch.equal(part.local, torch.arange(2048.0).view(64, 32)[16:24])
    for key, t in body["tensors"].items():
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(fixture / t["array"]) + "/"}}
                      ).result()
        got = arr.read().result()
        if key == "model/w":
            assert got.tolist() == torch.arange(12.0).view(3, 4).tolist()
        elif key == "model/b":
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
    ck = bcp.Checkpointer(record_stats="save")
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


def test_grid_entry_of_a_sharded_layout():
    """The compact form of a regular layout: 2 replicas x 2 shards (HSDP), big enough that each
    shard is cut into 2 row blocks whose writers are recorded as choices."""
    from bytecheckpoint.planning.manifests import TensorManifest
    from bytecheckpoint.format.metadata import ArrayMeta, Metadata
    from bytecheckpoint.planning.planner import plan_save
    shape = (1024, 1024)   # float32: 2 MiB per shard -> 2 row blocks of 256 rows
    ms = []
    for rank in range(4):
        rep, shard = divmod(rank, 2)
        box = ((512 * shard, 0), (512, 1024))
        ms.append((TensorManifest("w", "float32", shape, "sharded", (box,), ((2, 2), (-1, 0), (rep, shard))),))
    plan = plan_save(ms)
    # 256 x 1024 float32 chunks: 1 MiB, one checksum block each
    arrays = {p: ArrayMeta(a.path, a.shape, a.chunks, a.dtype, {f"{i}.0": (i,) for i in range(4)}, 1 << 20)
              for p, a in plan.arrays.items()}
    body = json.loads(Metadata(3, "golden", 4, plan.tensors, arrays, (), {"dict": []}, {}).to_json())
    assert body["meshes"] == [[0, 1, 2, 3]]
    w = body["tensors"]["w"]
    assert w["grid"] == {"mesh": [2, 2], "dims": [-1, 0], "ranks": 0, "split": 1048576, "choice_bytes": 1,
                         "choices": base64.b64encode(bytes([0, 1, 0, 1])).decode()}
    assert body["arrays"][w["array"]]["chunks"] == [256, 1024]
    assert base64.b64decode(body["arrays"][w["array"]]["crc32"]) == struct.pack("<4I", 0, 1, 2, 3)
    assert [(r.offsets, r.writer) for r in plan.tensors["w"].regions] == [
        ((0, 0), 0), ((256, 0), 2), ((512, 0), 1), ((768, 0), 3)]

V2 = Path(__file__).parent / "data" / "format_v2"


def test_format_v2_checkpoint_still_loads_and_verifies():
    """Written by the format-2 code (per-block checksums as one base64 string per chunk, regions
    lists): loads, verifies, and a part of a chunk is still read as the blocks that hold it."""
    body = json.loads((V2 / "metadata.json").read_text())
    assert body["version"] == 2 and "meshes" not in body
    assert all("regions" in t for t in body["tensors"].values())
    assert all(a["block_bytes"] == 1 << 20 and isinstance(v, str) for a in body["arrays"].values()
               for v in a["checksums"].values())
    state = bcp.load(V2, V1_STATE())
    assert state["step"] == 7 and torch.equal(state["model"]["w"], torch.arange(12.0).view(3, 4))
    assert torch.equal(state["model"]["b"], torch.arange(3, dtype=torch.bfloat16))
    assert torch.equal(state["big"], torch.arange(2048.0).view(64, 32))
    assert bcp.verify(V2).ok and bcp.inspect(V2).format_version == 2
    part = bcp.Shard(torch.zeros(8, 32), (64, 32), (16, 0))
    bcp.Checkpointer(record_stats="save").load(V2, {"big": part}, strict=False)
    assert torch.equal(part.local, torch.arange(2048.0).view(64, 32)[16:24])


def test_metadata_round_trips_through_every_version(tmp_path):
    """The same checkpoint written as version 3, 2 and 1 by Metadata.to_json parses back to the
    same tensors, regions and checksums (grids spelled out as regions before version 3; version 1
    holds one crc32 per chunk, so it gets whole-chunk values)."""
    import dataclasses
    from bytecheckpoint.format.metadata import Metadata
    root = _save(tmp_path)
    md = Metadata.from_json((root / "metadata.json").read_bytes())
    assert md.version == 5 and md.tensors["model/w"].grid is not None
    again = Metadata.from_json(md.to_json())
    for p, a in md.arrays.items():
        assert dict(again.arrays[p].locations) == dict(a.locations) and again.arrays[p].pack_files == md.packs
    md = dataclasses.replace(md, version=3, packs=(), arrays={
        p: dataclasses.replace(a, locations={}, pack_files=()) for p, a in md.arrays.items()})
    v1_arrays = {p: dataclasses.replace(a, checksums={k: v[0] for k, v in a.checksums.items()}, block_bytes=0)
                 for p, a in md.arrays.items()}
    for version, source in ((2, md), (1, dataclasses.replace(md, arrays=v1_arrays))):
        old = Metadata.from_json(dataclasses.replace(source, version=version).to_json())
        assert old.version == version and all(t.grid is None for t in old.tensors.values())
        for k, t in md.tensors.items():
            assert list(old.tensors[k].regions) == list(t.regions)
        for p, a in source.arrays.items():
            assert dict(old.arrays[p].checksums) == dict(a.checksums) and old.arrays[p].block_bytes == a.block_bytes


def test_version_4_keeps_large_checksum_tables_in_a_checked_file_beside_the_data(tmp_path, monkeypatch):
    """Tables over TABLE_FILE_MIN_BYTES go to <data dir>/checksums.bin (little-endian uint32, named
    in metadata.json with its length and crc32); the checkpoint loads and verifies as before, and
    a missing or damaged table file fails the load instead of skipping the checks."""
    from bytecheckpoint.format import metadata as md_module
    from bytecheckpoint.common.errors import MetadataError
    monkeypatch.setattr(md_module, "TABLE_FILE_MIN_BYTES", 0)
    state = {"w": torch.arange(3000.0).view(30, 100), "b": torch.ones(7), "step": 3}
    bcp.save(str(tmp_path / "c"), state)
    body = json.loads((tmp_path / "c" / "metadata.json").read_text())
    entry = body["checksum_table"]
    table = tmp_path / "c" / entry["path"]
    assert body["version"] == 5 and entry["path"] == f"{body['info']['data_dir']}/checksums.bin"
    assert all("crc32" not in a and "at" not in a and "crc32_at" in a and "at_at" in a for a in body["arrays"].values())
    assert table.stat().st_size == entry["nbytes"] and zlib.crc32(table.read_bytes()) == entry["crc32"]
    out = {"w": torch.zeros(30, 100), "b": torch.zeros(7), "step": 0}
    bcp.load(str(tmp_path / "c"), out)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"]) and out["step"] == 3
    assert bcp.verify(str(tmp_path / "c")).ok and bcp.inspect(str(tmp_path / "c")).format_version == 5

    chunk = next(p for p in (tmp_path / "c").rglob("*.bin") if "/pack/" in str(p))
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert not bcp.verify(str(tmp_path / "c")).ok  # the chunk checksums come from the table file
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))

    raw = bytearray(table.read_bytes())
    raw[0] ^= 0x01
    table.write_bytes(bytes(raw))
    with pytest.raises(MetadataError, match="checksums.bin.*damaged"):
        bcp.Checkpointer().load(str(tmp_path / "c"), out)  # a fresh engine: nothing parsed before
    table.unlink()
    with pytest.raises(MetadataError, match="checksums.bin.*missing"):
        bcp.Checkpointer().load(str(tmp_path / "c"), out)


V5 = Path(__file__).parent / "data" / "format_v5"


def test_format_v5_checkpoint_still_loads_and_verifies():
    """Written by the format-5 code (a torch.compile'd model, names with '_orig_mod.', its AdamW,
    a plain value): loads and verifies (tests/unit/test_compile_names.py loads it into models)."""
    body = json.loads((V5 / "metadata.json").read_text())
    assert body["version"] == 5 and "safetensors" not in body and all(p.endswith(".bin") for p in body["packs"])
    assert bcp.verify(V5).ok and bcp.inspect(V5).format_version == 5
    full = bcp.Checkpointer(record_stats="save").load_full(V5)  # a load records nothing inside the fixture
    assert full["step"] == 7 and full["model"]["_orig_mod.0.weight"].shape == (3, 4)


def test_version_6_safetensors_packs_are_save_file_bytes_and_read_without_this_library(tmp_path):
    """A key path saved with safetensors=[...]: its tensors are one pack per writing rank named
    pack/<rank>-<k>.safetensors (k after the rank's .bin packs), byte-identical to
    safetensors.torch.save_file(tensors, metadata={"format": "pt"}); metadata.json names it under
    `safetensors` and every chunk's `at` points into it, past the header. Everything else is format 5."""
    import numpy as np
    from safetensors.torch import save_file
    from bytecheckpoint.format.metadata import Metadata
    model = {"w": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.arange(3, dtype=torch.bfloat16)}
    bcp.save(tmp_path / "ck", {"model": model, "opt": {"m": torch.ones(2)}, "step": 7}, safetensors=["model"])
    root = tmp_path / "ck"
    body = json.loads((root / "metadata.json").read_text())
    data_dir = body["info"]["data_dir"]
    assert body["version"] == 6 and body["packs"] == [f"{data_dir}/pack/0-0.bin", f"{data_dir}/pack/0-1.safetensors"]
    assert body["safetensors"] == {"model": [1]}
    save_file(model, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    raw = (root / body["packs"][1]).read_bytes()
    assert raw == (tmp_path / "ref.safetensors").read_bytes()
    # without this library: the safetensors header gives each tensor's bytes, the metadata's `at` agrees
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"] == {"format": "pt"} and [k for k in header if k != "__metadata__"] == ["w", "b"]
    for name, want in model.items():
        arr = body["arrays"][body["tensors"][f"model/{name}"]["array"]]
        ((pack, offset),) = _at(arr)
        start, stop = header[name]["data_offsets"]
        assert pack == 1 and offset == 8 + n + start
        dtype = "<f4" if name == "w" else "<u2"
        got = np.frombuffer(raw, dtype=dtype, count=(stop - start) // np.dtype(dtype).itemsize, offset=8 + n + start)
        assert got.tobytes() == want.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert _at(body["arrays"][body["tensors"]["opt/m"]["array"]])[0][0] == 0  # everything else: the .bin pack
    md = Metadata.from_json((root / "metadata.json").read_bytes())
    assert md.version == 6 and md.safetensors == {"model": (1,)} and Metadata.from_json(md.to_json()) == md
    bad = dict(body, safetensors={"model": [0]})  # the .bin pack is not a safetensors file
    bad.pop("checksum")
    from bytecheckpoint.common.errors import MetadataError
    with pytest.raises(MetadataError, match="not a .safetensors file"):
        Metadata.from_json(json.dumps(bad).encode())
