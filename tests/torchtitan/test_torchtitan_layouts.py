"""torchtitan's real Trainer saved at one parallel layout and resumed at another (gloo processes,
tests/torchtitan/launch.py): the losses after our manager's resume equal those after torchtitan's own
DCP manager's resume at the same layout from the same training; where DCP refuses (a smaller
data-parallel degree), every later step trains on the uninterrupted run's tokens."""
from __future__ import annotations

import os
import shutil
import sys

import pytest

pytest.importorskip("torchtitan", reason="pip install 'bytecheckpoint[torchtitan]'")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import launch  # noqa: E402

RUN_S = 300  # one multi-process run's time limit (4 processes on 2 cores take ~75 s)

pytestmark = [pytest.mark.torchtitan, pytest.mark.timeout(1200)]

MOE = dict(model="deepseek_v3")

# name: (processes, spec) of the run that saves at step 2, and of the resume to step 4
LAYOUTS = {
    "pp2-to-1": ((2, dict(pp=2, dp_shard=1)), (1, dict())),
    "pp2-interleaved-to-1": ((2, dict(pp=2, dp_shard=1, pp_schedule="Interleaved1F1B")), (1, dict())),
    "1-to-pp2": ((1, dict()), (2, dict(pp=2, dp_shard=1))),
    "tp2-to-1": ((2, dict(tp=2, dp_shard=1)), (1, dict())),
    "tp2xfsdp2-to-fsdp2": ((4, dict(tp=2, dp_shard=2)), (2, dict())),
    "pp2xfsdp2-to-fsdp2": ((4, dict(pp=2, dp_shard=2)), (2, dict())),
    # DeepSeek V3's debug MoE: experts split over EP 2 (FSDP 2 beside them), resumed without EP
    "moe-ep2-to-fsdp2": ((2, dict(MOE, ep=2)), (2, dict(MOE))),
    "moe-fsdp2-to-ep2": ((2, dict(MOE)), (2, dict(MOE, ep=2))),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return launch.make_dataset(tmp_path_factory.mktemp("tt_layouts_data") / "data")


def _save_and_resume(root, data, manager, saved, resumed):
    (n_save, save_spec), (n_resume, resume_spec) = saved, resumed
    first = root / f"{manager}_saved"
    launch.run(n_save, dict(save_spec, steps=2, data_dir=data, dump=str(first), manager=manager, interval=2),
               timeout=RUN_S)
    second = root / f"{manager}_resumed"
    shutil.copytree(first / "checkpoint" / "step-2", second / "checkpoint" / "step-2")
    return launch.run(n_resume, dict(resume_spec, steps=4, data_dir=data, dump=str(second), manager=manager,
                                     interval=2), timeout=RUN_S)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resume_at_another_layout_equals_torchtitans_dcp_manager(tmp_path, data, layout):
    saved, resumed = LAYOUTS[layout]
    ours = _save_and_resume(tmp_path, data, "bcp", saved, resumed)
    theirs = _save_and_resume(tmp_path, data, "dcp", saved, resumed)
    assert sorted(ours[0]["losses"]) == [3, 4]
    assert ours[0]["losses"] == theirs[0]["losses"]
    assert ours[0]["batches"] == theirs[0]["batches"]


def test_fsdp4_to_fsdp2_continues_every_saved_rank_stream(tmp_path, data):
    """DP 4 -> 2: resumed DP rank r trains, per step, on saved DP ranks 2r and 2r+1's tokens."""
    full = launch.run(4, dict(steps=4, data_dir=data, dump=str(tmp_path / "full"), manager="bcp", interval=2,
                              dp_shard=4), timeout=RUN_S)
    dump = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    ours = launch.run(2, dict(steps=4, data_dir=data, dump=str(dump), manager="bcp", interval=2, local_batch=4),
                      timeout=RUN_S)
    for r in range(2):
        for step in (3, 4):
            assert ours[r]["batches"][step] == full[2 * r]["batches"][step] + full[2 * r + 1]["batches"][step]
    for step in (3, 4):
        assert ours[0]["losses"][step] == pytest.approx(full[0]["losses"][step], rel=1e-4)


def test_moe_ep2_to_one_process_continues_the_uninterrupted_run(tmp_path, data, saved_on=4):
    """DeepSeek V3's debug MoE saved at EP 2 x FSDP 4 on 4 processes (the experts split by EP and sharded
    again by FSDP inside each EP group) resumes on one process (DCP refuses: its dataloader state cannot change
    DP degree): every expert and its AdamW moments land whole, the one rank trains on every saved
    rank's tokens, and the losses are the uninterrupted run's."""
    full = launch.run(saved_on, dict(MOE, ep=2, steps=4, data_dir=data, dump=str(tmp_path / "full"),
                                     manager="bcp", interval=2), timeout=RUN_S)
    dump = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    ours = launch.run(1, dict(MOE, steps=4, data_dir=data, dump=str(dump), manager="bcp", interval=2,
                              local_batch=2 * saved_on), timeout=RUN_S)
    assert sorted(ours[0]["losses"]) == [3, 4]
    for step in (3, 4):
        assert ours[0]["batches"][step] == [row for r in range(saved_on) for row in full[r]["batches"][step]]
        assert ours[0]["losses"][step] == pytest.approx(full[0]["losses"][step], rel=1e-4)


def test_hugging_face_ends_equal_torchtitans_dcp_manager(tmp_path, data):
    """last_save_in_hf writes the tensors DCP's HuggingFaceStorageWriter writes (llama3's state dict
    adapter, FSDP2 on 2 processes); a run started from either with initial_load_in_hf trains alike."""
    import torch
    from safetensors.torch import load_file

    losses, files = {}, {}
    for manager in ("bcp", "dcp"):
        last = dict(last_save_model_only=True, last_save_in_hf=True)
        launch.run(2, dict(steps=2, data_dir=data, dump=str(tmp_path / f"{manager}_hf"), manager=manager,
                           interval=2, checkpoint=last), timeout=RUN_S)
        step = tmp_path / f"{manager}_hf" / "checkpoint" / "step-2"
        files[manager] = {}
        for f in sorted(step.glob("*.safetensors")):
            files[manager].update(load_file(str(f)))
        first = dict(initial_load_in_hf=True, initial_load_model_only=True, initial_load_path=str(step))
        rec = launch.run(2, dict(steps=2, data_dir=data, dump=str(tmp_path / f"{manager}_from_hf"), manager=manager,
                                 interval=2, checkpoint=first), timeout=RUN_S)
        losses[manager] = rec[0]["losses"]
    assert sorted(files["bcp"]) == sorted(files["dcp"]) and files["bcp"]
    for name, tensor in files["dcp"].items():
        assert torch.equal(files["bcp"][name], tensor), name
    assert losses["bcp"] == losses["dcp"]


def test_torchtitans_own_pp2_checkpoint_resumes_through_ours_on_one_process(tmp_path, data):
    """Switching at another layout: torchtitan's DCP manager saves at PP2 (two stages, two processes);
    ByteCheckpointManager resumes that step-2 on one process exactly as DCP's own resume does."""
    (n_save, save_spec), (n_resume, resume_spec) = LAYOUTS["pp2-to-1"]
    first = tmp_path / "dcp_saved"
    launch.run(n_save, dict(save_spec, steps=2, data_dir=data, dump=str(first), manager="dcp", interval=2),
               timeout=RUN_S)
    runs = {}
    for manager in ("bcp", "dcp"):
        second = tmp_path / f"{manager}_resumed"
        shutil.copytree(first / "checkpoint" / "step-2", second / "checkpoint" / "step-2")
        runs[manager] = launch.run(n_resume, dict(resume_spec, steps=4, data_dir=data, dump=str(second),
                                                  manager=manager, interval=2), timeout=RUN_S)
    assert sorted(runs["bcp"][0]["losses"]) == [3, 4]
    assert runs["bcp"][0]["losses"] == runs["dcp"][0]["losses"]
    assert runs["bcp"][0]["batches"] == runs["dcp"][0]["batches"]
