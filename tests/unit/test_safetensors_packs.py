"""Format 6, safetensors packs: `save(..., safetensors=[key path])` writes the tensors under that key
path as a pack that *is* the file `safetensors.torch.save_file` writes (header first, whole tensors
back to back in its order, row chunks that tile each tensor); `link_views` shows it under the Hugging
Face names by hard link; a key path that cannot be one stays in ordinary packs and the checkpoint is
format 5; the planner keeps such tensors whole on one writer, spread over the holders."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import bytecheckpoint as bcp
from bytecheckpoint.planning.manifests import TensorManifest
from bytecheckpoint.planning.planner import CHUNK_TARGET_BYTES, plan_save, rank_part
from bytecheckpoint.tools.safetensors import link_views


def _model():
    torch.manual_seed(0)
    return {"emb": torch.randn(6006, 1024),                 # 23.5 MiB: two row chunks of 3003 rows
            "odd": torch.randn(7, 3), "half": torch.randn(5, 4).bfloat16(), "ids": torch.arange(10),
            "mask": torch.tensor([True, False]), "scale": torch.tensor(3.0), "none": torch.zeros(0, 4)}


def _save(path, state, groups=("model",), **kw):
    seen = {}

    def hook(md):
        seen["md"] = md
        if kw.pop("link", True):
            seen["names"] = link_views(str(path), md, groups[0], str(path.parent / "hf"))
    bcp.save(path, state, safetensors=list(groups), before_commit=hook, **kw)
    return seen


def test_pack_is_the_file_save_file_writes_and_links_into_a_folder(tmp_path):
    model = _model()
    seen = _save(tmp_path / "ck", {"model": model, "optimizer": {"m": torch.randn(64, 64)}, "step": 3})
    md = bcp.Checkpointer().metadata(tmp_path / "ck")
    assert md.version == 6 and list(md.safetensors) == ["model"]
    (index,) = md.safetensors["model"]
    pack = tmp_path / "ck" / md.packs[index]
    assert pack.name == "0-1.safetensors", md.packs  # after the rank's ordinary pack 0-0.bin
    save_file(model, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert pack.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    emb = md.arrays[md.tensors["model/emb"].regions[0].array]
    assert emb.chunks[0] == 3003 and 6006 * 1024 * 4 > CHUNK_TARGET_BYTES  # two chunks, back to back in the file
    assert seen["names"] == ["model.safetensors"] and os.path.samefile(tmp_path / "hf" / "model.safetensors", pack)
    assert not os.access(pack, os.W_OK) or os.geteuid() == 0  # read-only: a write through the link fails
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert got.keys() == model.keys() and all(torch.equal(got[k], v) for k, v in model.items())
    full = bcp.load_full(tmp_path / "ck")  # and the checkpoint loads as always
    assert all(torch.equal(full["model"][k], v) for k, v in model.items()) and full["step"] == 3
    assert bcp.verify(tmp_path / "ck").ok
    assert json.loads((tmp_path / "ck" / "metadata.json").read_text())["safetensors"] == {"model": [index]}


def test_async_save_links_before_the_commit_point(tmp_path):
    order = []

    def hook(md):
        order.append(os.path.exists(tmp_path / "ck" / "metadata.json"))
        link_views(str(tmp_path / "ck"), md, "model", str(tmp_path / "hf"))
    handle = bcp.save(tmp_path / "ck", {"model": _model()}, safetensors=["model"], before_commit=hook, async_save=True)
    handle.wait()
    assert order == [False] and (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_failing_before_commit_fails_the_save_and_commits_nothing(tmp_path):
    def hook(md):
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        bcp.save(tmp_path / "ck", {"model": _model()}, safetensors=["model"], before_commit=hook)
    assert not bcp.is_checkpoint(tmp_path / "ck")


def test_a_key_path_that_cannot_be_safetensors_stays_format_5(tmp_path):
    state = {"model": {"w": torch.randn(4, 4), "c": torch.randn(3, dtype=torch.complex128)}}  # no safetensors tag
    bcp.save(tmp_path / "ck", state, safetensors=["model"])
    md = bcp.Checkpointer().metadata(tmp_path / "ck")
    assert md.version == 5 and not md.safetensors
    full = bcp.load_full(tmp_path / "ck")
    assert torch.equal(full["model"]["c"], state["model"]["c"]) and torch.equal(full["model"]["w"], state["model"]["w"])
    # the key path's other tensors are still laid out as a safetensors file (part of it), read through `at`
    (partial,) = [p for p in md.packs if p.endswith(".safetensors")]
    assert list(load_file(str(tmp_path / "ck" / partial))) == ["w"]
    with pytest.raises(bcp.CheckpointError, match=r"no safetensors files.*safetensors=\['model'\]"):
        link_views(str(tmp_path / "ck"), md, "model", str(tmp_path / "hf"))
    with pytest.raises(bcp.CheckpointError, match="key paths"):
        bcp.save(tmp_path / "x", state, safetensors="model")
    with pytest.raises(bcp.CheckpointError, match="tier='persistent'"):
        bcp.Checkpointer().save("step_1", state, tier="local", safetensors=["model"])


def test_link_views_replaces_its_own_family_and_leaves_other_files(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "training_args.bin",
                 "config.json", "adapter_model.safetensors"):
        (folder / name).write_text("old")
    seen = _save(tmp_path / "ck", {"model": {"w": torch.ones(3)}})
    assert seen["names"] == ["model.safetensors"]
    assert sorted(os.listdir(folder)) == ["adapter_model.safetensors", "config.json", "model.safetensors",
                                          "training_args.bin"]
    assert (folder / "training_args.bin").read_text() == "old"
    # a second save of the same folder replaces the link (the old pack is not written through)
    os.link(folder / "model.safetensors", tmp_path / "old_pack")  # keeps the first save's pack after its removal
    _save(tmp_path / "ck", {"model": {"w": torch.zeros(3)}}, overwrite=True)
    assert torch.equal(load_file(str(folder / "model.safetensors"))["w"], torch.zeros(3))
    assert torch.equal(load_file(str(tmp_path / "old_pack"))["w"], torch.ones(3))


@pytest.mark.parametrize("refused", ["link", "chmod"])
def test_link_views_where_the_file_system_refuses_links_or_modes(tmp_path, monkeypatch, refused):
    """No hard links (another device, a file system without them): the pack is copied; no file modes
    (some FUSE / SMB mounts refuse chmod): linked all the same. The save commits either way."""
    import errno

    real = getattr(os, refused)

    def refuse(src, *args, **kwargs):  # only for the packs (the engine's own commit links its metadata.json)
        if not str(src).endswith(".safetensors"):
            return real(src, *args, **kwargs)
        raise OSError(errno.EXDEV if refused == "link" else errno.EPERM, f"{refused} refused")
    monkeypatch.setattr(os, refused, refuse)
    model = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    seen = _save(tmp_path / "ck", {"model": model})
    assert seen["names"] == ["model.safetensors"] and bcp.is_checkpoint(tmp_path / "ck")
    (index,) = seen["md"].safetensors["model"]
    pack = tmp_path / "ck" / seen["md"].packs[index]
    assert os.path.samefile(tmp_path / "hf" / "model.safetensors", pack) == (refused != "link")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == pack.read_bytes()
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert got.keys() == model.keys() and all(torch.equal(got[k], v) for k, v in model.items())


def _manifest(world, shapes):
    return [tuple(TensorManifest(k, "float32", s, "replicated", (((0,) * len(s), s),)) for k, s in shapes.items())
            for _ in range(world)]


def test_planner_keeps_safetensors_tensors_whole_on_one_writer_spread_over_holders():
    shapes = {"model/a": (4096, 1024), "model/b": (4096, 1024), "model/c": (3, 5), "model/p": (6003, 1024),
              "optimizer/m": (4096, 1024)}
    plan = plan_save(_manifest(2, shapes), safetensors=("model",))
    writers = {}
    for r in range(2):
        local = rank_part(plan, r)
        assert local.safetensors == ("model",)
        for w in local.writes:
            writers.setdefault(w.key, []).append((r, w.lengths))
    for k in ("model/a", "model/b", "model/c", "model/p"):  # 6003 rows: ceil-divided chunks would pad an edge
        ((rank, lengths),) = writers[k]  # one writer, the whole tensor
        assert lengths == shapes[k]
        a = plan.arrays[plan.tensors[k].regions[0].array]
        assert a.shape == shapes[k] and shapes[k][0] % a.chunks[0] == 0
    assert {writers[k][0][0] for k in ("model/a", "model/b", "model/p")} == {0, 1}  # spread over the holders
    assert len(writers["optimizer/m"]) == 2  # other keys: split among holders as before


def test_sharded_tensors_of_a_key_path_are_not_safetensors():
    from bytecheckpoint.storage.packs import st_arrays, st_views

    rows = 4096 * 40  # > 16 chunks of 16 MiB per shard: the array stays the tensor's own (not one per region)
    shard = lambda r: TensorManifest("model/w", "float32", (rows, 1024), "sharded", (((r * rows // 2, 0), (rows // 2, 1024)),))
    plan = plan_save([(shard(0),), (shard(1),)], safetensors=("model",))
    for r in range(2):
        local = rank_part(plan, r)
        assert [w.lengths for w in local.writes] == [(rows // 2, 1024)] and st_arrays(local) == {}
    assert st_views(plan, {}) == {}
