"""transformers.Trainer with transformers_bytecheckpoint.attach, in real processes (torchrun, gloo
on CPU), against the stock Trainer running the same script: saved on 2 processes, resumed on 1
(and 2), DDP, FSDP 1 and 2 (forced on CPU) and DeepSpeed ZeRO 1/2/3 (CPU accelerator).

Each launch has a hard time limit; on timeout its whole process group is killed and the test fails
with the output tail, so nothing hangs; a failing rank fails the launch (torchrun stops the rest).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

SCRIPTS = Path(__file__).parent / "transformers_scripts"
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180
STOCK_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "rng_state_0.pth",
               "rng_state_1.pth", "scaler.pt")


def launch(nproc: int, *args: str, timeout: float = TIMEOUT_S, env: Dict[str, str] = None) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--max_restarts=0", "--monitor_interval=0.5", str(SCRIPTS / "trainer_run.py"), *args]
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join(p for p in (full.get("PYTHONPATH"), str(REPO)) if p)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker it started
        out, _ = proc.communicate()
        pytest.fail(f"trainer_run.py x{nproc} {' '.join(args)} timed out after {timeout}s:\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"trainer_run.py x{nproc} {' '.join(args)} exited {proc.returncode}:\n{out[-8000:]}")
    return out


def dump(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def assert_same_run(got: dict, want: dict, what: str) -> None:
    """Bit for bit: final weights, every logged loss, the global step."""
    assert got["weights"].keys() == want["weights"].keys(), what
    for k in want["weights"]:
        assert torch.equal(got["weights"][k], want["weights"][k]), f"{what}: {k} differs"
    assert got["losses"] == want["losses"], f"{what}: losses {got['losses']} != {want['losses']}"
    assert got["info"]["global_step"] == want["info"]["global_step"], what


def committed(folder: Path) -> bool:
    import bytecheckpoint as bcp

    return bcp.is_checkpoint(str(folder / "bytecheckpoint"))


def assert_gathered_weights(folder: Path, want: dict, what: str) -> None:
    """The folder's model.safetensors, gathered from the shards and written as the stock Trainer
    writes it (FSDP FULL_STATE_DICT, DeepSpeed), opens with from_pretrained and holds `want`."""
    from transformers import AutoModelForCausalLM

    assert {"model.safetensors", "config.json"} <= set(os.listdir(folder)), (what, sorted(os.listdir(folder)))
    assert committed(folder), what
    got = AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    assert want and set(want) <= set(got), (what, sorted(set(want) - set(got)))
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs"


# ---------------------------------------------------------------------------------------- DDP

@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same script, stock and attached (async): 6 steps on 2 processes, a checkpoint every 2;
    then the attached run's newest checkpoint is torn (its commit point removed: a crash while
    writing) and both resume on 1 process (stock from checkpoint-4, attached with
    resume_from_checkpoint=True), and on 2 processes from checkpoint-4."""
    t = tmp_path_factory.mktemp("tr_ddp")
    launch(2, "--out", str(t / "stock"), "--dump", str(t / "stock.pt"))
    launch(2, "--out", str(t / "bcp"), "--attach", "async", "--dump", str(t / "bcp.pt"),
           "--save-final", str(t / "final"))
    (t / "bcp" / "checkpoint-6" / "bytecheckpoint" / "metadata.json").unlink()
    launch(1, "--out", str(t / "stock"), "--resume", str(t / "stock" / "checkpoint-4"), "--dump", str(t / "stock_1.pt"))
    out = launch(1, "--out", str(t / "bcp"), "--attach", "async", "--resume", "true", "--dump", str(t / "bcp_1.pt"))
    (t / "resume_1.log").write_text(out)
    launch(2, "--out", str(t / "stock"), "--resume", str(t / "stock" / "checkpoint-4"), "--dump", str(t / "stock_2.pt"))
    launch(2, "--out", str(t / "bcp"), "--attach", "sync", "--resume", str(t / "bcp" / "checkpoint-4"),
           "--dump", str(t / "bcp_2.pt"))
    return t


def test_ddp_attached_run_trains_exactly_as_stock(ddp: Path) -> None:
    # async saves copy the state out and training goes on at once: the run is the stock run
    assert_same_run(dump(ddp / "bcp.pt"), dump(ddp / "stock.pt"), "continuous DDP run")


def test_ddp_saved_on_2_resumed_on_1_bit_exact_with_stock_and_torn_newest_skipped(ddp: Path) -> None:
    stock, ours = dump(ddp / "stock_1.pt"), dump(ddp / "bcp_1.pt")
    assert ours["world_size"] == 1 and stock["world_size"] == 1
    assert_same_run(ours, stock, "2 -> 1 resume")
    assert [s for s, _ in ours["losses"]][-2:] == [5, 6]
    log = (ddp / "resume_1.log").read_text()
    assert "skipping checkpoint folder(s) never committed" in log and "checkpoint-6" in log, log[-3000:]
    assert "resuming from" in log and log.split("resuming from")[1].split()[0].endswith("checkpoint-4")


def test_ddp_saved_on_2_resumed_on_2_bit_exact_with_stock(ddp: Path) -> None:
    # same world size: each process gets its own RNG states back (dropout is on), as stock
    assert_same_run(dump(ddp / "bcp_2.pt"), dump(ddp / "stock_2.pt"), "2 -> 2 resume")


def test_ddp_checkpoint_folders(ddp: Path) -> None:
    import bytecheckpoint as bcp

    for step in (2, 4):
        folder = ddp / "bcp" / f"checkpoint-{step}"
        files = set(os.listdir(folder))
        assert {"bytecheckpoint", "trainer_state.json", "config.json", "training_args.bin", "model.safetensors"} <= files
        assert not files & set(STOCK_FILES[1:]), files  # model.safetensors: a link into bytecheckpoint/ (below)
        assert committed(folder)
        info = bcp.inspect(str(folder / "bytecheckpoint"))
        assert info.world_size == 1  # replicated state: the should_save process wrote it alone
        saved = bcp.load_full(str(folder / "bytecheckpoint"), keys=["trainer", "scheduler"])
        assert saved["trainer"]["world_size"] == 2 and len(saved["trainer"]["rng_per_rank"]) == 2
        assert saved["trainer"]["global_step"] == step
        assert any(t.name.startswith("optimizer/") for t in info.tensors)
    # torn by the fixture, then written again (overwritten, committed) by the resumed runs' step 6
    assert committed(ddp / "bcp" / "checkpoint-6")
    # stock: its own files, as always
    assert set(STOCK_FILES[:3]) <= set(os.listdir(ddp / "stock" / "checkpoint-4"))


def test_checkpoint_folders_open_with_from_pretrained_weights_written_once(ddp: Path) -> None:
    """Every checkpoint folder has the stock folder's model.safetensors: the checkpoint's own
    safetensors pack (format 6), hard linked, so from_pretrained opens the folder and the weights are
    on disk once. checkpoint-6, saved again by the resumed runs, links the new save's pack."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import bytecheckpoint as bcp

    for step in (2, 4, 6):
        folder = ddp / "bcp" / f"checkpoint-{step}"
        md = bcp.Checkpointer().metadata(str(folder / "bytecheckpoint"))
        (pack,) = md.safetensors["model"]
        assert os.path.samefile(folder / "model.safetensors", folder / "bytecheckpoint" / md.packs[pack])
        assert os.stat(folder / "model.safetensors").st_nlink == 2
        ours, stock = (load_file(str(d / f"checkpoint-{step}" / "model.safetensors")) for d in (ddp / "bcp", ddp / "stock"))
        assert set(ours) - set(stock) == {"lm_head.weight"}  # tied to the embedding: save_pretrained drops it
        assert all(torch.equal(ours[k], stock[k]) for k in stock), step
    model = AutoModelForCausalLM.from_pretrained(str(ddp / "bcp" / "checkpoint-4"))
    stock = load_file(str(ddp / "stock" / "checkpoint-4" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in stock.items())


def test_final_save_model_writes_safetensors_from_pretrained_opens(ddp: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert (ddp / "final" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(ddp / "final"))
    want = dump(ddp / "bcp.pt")["weights"]
    got = model.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


# ---------------------------------------------------------------------------------------- FSDP (forced on CPU)

@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stock (SHARDED_STATE_DICT, which its resume needs) and attached (FULL_STATE_DICT: the stock
    Trainer's gathered model.safetensors in each folder; the state-dict type does not change training)."""
    t = tmp_path_factory.mktemp("tr_fsdp2")
    for name, extra in (("stock", ()), ("bcp", ("--attach", "async", "--state-dict-type", "FULL_STATE_DICT"))):
        launch(2, "--out", str(t / name), "--fsdp", "2", *extra, "--dump", str(t / f"{name}.pt"))
        launch(1, "--out", str(t / name), "--fsdp", "2", *extra, "--resume", str(t / name / "checkpoint-4"),
               "--dump", str(t / f"{name}_1.pt"))
    return t


def test_stock_fsdp_sharded_folder_resumes_without_fsdp(tmp_path: Path) -> None:
    """Switching: a run checkpointed by the stock Trainer (FSDP2 SHARDED_STATE_DICT on 2 processes:
    pytorch_model_fsdp_0/ and optimizer_0/ DCP folders, no attach) resumes with attach(trainer) on one
    process without FSDP, which the stock Trainer cannot (it looks for optimizer.pt), and trains on as
    the stock FSDP2 resume on one process does."""
    launch(2, "--out", str(tmp_path / "stock"), "--fsdp", "2", "--dump", str(tmp_path / "stock.pt"))
    folder = tmp_path / "stock" / "checkpoint-4"
    assert (folder / "pytorch_model_fsdp_0" / ".metadata").is_file() and (folder / "optimizer_0").is_dir()
    launch(1, "--out", str(tmp_path / "fsdp_1"), "--fsdp", "2", "--resume", str(folder),
           "--dump", str(tmp_path / "stock_1.pt"))
    launch(1, "--out", str(tmp_path / "plain_1"), "--attach", "sync", "--resume", str(folder),
           "--dump", str(tmp_path / "plain_1.pt"))
    assert_same_run(dump(tmp_path / "plain_1.pt"), dump(tmp_path / "stock_1.pt"), "stock FSDP2 folder -> 1 process")


@pytest.mark.slow  # make test-slow: other layouts of the same Trainer route
def test_fsdp2_saved_on_2_resumed_on_1_bit_exact_with_stock(fsdp2: Path) -> None:
    # Accelerate enables FSDP on GPU backends only; trainer_run.py forces its FSDP path on CPU/gloo
    assert_same_run(dump(fsdp2 / "bcp.pt"), dump(fsdp2 / "stock.pt"), "continuous FSDP2 run")
    assert_same_run(dump(fsdp2 / "bcp_1.pt"), dump(fsdp2 / "stock_1.pt"), "FSDP2 2 -> 1 resume")
    files = set(os.listdir(fsdp2 / "bcp" / "checkpoint-4"))
    assert "bytecheckpoint" in files and not any(f.startswith(("pytorch_model_fsdp", "optimizer")) for f in files)
    import bytecheckpoint as bcp

    assert bcp.inspect(str(fsdp2 / "bcp" / "checkpoint-4" / "bytecheckpoint")).world_size == 2  # every rank its part
    for step in (2, 4):  # FULL_STATE_DICT: the stock Trainer's model.safetensors, gathered from the 2 ranks' shards
        folder = fsdp2 / "bcp" / f"checkpoint-{step}"
        assert_gathered_weights(folder, bcp.load_full(str(folder / "bytecheckpoint"), keys=["model"])["model"],
                                f"FSDP2 checkpoint-{step}")
    # checkpoint-6, written again by the 1-process resume: its final weights
    assert_gathered_weights(fsdp2 / "bcp" / "checkpoint-6", dump(fsdp2 / "bcp_1.pt")["weights"], "FSDP2 x1 checkpoint-6")


@pytest.mark.slow  # make test-slow: other layouts of the same Trainer route
def test_fsdp1_saved_on_2_resumed_on_1_as_fsdp1_and_fsdp2(tmp_path: Path, ddp: Path) -> None:
    """FSDP1 (flat parameters): the attached run is the stock FSDP1 run bit for bit; resumed on 1
    process as FSDP1 and as FSDP2 it logs the losses of the stock DDP 2 -> 1 resume of the same
    script. (The stock FSDP1 SHARDED_STATE_DICT 2 -> 1 resume differs from those after its first
    resumed step; docs/transformers.md.) The FSDP1 resume sets FULL_STATE_DICT: its checkpoint-6 has
    the stock Trainer's gathered model.safetensors."""
    # FULL_STATE_DICT on 2 processes: torch's FSDP1 gather crashes on CPU (SIGSEGV cloning an unsharded
    # parameter in _full_post_state_dict_hook; the stock run too, every try here), on 1 process it runs.
    # The state-dict type does not change training.
    launch(2, "--out", str(tmp_path / "stock"), "--fsdp", "1", "--dump", str(tmp_path / "stock.pt"))
    launch(2, "--out", str(tmp_path / "o"), "--fsdp", "1", "--attach", "async", "--dump", str(tmp_path / "bcp.pt"))
    assert_same_run(dump(tmp_path / "bcp.pt"), dump(tmp_path / "stock.pt"), "continuous FSDP1 run")
    assert not (tmp_path / "o" / "checkpoint-4" / "model.safetensors").exists()  # SHARDED_STATE_DICT: as stock, none
    want = dump(ddp / "stock_1.pt")
    for version in ("1", "2"):
        full = ("--state-dict-type", "FULL_STATE_DICT") if version == "1" else ()
        launch(1, "--out", str(tmp_path / "o"), "--fsdp", version, *full, "--attach", "sync",
               "--resume", str(tmp_path / "o" / "checkpoint-4"), "--dump", str(tmp_path / f"bcp_1_{version}.pt"))
        got = dump(tmp_path / f"bcp_1_{version}.pt")
        assert got["losses"] == want["losses"], (version, got["losses"], want["losses"])
        assert got["info"]["global_step"] == 6
        if full:  # before the FSDP2 resume saves checkpoint-6 again
            assert_gathered_weights(tmp_path / "o" / "checkpoint-6", got["weights"], "FSDP1 x1 checkpoint-6")


# ---------------------------------------------------------------------------------------- DeepSpeed (CPU)

DS_ENV = {"DS_ACCELERATOR": "cpu"}
# DeepSpeed runs save asynchronously. They once failed 3 times in ~10 runs from a core bug, since
# fixed: checksums._pack_parsed, on the background commit thread, made every warning of the process an
# error for a moment (warnings.catch_warnings + simplefilter("error") are process-wide), and DeepSpeed's
# per-step FutureWarning then raised in the training thread (tests/unit/test_block_checksums.py).
DS_SAVE = "async"


def _assert_resumed_as_saved(tmp_path: Path, ddp: Path) -> dict:
    """DeepSpeed's full view right after the 1-process load equals the one at save, bit for bit, the
    run goes on as the stock DDP resume, and it ends at step 6; returns the resumed run's dump."""
    saved, loaded = dump(tmp_path / "save.pt")["views"]["saved"], dump(tmp_path / "load.pt")
    assert saved.keys() == loaded["views"]["loaded"].keys()
    for k in saved:
        assert torch.equal(loaded["views"]["loaded"][k], saved[k]), k
    assert loaded["losses"] == dump(ddp / "stock_1.pt")["losses"]
    assert loaded["info"]["global_step"] == 6
    return loaded


@pytest.mark.slow  # make test-slow
@pytest.mark.parametrize("save_stage,load_stage", [(2, 3), (3, 1)])
def test_deepspeed_saved_on_2_resumed_on_1_other_stage(tmp_path: Path, ddp: Path, save_stage: int, load_stage: int) -> None:
    """ZeRO-<save_stage> on 2 processes, resumed on 1 process as ZeRO-<load_stage> (the stock Trainer
    cannot: DeepSpeed's own checkpoint loads on the same world size and stage only). The fp32 master
    weights right after the load equal DeepSpeed's own full view at save time, bit for bit, and the
    resumed run is the stock DDP resume of the same script. Each folder has the model.safetensors the
    stock Trainer gathers (ZeRO-1/2; ZeRO-3 with stage3_gather_16bit_weights_on_model_save, set for
    the ZeRO-3 save) or, ZeRO-3 without the flag, none."""
    pytest.importorskip("deepspeed")
    gather = ("--ds-gather",) if save_stage == 3 else ()  # stage3_gather_16bit_weights_on_model_save
    launch(2, "--out", str(tmp_path / "o"), "--deepspeed", str(save_stage), *gather, "--attach", DS_SAVE,
           "--state-at", "4", "--dump", str(tmp_path / "save.pt"), env=DS_ENV)
    files = set(os.listdir(tmp_path / "o" / "checkpoint-4"))
    assert "bytecheckpoint" in files and not any(f.startswith("global_step") for f in files), files
    launch(1, "--out", str(tmp_path / "o"), "--deepspeed", str(load_stage), "--attach", "sync", "--state-at", "4",
           "--resume", str(tmp_path / "o" / "checkpoint-4"), "--dump", str(tmp_path / "load.pt"), env=DS_ENV)
    loaded = _assert_resumed_as_saved(tmp_path, ddp)
    saved = dump(tmp_path / "save.pt")["views"]["saved"]
    # the stock Trainer's model.safetensors, gathered from the ZeRO partitions (ZeRO-1/2; ZeRO-3 with the flag)
    assert_gathered_weights(tmp_path / "o" / "checkpoint-4", saved, f"ZeRO-{save_stage} x2 checkpoint-4")
    last = tmp_path / "o" / "checkpoint-6"  # written by the resumed run
    if load_stage == 3:  # without the flag: no weights file (stock: DeepSpeed's own checkpoint only)
        assert committed(last) and "config.json" in os.listdir(last)
        assert not any(f.endswith(".safetensors") for f in os.listdir(last)), sorted(os.listdir(last))
    else:
        assert_gathered_weights(last, loaded["weights"], f"ZeRO-{load_stage} x1 checkpoint-6")


def test_stock_deepspeed_folder_resumes_on_1_process_as_zero3(tmp_path: Path, ddp: Path) -> None:
    """Switching: a run checkpointed by the stock Trainer under ZeRO-2 on 2 processes (DeepSpeed's
    own global_step4/ folder) resumes attached on 1 process as ZeRO-3, which the stock Trainer
    cannot: DeepSpeed's full view right after the load equals the one at save, bit for bit, and the
    run goes on as the stock DDP resume of the same script."""
    pytest.importorskip("deepspeed")
    launch(2, "--out", str(tmp_path / "o"), "--deepspeed", "2", "--state-at", "4", "--dump", str(tmp_path / "save.pt"),
           env=DS_ENV)
    assert "global_step4" in os.listdir(tmp_path / "o" / "checkpoint-4")
    launch(1, "--out", str(tmp_path / "o"), "--deepspeed", "3", "--attach", "sync", "--state-at", "4",
           "--resume", str(tmp_path / "o" / "checkpoint-4"), "--dump", str(tmp_path / "load.pt"), env=DS_ENV)
    _assert_resumed_as_saved(tmp_path, ddp)


@pytest.mark.slow  # make test-slow: other layouts of the same Trainer route
def test_deepspeed_zero1_resumed_on_2_bit_exact_with_stock(tmp_path: Path) -> None:
    """Where the stock Trainer can resume (DeepSpeed's own checkpoint, same world size and stage):
    the attached ZeRO-1 resume is the same run, bit for bit (fp32 master weights, losses, step)."""
    pytest.importorskip("deepspeed")
    for name, extra in (("stock", ()), ("bcp", ("--attach", DS_SAVE))):
        o = tmp_path / name
        launch(2, "--out", str(o), "--deepspeed", "1", *extra, "--dump", str(tmp_path / f"{name}.pt"), env=DS_ENV)
        launch(2, "--out", str(o), "--deepspeed", "1", *extra, "--resume", str(o / "checkpoint-4"),
               "--dump", str(tmp_path / f"{name}_2.pt"), env=DS_ENV)
    assert any(f.startswith("global_step") for f in os.listdir(tmp_path / "stock" / "checkpoint-4"))
    from safetensors.torch import load_file

    for step in (2, 4, 6):  # the stock folder's model.safetensors, written the stock way (6: by the resumed run)
        ours, stock = (load_file(str(tmp_path / d / f"checkpoint-{step}" / "model.safetensors")) for d in ("bcp", "stock"))
        assert ours.keys() == stock.keys() and all(torch.equal(ours[k], stock[k]) for k in stock), step
    assert_gathered_weights(tmp_path / "bcp" / "checkpoint-6", dump(tmp_path / "bcp_2.pt")["weights"], "ZeRO-1 checkpoint-6")
    assert_same_run(dump(tmp_path / "bcp.pt"), dump(tmp_path / "stock.pt"), "continuous ZeRO-1 run")
    assert_same_run(dump(tmp_path / "bcp_2.pt"), dump(tmp_path / "stock_2.pt"), "ZeRO-1 2 -> 2 resume")
