"""Damaged stored bytes: a flipped byte anywhere in tensor data (every chunk file, random offsets,
first and last byte) is detected by load, load_full and verify, through both local I/O paths;
also truncated, extended and missing chunks, damaged value files and damaged metadata. And
untrusted content: pickled values are never unpickled unless allowed."""
from __future__ import annotations

import json
import os
import pickle
import random
import zlib

import pytest
import torch

import bytecheckpoint as bcp

import fault_scenarios as fs
from harness import run


def _state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 48, generator=g), "bf": torch.randn(33, generator=g).to(torch.bfloat16),
            "i": torch.arange(100, dtype=torch.int64), "mask": torch.rand(7, 5, generator=g) > 0.5,
            "scalar": torch.tensor(3.5), "fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
            "opt": {"m": torch.randn(64, 48, generator=g)}, "step": 11}


def _template():
    s = _state()
    return {k: ({kk: torch.zeros_like(vv) for kk, vv in v.items()} if isinstance(v, dict) else
                torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in s.items()}


def _chunk_files(root):
    """The pack files (format 5)."""
    out = []
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if "/pack/" in os.path.relpath(p, root):
                out.append(p)
    return sorted(out)


def _chunk_spans(root, array_filter=""):
    """(pack file, first byte, length) of every stored chunk, from the metadata (the bytes between
    chunks are alignment padding that no reader uses)."""
    from bytecheckpoint.storage.chunks import chunk_bytes_len
    md = bcp.Checkpointer().metadata(root)
    spans = []
    for meta in md.arrays.values():
        if array_filter not in meta.path:
            continue
        for _, (p, low, high) in meta.locations.items():
            spans.append((os.path.join(root, meta.pack_files[p]), low | (high << 32), chunk_bytes_len(meta)))
    return sorted(spans)


def _flip(path, offset, bit=0x01):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ bit]))


def _check_detected(path, what):
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load(path, _template())
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load_full(path)
    report = bcp.verify(path)
    assert not report.ok, f"{what}: verify passed"
    assert any("checksum" in p or "damaged" in p or "missing" in p or "size" in p for p in report.problems), \
        report.problems


@pytest.fixture(params=["posix", "tensorstore"])
def io(request, monkeypatch):
    """bcp.* calls go through a default Checkpointer using this local I/O path."""
    import bytecheckpoint.checkpointer as engine
    ckpt = bcp.Checkpointer(local_io=request.param)
    monkeypatch.setattr(engine, "_DEFAULT", ckpt)
    yield request.param
    ckpt.close()


def _flip_sweep(tmp_path, picks_per_file, seed):
    path = str(tmp_path / "ck")
    bcp.save(path, _state())
    spans = _chunk_spans(path)
    assert len(spans) >= 7
    rng = random.Random(seed)
    n = 0
    for f, start, size in spans:
        offsets = {start, start + size - 1} | {start + rng.randrange(size) for _ in range(picks_per_file)}
        for off in sorted(offsets):
            bit = 1 << rng.randrange(8)
            _flip(f, off, bit)
            _check_detected(path, f"{f}@{off}")
            _flip(f, off, bit)  # restore
            n += 1
    assert bcp.verify(path).ok
    out = _template()
    bcp.load(path, out)
    assert torch.equal(out["w"], _state()["w"])
    return n


@pytest.mark.timeout(200)
def test_flipped_byte_detected(tmp_path, io):
    assert _flip_sweep(tmp_path, picks_per_file=2, seed=1) >= 20


@pytest.mark.faults
@pytest.mark.timeout(1800)
def test_flipped_byte_detected_everywhere_long(tmp_path, io):
    _flip_sweep(tmp_path, picks_per_file=40, seed=2)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("damage", ["truncate", "extend", "delete", "empty"])
def test_damaged_chunk_file(tmp_path, io, damage):
    path = str(tmp_path / "ck")
    bcp.save(path, _state())
    f = _chunk_files(path)[-1]
    if damage == "extend":  # bytes after the last chunk of a pack are read by nobody: still whole
        with open(f, "ab") as fh:
            fh.write(b"\0")
        out = _template()
        bcp.load(path, out)
        assert torch.equal(out["w"], _state()["w"]) and bcp.verify(path).ok
        return
    if damage == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) - 1)
    elif damage == "delete":
        os.remove(f)
    else:
        open(f, "wb").close()
    _check_detected(path, damage)


@pytest.mark.timeout(200)
def test_flipped_byte_detected_on_every_rank_of_a_2_rank_load(tmp_path):
    """Zero-redundancy load: one rank reads a shared chunk for both; the damage is reported on both."""
    path = str(tmp_path / "ck")
    fs.save_version(path, 5)
    f, start, size = (_chunk_spans(path, "replicated") or _chunk_spans(path))[0]
    _flip(f, start + size // 2)
    outs = run("fault_scenarios:expect_failure", 2, {"op": "load", "path": path, "version": 5,
                                                      "error": "CheckpointError", "then_save": False})
    assert all("RAISED" in o for o in outs)
    assert any("CorruptCheckpointError" in o or "checksum" in o for o in outs)
    assert not bcp.verify(path).ok


@pytest.mark.timeout(100)
def test_damaged_value_file_and_metadata(tmp_path):
    path = str(tmp_path / "ck")
    bcp.save(path, _state())
    obj = next(os.path.join(d, f) for d, _, fs_ in os.walk(path) for f in fs_ if "objects" in d)
    _flip(obj, 2)
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load(path, _template())
    assert not bcp.verify(path).ok
    _flip(obj, 2)
    meta = os.path.join(path, "metadata.json")
    raw = open(meta, "rb").read()
    i = raw.index(b'"save_id"') + 14   # inside the save id string: still valid JSON, wrong checksum
    open(meta, "wb").write(raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:])
    with pytest.raises(bcp.MetadataError):
        bcp.load(path, _template())
    assert not bcp.verify(path).ok
    assert not bcp.is_checkpoint(path)


# ---------------------------------------------------------------------- untrusted content
class _Evil:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.timeout(100)
def test_pickled_values_need_an_explicit_opt_in(tmp_path):
    """A value file that carries a pickle (here one that would create a file when unpickled) is
    refused by load and load_full unless allow_pickle=True; plain values use a safe encoding."""
    path = str(tmp_path / "ck")
    bcp.save(path, {"w": torch.ones(2), "step": 3, "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}})
    # plain values are stored as JSON, not pickles
    obj = next(os.path.join(d, f) for d, _, fs_ in os.walk(path) for f in fs_ if "objects" in d)
    assert b"__pickle__" not in open(obj, "rb").read()
    # an attacker swaps in a pickled payload (and fixes every checksum, as they could)
    marker = tmp_path / "pwned"
    payload = {"step": {"__pickle__": __import__("base64").b64encode(pickle.dumps(_Evil(str(marker)))).decode(),
                        "type": "int"}, "cfg": {"__dict__": []}}
    blob = json.dumps(payload).encode()
    open(obj, "wb").write(blob)
    meta_path = os.path.join(path, "metadata.json")
    body = json.loads(open(meta_path, "rb").read())
    body.pop("checksum")
    body["objects"][0].update(nbytes=len(blob), crc32=zlib.crc32(blob))
    body["checksum"] = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    open(meta_path, "w").write(json.dumps(body))
    with pytest.raises(bcp.CheckpointError, match="allow_pickle"):
        bcp.load(path, {"w": torch.zeros(2), "step": 0, "cfg": {}})
    with pytest.raises(bcp.CheckpointError, match="allow_pickle"):
        bcp.load_full(path)
    assert bcp.verify(path).ok          # verify checks bytes, never decodes values
    assert not marker.exists()
    bcp.load_full(path, allow_pickle=True)  # explicit trust: now it runs
    assert marker.exists()


@pytest.mark.timeout(100)
def test_unpicklable_custom_object_is_refused_by_default(tmp_path):
    path = str(tmp_path / "ck")

    class Cfg:  # not JSON-encodable: stored as a pickle
        pass
    globals()["Cfg"] = Cfg
    Cfg.__qualname__ = "Cfg"
    bcp.save(path, {"cfg": Cfg(), "w": torch.ones(1)})
    with pytest.raises(bcp.CheckpointError, match="allow_pickle"):
        bcp.load_full(path)
    assert isinstance(bcp.load_full(path, allow_pickle=True)["cfg"], Cfg)
