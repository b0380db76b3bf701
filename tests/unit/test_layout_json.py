"""metadata.json of a repeated save from its cached, serialized layout (issue 40): the same bytes as
the general path in every form (layout_check.py compares every save of the suite; these are the
forms an ordinary save does not reach), and the general path's errors where a chunk is missing."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.format import chunk_tables, layout_json, metadata
from bytecheckpoint.pipeline import commit


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48), torch.nn.Linear(48, 8))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "empty": torch.zeros(0, 4), "scalar": torch.tensor(3.5),
            "half": torch.randn(300, 7).to(torch.bfloat16), "step": 7, "note": "x"}


def _saved(tmp_path, name, state, **kw):
    ck = bcp.Checkpointer()
    seen = []
    try:
        for i in range(3):  # the first save builds the layout, the next ones render from it
            path = str(tmp_path / f"{name}{i}")
            ck.save(path, state, **kw)
            seen.append(json.loads(open(f"{path}/metadata.json").read()))
    finally:
        ck.close()
    return seen


def test_repeated_saves_render_from_one_layout(tmp_path, monkeypatch):
    built = []
    build = layout_json.LayoutJSON.build
    monkeypatch.setattr(layout_json.LayoutJSON, "build", staticmethod(lambda *a: built.append(1) or build(*a)))
    state = _state()
    rendered = []
    render = layout_json.LayoutJSON.render_tables  # both ways in: the ranks' ChunkTables, or dicts
    monkeypatch.setattr(layout_json.LayoutJSON, "render_tables", lambda *a: rendered.append(1) or render(*a))
    mds = _saved(tmp_path, "a", state)
    assert len(built) == 1 and len(rendered) == 3  # one plan, serialized once, every save rendered from it
    assert mds[1]["tensors"].keys() == mds[0]["tensors"].keys()
    assert mds[1]["info"]["data_dir"] != mds[0]["info"]["data_dir"]
    fresh = {"half": torch.zeros(300, 7, dtype=torch.bfloat16), "step": 0}
    out = bcp.load(str(tmp_path / "a2"), fresh, strict=False)
    assert torch.equal(out["half"], state["half"]) and out["step"] == 7


def test_tables_in_their_own_file(tmp_path, monkeypatch):
    """Large tables (4096 ranks' worth) go beside the data: version 4's checksum_table entry."""
    monkeypatch.setattr(metadata, "TABLE_FILE_MIN_BYTES", 64)
    rendered = []
    render = layout_json.LayoutJSON.render_tables  # both ways in: the ranks' ChunkTables, or dicts
    monkeypatch.setattr(layout_json.LayoutJSON, "render_tables", lambda *a: rendered.append(1) or render(*a))
    mds = _saved(tmp_path, "t", _state())
    assert len(rendered) == 3  # every save from the layout (layout_check.py compares the bytes)
    assert all("checksum_table" in md for md in mds)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48), torch.nn.Linear(48, 8))
    bcp.load(str(tmp_path / "t2"), {"model": model}, strict=False)
    assert torch.equal(model[0].weight, _state()["model"][0].weight)


def test_safetensors_packs(tmp_path, monkeypatch):
    model = torch.nn.Linear(16, 4)
    rendered = []
    render = layout_json.LayoutJSON.render_tables  # both ways in: the ranks' ChunkTables, or dicts
    monkeypatch.setattr(layout_json.LayoutJSON, "render_tables", lambda *a: rendered.append(1) or render(*a))
    mds = _saved(tmp_path, "s", {"model": model, "step": 1}, safetensors=["model"])
    assert len(rendered) == 3
    assert all(md["version"] == metadata.SAFETENSORS_VERSION and md["safetensors"] for md in mds)


def test_a_marker_character_in_a_key_takes_the_general_path(tmp_path):
    state = {"odd\x01key": torch.arange(6.0), "plain": torch.ones(3)}
    _saved(tmp_path, "m", state)  # layout_check compares with the general path
    assert layout_json.LayoutJSON.build(*_plan_of(tmp_path / "m2")) is None
    out = bcp.load(str(tmp_path / "m2"), {"odd\x01key": torch.zeros(6), "plain": torch.zeros(3)})
    assert torch.equal(out["odd\x01key"], torch.arange(6.0))


def _plan_of(path):
    md = metadata.Metadata.from_json(open(f"{path}/metadata.json", "rb").read())
    return md.tensors, md.arrays, 1 << 20, md.structure, {}


def test_a_chunk_without_checksums_is_named(tmp_path):
    """A rank result missing a chunk: the render gives up and the general path names the array."""
    captured = {}
    original = commit.metadata_files

    def capture(*args):
        captured["args"] = args
        return original(*args)
    commit.metadata_files = capture
    try:
        _saved(tmp_path, "c", {"w": torch.randn(8, 8), "v": torch.randn(5)})
    finally:
        commit.metadata_files = original
    url, full, save_id, data_dir, world, structure, results, info, table_key = captured["args"]
    obj, tables, _ = results[0][0]
    assert isinstance(tables, chunk_tables.ChunkTables)  # what a rank sends: arrays by position
    sums, where = chunk_tables.as_dicts([tables], full.arrays)
    broken = [((obj, {p: {} if p.startswith("v~") else s for p, s in sums.items()}, where), None)]
    assert commit.LAYOUTS.get(full, structure) is not None
    with pytest.raises(ValueError, match="no checksum for chunk"):
        commit.metadata_files(url, full, save_id, data_dir, world, structure, broken, info, table_key)
    # the same chunk left out of the ranks' tables: the merge by position gives up, the general path names it
    v = next(p for p in full.arrays if p.startswith("v~"))
    keep = tables.positions != chunk_tables.chunk_bases(full.arrays)[v]
    ends = np.cumsum(tables.nblocks)
    blocks = np.concatenate([np.arange(e - n, e) for e, n, k in zip(ends, tables.nblocks, keep) if k])
    short = chunk_tables.ChunkTables(tables.positions[keep], tables.nblocks[keep], tables.crcs[blocks],
                                     tables.pack_keys, tables.packs[keep], tables.offsets[keep])
    with pytest.raises(ValueError, match="no checksum for chunk"):
        commit.metadata_files(url, full, save_id, data_dir, world, structure, [((obj, short, None), None)], info,
                              table_key)


def test_a_layout_goes_with_its_plan(tmp_path):
    import gc
    ck = bcp.Checkpointer()
    ck.save(str(tmp_path / "g"), {"w": torch.randn(8, 8)})
    assert any(e[2] is not None for e in commit.LAYOUTS._entries)
    ck.close()
    del ck
    gc.collect()
    assert not [e for e in commit.LAYOUTS._entries if e[0]() is None or e[1]() is None]
