"""torchtitan_bytecheckpoint: the manager driven with torchtitan's own classes (fast, one process), and
torchtitan's real Trainer on gloo processes (slow: tests/torchtitan/launch.py) saving with our
manager and resuming at another layout, against torchtitan's own DCP manager."""
from __future__ import annotations

import os
import shutil
import sys
import threading

import pytest

pytest.importorskip("torchtitan", reason="pip install 'bytecheckpoint[torchtitan]'")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import launch  # noqa: E402


# ---------------------------------------------------------------------- fast: no training loop

class TrainState:
    """torchtitan hands its Trainer as `train_state`; the fast test needs only its Stateful part."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _parts(data_dir, seed):
    from byte_tokenizer import ByteTokenizer
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(258, 16), torch.nn.Linear(16, 258))
    optimizers = default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
    loader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=data_dir).build(
        dp_world_size=1, dp_rank=0, tokenizer=ByteTokenizer(), seq_len=16, local_batch_size=2)
    return model, optimizers, schedulers, loader, TrainState()


def _manager(config, folder, model, optimizers, schedulers, loader, train_state):
    return config.build(dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                        states={"train_state": train_state}, sd_adapter=None, base_folder=str(folder))


def _step(model, optimizers, schedulers, batches, train_state, manager=None):
    inputs, labels = next(batches)
    loss = torch.nn.functional.cross_entropy(model(inputs["input"]).flatten(0, 1), labels.flatten())
    loss.backward()
    if manager is not None:
        manager.maybe_wait_for_staging()  # where torchtitan's Trainer calls it
    optimizers.step()
    optimizers.zero_grad()
    schedulers.step()
    train_state.step += 1
    return loss.item()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tt_data")
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE")}
    os.environ.update(HF_DATASETS_CACHE=str(root / "hf_cache"), HF_DATASETS_OFFLINE="1")
    yield launch.make_dataset(root / "data", documents=60)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.parametrize("mode", ["disabled", "async_with_pinned_mem"])
def test_manager_saves_and_resumes_with_torchtitan_classes(tmp_path, data_dir, mode, caplog):
    from torchtitan_bytecheckpoint import ByteCheckpointManager

    config = ByteCheckpointManager.Config(enable=True, folder="ckpt", interval=2, keep_latest_k=2,
                                          last_save_model_only=False, async_mode=mode)
    a = _parts(data_dir, 0)
    manager = _manager(config, tmp_path, *a)
    batches = iter(a[3])
    losses = {}
    for step in range(1, 7):
        losses[step] = _step(a[0], a[1], a[2], batches, a[4], manager)
        # async: staging planned and allocated in the background after the first optimizer step
        assert (manager.warm_up_started is not None) == (mode != "disabled")
        assert manager.save(step, last_step=False) == (step % 2 == 0)
    manager.maybe_wait_for_saving()
    assert manager.save_future is None
    manager.close()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-4", "step-6"]  # keep_latest_k=2
    # retention ran on rank 0's purge thread (off the loop, as torchtitan's); close() joined it
    assert not [t for t in threading.enumerate() if t.name.startswith("bcp-torchtitan-purge")]
    # a torn newer save is skipped (no commit point), the newest committed one is loaded
    os.makedirs(tmp_path / "ckpt" / "step-8" / "data")

    b = _parts(data_dir, 1)
    config4 = ByteCheckpointManager.Config(enable=True, folder="ckpt", interval=2, load_step=4,
                                           keep_latest_k=0, last_save_model_only=False)
    resumed = _manager(config4, tmp_path, *b)
    assert resumed.load(step=4)
    assert b[4].step == 4 and b[2].schedulers[0].last_epoch == 4
    assert "exact" in resumed.data_order_report
    batches_b = iter(b[3])
    for step in (5, 6):
        assert _step(b[0], b[1], b[2], batches_b, b[4]) == pytest.approx(losses[step], rel=1e-6)
    for x, y in zip(a[0].parameters(), b[0].parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    resumed.close()

    c = _parts(data_dir, 2)
    latest = _manager(config, tmp_path, *c)
    with caplog.at_level("WARNING", logger="torchtitan_bytecheckpoint"):
        assert latest.load() and c[4].step == 6  # step-8 is torn: skipped and said
    assert "step-8 is not a committed checkpoint" in caplog.text
    latest.close()


def test_last_step_model_only_then_initial_load_and_policies(tmp_path, data_dir):
    import bytecheckpoint as bcp
    from torchtitan_bytecheckpoint import ByteCheckpointManager

    a = _parts(data_dir, 0)
    config = ByteCheckpointManager.Config(enable=True, folder="ckpt", interval=100, keep_latest_k=0,
                                          enable_first_step_checkpoint=True, last_save_model_only=True)
    manager = _manager(config, tmp_path, *a)
    batches = iter(a[3])
    for step in range(1, 4):
        _step(a[0], a[1], a[2], batches, a[4], manager)
        assert manager.save(step, last_step=step == 3) == (step in (1, 3))
    manager.close()
    groups = {t.name.split("/")[0] for t in bcp.inspect(str(tmp_path / "ckpt" / "step-3")).tensors}
    assert groups == {"model"}  # the last step: model only
    assert "optimizer" in {t.name.split("/")[0] for t in bcp.inspect(str(tmp_path / "ckpt" / "step-1")).tensors}

    b = _parts(data_dir, 1)
    last = str(tmp_path / "ckpt" / "step-3")
    fresh = ByteCheckpointManager.Config(enable=True, folder="other", initial_load_path=last,
                                         initial_load_model_only=True, load_only=True)
    starter = _manager(fresh, tmp_path, *b)
    assert starter.load()
    for x, y in zip(a[0].parameters(), b[0].parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert b[4].step == 0 and not b[1].optimizers[0].state  # model only: no optimizer state, no step
    assert starter.save(100, last_step=True) is False  # load_only
    starter.close()

    c = _parts(data_dir, 2)
    partial = ByteCheckpointManager.Config(enable=True, folder="ckpt", load_step=1,
                                           exclude_from_loading=["lr_scheduler", "dataloader"])
    resumed = _manager(partial, tmp_path, *c)
    assert resumed.load(step=1) and c[4].step == 1 and c[1].optimizers[0].state
    assert c[2].schedulers[0].last_epoch == 0 and resumed.data_order_report == ""
    resumed.close()


def test_last_step_in_export_dtype_keeps_the_model_names(tmp_path, data_dir):
    import bytecheckpoint as bcp
    from torchtitan_bytecheckpoint import ByteCheckpointManager

    a = _parts(data_dir, 0)
    for folder, dtype in (("f32", "float32"), ("bf16", "bfloat16")):
        config = ByteCheckpointManager.Config(enable=True, folder=folder, export_dtype=dtype, keep_latest_k=0)
        manager = _manager(config, tmp_path, *a)
        assert manager.save(5, last_step=True)
        manager.close()
    f32, bf16 = (bcp.inspect(str(tmp_path / f / "step-5")).tensors for f in ("f32", "bf16"))
    names = ["model/0.weight", "model/1.bias", "model/1.weight"]
    assert sorted(t.name for t in f32) == sorted(t.name for t in bf16) == names
    assert {t.dtype for t in f32} == {"float32"} and {t.dtype for t in bf16} == {"bfloat16"}


def test_seed_checkpoint_is_loaded_model_only(tmp_path, data_dir):
    """train.py's create_seed_checkpoint: save(curr_step=0, last_step=True); a run finding step-0
    loads the model alone (as torchtitan's DCP manager does)."""
    from torchtitan_bytecheckpoint import ByteCheckpointManager

    a = _parts(data_dir, 0)
    config = ByteCheckpointManager.Config(enable=True, folder="ckpt", keep_latest_k=0)
    seed = _manager(config, tmp_path, *a)
    assert seed.save(curr_step=0, last_step=True)
    seed.close()
    b = _parts(data_dir, 1)
    _step(b[0], b[1], b[2], iter(b[3]), b[4])  # some optimizer state and a step count of its own
    run = _manager(config, tmp_path, *b)
    assert run.load()
    for x, y in zip(a[0].parameters(), b[0].parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert b[4].step == 1 and b[2].schedulers[0].last_epoch == 1  # model only: the rest is untouched
    run.close()


class Position:
    """A dataloader of another form than torchtitan's: saved per rank as its state_dict()."""

    def __init__(self, at=0):
        self.at = at

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, sd):
        self.at = sd["at"]


def test_a_dataloader_of_another_form_is_saved_as_it_is(tmp_path, data_dir):
    from torchtitan_bytecheckpoint import ByteCheckpointManager

    a, b = _parts(data_dir, 0), _parts(data_dir, 1)
    config = ByteCheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0)
    saver = _manager(config, tmp_path, a[0], a[1], a[2], Position(7), a[4])
    assert saver.save(1)
    saver.close()
    here = Position()
    loader = _manager(config, tmp_path, b[0], b[1], b[2], here, b[4])
    assert loader.load() and here.at == 7 and loader.data_order_report == ""
    loader.close()


class PrefixAdapter:
    """A stand-in for a model's state dict adapter: Hugging Face names are 'hf.' + torchtitan's."""

    hf_assets_path = None

    def to_hf(self, sd):
        return {f"hf.{k}": v for k, v in sd.items()}

    def from_hf(self, sd):
        return {k[len("hf."):]: v for k, v in sd.items()}


def test_last_save_in_hf_and_initial_load_in_hf(tmp_path, data_dir):
    from safetensors.torch import load_file

    from torchtitan_bytecheckpoint import ByteCheckpointManager

    a = _parts(data_dir, 0)
    config = ByteCheckpointManager.Config(enable=True, folder="ckpt", last_save_in_hf=True, keep_latest_k=0)
    manager = config.build(dataloader=a[3], model_parts=[a[0]], optimizers=a[1], lr_schedulers=a[2],
                                 states={"train_state": a[4]}, sd_adapter=PrefixAdapter(), base_folder=str(tmp_path))
    assert manager.save(3, last_step=True)
    manager.close()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-3"]  # the gathering copy is gone
    hf = load_file(str(tmp_path / "ckpt" / "step-3" / "model.safetensors"))
    assert sorted(hf) == sorted(f"hf.{k}" for k in a[0].state_dict())
    for k, v in a[0].state_dict().items():
        torch.testing.assert_close(hf[f"hf.{k}"], v, rtol=0, atol=0)

    b = _parts(data_dir, 1)
    start = ByteCheckpointManager.Config(enable=True, folder="other", initial_load_in_hf=True,
                                         initial_load_path=str(tmp_path / "ckpt" / "step-3"))
    starter = start.build(dataloader=b[3], model_parts=[b[0]], optimizers=b[1], lr_schedulers=b[2],
                          states={"train_state": b[4]}, sd_adapter=PrefixAdapter(), base_folder=str(tmp_path))
    assert starter.load()
    for x, y in zip(a[0].parameters(), b[0].parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not os.listdir(tmp_path / "other")  # the staged copy is gone
    starter.close()
    with pytest.raises(ValueError, match="sd_adapter"):
        _manager(config, tmp_path, *b)


def test_config_keeps_torchtitans_fields_and_async_modes():
    from dataclasses import fields

    from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager

    from torchtitan_bytecheckpoint import ByteCheckpointManager

    ours = {f.name for f in fields(ByteCheckpointManager.Config)}
    assert {f.name for f in fields(BaseCheckpointManager.Config)} <= ours
    assert {f.name for f in fields(CheckpointManager.Config)} <= ours
    assert {"async_staging", "storage_options"} <= ours
    for mode in ("disabled", "async", "async_with_pinned_mem", "ASYNC"):
        assert ByteCheckpointManager.Config(async_mode=mode).async_mode == mode.lower()
    with pytest.raises(ValueError, match="async_mode"):
        ByteCheckpointManager.Config(async_mode="threads")
    with pytest.raises(ValueError, match="keep_latest_k"):
        ByteCheckpointManager.Config(keep_latest_k=-1)
    assert type(ByteCheckpointManager.Config(enable=False).build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None)
    ) is ByteCheckpointManager
    disabled = ByteCheckpointManager.Config(enable=False).build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None)
    assert disabled.save(10) is False and disabled.load() is False


# ---------------------------------------------------------------------- slow: torchtitan's Trainer

RUN_S = 240  # one multi-process run's time limit


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted 4-step runs on 2 processes (FSDP2), saving at steps 2 and 4, by each manager."""
    root = tmp_path_factory.mktemp("tt_runs")
    data = launch.make_dataset(root / "data")
    out = {"root": root, "data": data}
    for manager in ("dcp", "bcp"):
        out[manager] = launch.run(2, dict(steps=4, data_dir=data, dump=str(root / f"{manager}_full"),
                                          manager=manager, interval=2), timeout=RUN_S)
    return out


def _resume(runs, name, manager, nproc, source="bcp", **spec):
    """A fresh dump folder holding only the uninterrupted run's step-2 checkpoint; train to step 4."""
    dump = runs["root"] / name
    shutil.copytree(runs["root"] / f"{source}_full" / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    return launch.run(nproc, dict(dict(steps=4, data_dir=runs["data"], dump=str(dump), manager=manager,
                                       interval=2), **spec), timeout=RUN_S)


@pytest.mark.torchtitan
@pytest.mark.timeout(900)
def test_trainer_fsdp2_resume_equals_torchtitans_dcp_manager(runs):
    full_dcp, full_bcp = runs["dcp"][0]["losses"], runs["bcp"][0]["losses"]
    assert full_bcp == full_dcp  # the manager does not change training
    ours = _resume(runs, "bcp_dp2", "bcp", 2)
    theirs = _resume(runs, "dcp_dp2", "dcp", 2, source="dcp")
    assert ours[0]["losses"] == theirs[0]["losses"] == {3: full_dcp[3], 4: full_dcp[4]}
    for rank in range(2):  # every rank trains on the tokens the uninterrupted run trained on
        assert ours[rank]["batches"] == {s: runs["bcp"][rank]["batches"][s] for s in (3, 4)}


@pytest.mark.torchtitan
@pytest.mark.timeout(900)
def test_trainer_dp2_to_dp1_continues_the_data_stream(runs):
    """torchtitan's own manager refuses this resume (dataloader.py: 'dp_degree is inconsistent');
    ours continues both saved DP ranks' streams on the one process."""
    with pytest.raises(AssertionError, match="dp_degree is inconsistent"):
        _resume(runs, "dcp_dp1", "dcp", 1, source="dcp", local_batch=4)
    ours = _resume(runs, "bcp_dp1", "bcp", 1, local_batch=4)
    full = runs["bcp"]
    for step in (3, 4):
        assert ours[0]["batches"][step] == full[0]["batches"][step] + full[1]["batches"][step]
        # the same tokens and weights; FSDP2's reduce-scatter sums in another order than one process
        assert ours[0]["losses"][step] == pytest.approx(full[0]["losses"][step], rel=1e-4)
    # torchtitan's only way on: resume without the dataloader's state; the stream starts over
    theirs = _resume(runs, "dcp_dp1_nodata", "dcp", 1, source="dcp", local_batch=4, exclude=["dataloader"])
    trained = [tuple(x) for r in range(2) for s in (1, 2) for x in full[r]["batches"][s]]
    due = [tuple(x) for r in range(2) for s in (3, 4) for x in full[r]["batches"][s]]

    def replayed_skipped(rec):
        got = [tuple(x) for s in (3, 4) for x in rec[0]["batches"][s]]
        return sum(x in trained for x in got), sum(x not in got for x in due)

    assert replayed_skipped(ours) == (0, 0)
    replayed, skipped = replayed_skipped(theirs)
    assert replayed > 0 and skipped > 0
    print(f"DP2 -> 1 samples of steps 3-4 replayed/skipped: torchtitan without the dataloader {replayed}/"
          f"{skipped} of {len(due)}, bytecheckpoint 0/0")


@pytest.mark.torchtitan
@pytest.mark.timeout(900)
def test_trainer_resumes_torchtitans_own_dcp_checkpoints(runs):
    """Switching: a run checkpointed by torchtitan's DCP manager, relaunched with ours, continues from
    its newest step-N (never step 1): at FSDP2 2 exactly as torchtitan's own resume, and at DP 1 with
    the global batch kept on exactly the samples the uninterrupted run trains on (DCP's dp_rank_<r>
    states continued by the rule of our own)."""
    full = runs["dcp"]
    same = _resume(runs, "dcp_to_bcp_dp2", "bcp", 2, source="dcp")
    assert same[0]["losses"] == {3: full[0]["losses"][3], 4: full[0]["losses"][4]}
    for rank in range(2):
        assert same[rank]["batches"] == {s: full[rank]["batches"][s] for s in (3, 4)}
    one = _resume(runs, "dcp_to_bcp_dp1", "bcp", 1, source="dcp", local_batch=4)
    for step in (3, 4):
        assert one[0]["batches"][step] == full[0]["batches"][step] + full[1]["batches"][step]
        assert one[0]["losses"][step] == pytest.approx(full[0]["losses"][step], rel=1e-4)


@pytest.mark.torchtitan
@pytest.mark.timeout(900)
def test_leaving_ours_converted_to_dcp_resumes_in_torchtitans_own_manager(runs):
    """Leaving: our step-2 checkpoint, `bytecheckpoint convert --to dcp --layout torchtitan`, is resumed
    by torchtitan's own DCP manager at FSDP2 2 exactly as the uninterrupted run continues."""
    import subprocess
    import sys
    dump = runs["root"] / "bcp_to_dcp"
    out = subprocess.run([sys.executable, "-m", "bytecheckpoint", "convert",
                          str(runs["root"] / "bcp_full" / "checkpoint" / "step-2"),
                          str(dump / "checkpoint" / "step-2"), "--to", "dcp", "--layout", "torchtitan"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    theirs = launch.run(2, dict(steps=4, data_dir=runs["data"], dump=str(dump), manager="dcp", interval=2),
                        timeout=RUN_S)
    full = runs["bcp"]
    assert theirs[0]["losses"] == {3: full[0]["losses"][3], 4: full[0]["losses"][4]}
    for rank in range(2):
        assert theirs[rank]["batches"] == {s: full[rank]["batches"][s] for s in (3, 4)}


@pytest.mark.torchtitan
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_trainer_async_modes_resume(runs, mode):
    root = runs["root"]
    full = launch.run(2, dict(steps=4, data_dir=runs["data"], dump=str(root / f"bcp_{mode}"), manager="bcp",
                              interval=2, async_mode=mode), timeout=RUN_S)
    assert full[0]["losses"] == runs["bcp"][0]["losses"]
    dump = root / f"bcp_{mode}_resumed"
    shutil.copytree(root / f"bcp_{mode}" / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    resumed = launch.run(2, dict(steps=4, data_dir=runs["data"], dump=str(dump), manager="bcp", interval=2,
                                 async_mode=mode), timeout=RUN_S)
    assert resumed[0]["losses"] == {s: full[0]["losses"][s] for s in (3, 4)}
