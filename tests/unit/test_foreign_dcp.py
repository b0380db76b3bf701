"""PyTorch DCP checkpoints through bcp.load / load_full / inspect / verify / latest (one process),
and bad input: a forged .metadata executes nothing, a truncated .distcp, shapes that do not match,
a save that did not finish. The multi-rank resharding cases are tests/dist/test_dcp_reader.py."""
import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import bytecheckpoint as bcp
from bytecheckpoint.foreign import dcp as dcp_reader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _fresh():
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1.0)


@pytest.fixture
def saved(tmp_path):
    model, optim = _trained()
    msd, osd = get_state_dict(model, optim)
    path = str(tmp_path / "step-20")
    dcp.save({"model": msd, "optim": osd, "step": 20, "rng": torch.get_rng_state(),
              "extra": {"tokens": [1, 2, 3], "name": "run-a", "t": torch.arange(5)}}, checkpoint_id=path)
    return path, model, optim


def test_load_into_fresh_model_and_optimizer(saved):
    path, model, optim = saved
    m2, o2 = _fresh()
    state = bcp.load(path, {"model": m2, "optim": o2, "step": 0, "rng": None,
                            "extra": {"tokens": None, "name": None, "t": torch.zeros(5, dtype=torch.long)}})
    assert state["step"] == 20 and state["extra"]["tokens"] == [1, 2, 3] and state["extra"]["name"] == "run-a"
    assert torch.equal(state["extra"]["t"], torch.arange(5))
    for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k
    for p1, p2 in zip(model.parameters(), m2.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optim.state[p1][k], o2.state[p2][k]), k
    assert o2.param_groups[0]["lr"] == 3e-3


def test_load_full_inspect_verify_latest(saved, tmp_path):
    path, model, _ = saved
    full = bcp.load_full(path)
    assert full["step"] == 20 and set(full["model"]) == set(model.state_dict())
    info = bcp.inspect(path)
    assert info.complete and info.info["format"] == "dcp" and info.info["step"] == 20
    assert {t.name for t in info.tensors} >= {"model/0.weight", "optim/state/0.weight/exp_avg"}
    assert bcp.verify(path).ok
    older = str(tmp_path / "step-5")
    dcp.save({"x": torch.ones(2)}, checkpoint_id=older)
    os.makedirs(tmp_path / "step-30" / "partial")  # no commit point: skipped
    assert bcp.latest(str(tmp_path)) == path


def test_strict_load_names_a_missing_key(saved):
    path, _, _ = saved
    m2, o2 = _fresh()
    with pytest.raises(bcp.StateMismatchError, match="not_saved"):
        bcp.load(path, {"model": m2, "optim": o2, "step": 0, "rng": None, "extra": None, "not_saved": 1})


def test_forged_metadata_executes_nothing(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    root = tmp_path / "ck"
    root.mkdir()
    (root / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(bcp.MetadataError, match="system.*not one of DCP's metadata classes"):
        bcp.load(str(root), {"x": torch.zeros(1)})
    assert not marker.exists()


def test_truncated_distcp_is_an_error_and_the_model_is_untouched(saved):
    path, _, _ = saved
    data = os.path.join(path, "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 3000)
    m2, o2 = _fresh()
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    with pytest.raises(bcp.CorruptCheckpointError, match="__0_0.distcp"):
        bcp.load(path, {"model": m2, "optim": o2, "step": 0, "rng": None, "extra": None})
    for k, v in m2.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not o2.state  # no optimizer state made up


def test_a_flipped_byte_fails_the_checksum(saved):
    path, model, _ = saved
    key = next(k for k in dcp_reader.read_metadata(bcp.default_checkpointer().storage(path)).arrays)
    md = bcp.default_checkpointer().metadata(path)
    meta = md.arrays[key]
    pack, low, high = next(iter(meta.locations.values()))
    with open(os.path.join(path, meta.pack_files[pack]), "r+b") as f:
        f.seek(low | high << 32)
        b = f.read(1)
        f.seek(low | high << 32)
        f.write(bytes([b[0] ^ 0xFF]))
    assert not bcp.verify(path).ok
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.load_full(path)


def test_shapes_that_do_not_match_name_the_key(saved):
    path, _, _ = saved
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 2))
    with pytest.raises(bcp.CheckpointError, match=r"0\.weight"):
        bcp.load(path, {"model": other}, strict=False)


def test_a_save_that_did_not_finish(saved):
    path, _, _ = saved
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(bcp.IncompleteCheckpointError, match="DCP"):
        bcp.load(path, {"x": torch.zeros(1)})
    assert not bcp.is_checkpoint(path)


def test_values_that_need_a_full_unpickle_ask_for_allow_pickle(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(3), "buf": io.BytesIO(b"hello")}, checkpoint_id=path)
    with pytest.raises(bcp.CheckpointError, match="allow_pickle=True"):
        bcp.load(path, {"w": torch.zeros(3), "buf": None})
    state = bcp.load(path, {"w": torch.zeros(3), "buf": None}, allow_pickle=True)
    assert state["buf"].getvalue() == b"hello" and torch.equal(state["w"], torch.ones(3))


def test_a_non_c_order_chunk_is_refused_by_name(tmp_path):
    from bytecheckpoint.foreign import torch_zip
    b = io.BytesIO()
    torch.save(torch.randn(4, 3).t(), b)
    raw = b.getvalue()
    blob = torch_zip.Blob(len(raw), {0: raw}, lambda a, z: raw[a:z], "x.distcp")
    with pytest.raises(bcp.CorruptCheckpointError, match="stride"):
        torch_zip.tensor_bytes(blob)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.float8_e4m3fn])
def test_dtypes_and_large_archives(tmp_path, dtype):
    big = torch.randn(300, 300).to(dtype)  # > WHOLE_BYTES: head and tail windows
    state = {"big": big, "scalar": torch.tensor(3.5).to(dtype), "empty": torch.zeros(0, 4, dtype=dtype)}
    path = str(tmp_path / "ck")
    dcp.save(state, checkpoint_id=path)
    got = bcp.load_full(path)
    for k, v in state.items():
        assert got[k].dtype == dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def test_deepspeed_folders_it_cannot_read_are_named(tmp_path):
    """Real DeepSpeed folders load (tests/dist/test_deepspeed_stock.py); these never pass as one."""
    tag = tmp_path / "ds" / "global_step10"
    tag.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step10")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    for path in (tmp_path / "ds", tag):
        with pytest.raises(bcp.CheckpointError, match="DeepSpeed checkpoint without ZeRO optimizer states"):
            bcp.load(str(path), {"x": torch.zeros(1)})
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"y" * 100)
    with pytest.raises(bcp.CorruptCheckpointError, match="mp_rank_00_model_states.pt"):
        bcp.load(str(tag), {"x": torch.zeros(1)})
    (tag / "layer_01-model_00-model_states.pt").write_bytes(b"z")
    with pytest.raises(bcp.CheckpointError, match="pipeline- or tensor-parallel DeepSpeed"):
        bcp.load(str(tag), {"x": torch.zeros(1)})
    (tmp_path / "ds" / "latest").write_text("global_step12")
    with pytest.raises(bcp.IncompleteCheckpointError, match="names tag 'global_step12'"):
        bcp.load(str(tmp_path / "ds"), {"x": torch.zeros(1)})


def test_keep_last_orders_dcp_folders_by_step_and_deletes_commit_first(tmp_path):
    for step in (2, 10, 4):
        dcp.save({"w": torch.full((2,), float(step))}, checkpoint_id=str(tmp_path / f"step-{step}"))
    report = bcp.keep_last(str(tmp_path), 2)
    assert sorted(report.kept) == sorted(str(tmp_path / f"step-{s}") for s in (4, 10))
    assert report.deleted == [str(tmp_path / "step-2")] and not (tmp_path / "step-2").exists()
    assert bcp.latest(str(tmp_path)) == str(tmp_path / "step-10")
