"""Accelerate adapter, tested with real processes (torchrun / python, gloo on CPU).

Each scenario is a subprocess with a hard timeout; on timeout its whole process group is killed
and the test fails with the output tail, so nothing hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "accelerate_scripts"
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120
DEFAULT_FILES = ("model.safetensors", "model_1.safetensors", "pytorch_model.bin", "optimizer.bin", "optimizer_1.bin")



def launch(nproc: int, script: str, *args: str, timeout: float = TIMEOUT_S, cuda: bool = False) -> str:
    """Run a scenario with torchrun (nproc >= 1) or plain python (nproc == 0: no process group)."""
    if nproc == 0:
        cmd = [sys.executable, str(SCRIPTS / script), *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--max_restarts=0", "--monitor_interval=0.5", str(SCRIPTS / script), *args,
        ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker it started
        out, _ = proc.communicate()
        pytest.fail(f"{script} x{nproc} timed out after {timeout}s:\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{script} x{nproc} exited {proc.returncode}:\n{out[-8000:]}")
    return out


def load_dump(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def run_resume(tmp: Path, save_procs: int, load_procs: int, *save_args: str, width: int = 32) -> Path:
    ckpt, out = tmp / "ckpt", tmp / "out"
    out.mkdir(parents=True)
    common = ("--ckpt", str(ckpt), "--out", str(out), "--width", str(width))
    launch(save_procs, "train_resume.py", "--mode", "save", *common, *save_args)
    launch(load_procs, "train_resume.py", "--mode", "load", *common)
    return tmp


def assert_tensors_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), f"{what}[{k}] differs"
        elif isinstance(a[k], dict):
            assert_tensors_equal(a[k], b[k], f"{what}[{k}]")
        else:
            assert a[k] == b[k], f"{what}[{k}]: {a[k]!r} != {b[k]!r}"


def rng_equal(a: dict, b: dict) -> bool:
    np_a, np_b = a["numpy"], b["numpy"]
    return (
        torch.equal(a["torch"], b["torch"])
        and a["random"] == b["random"]
        and all((x == y).all() if hasattr(x, "shape") else x == y for x, y in zip(np_a, np_b))
    )


def check_resume(tmp: Path, save_procs: int, load_procs: int) -> None:
    out = tmp / "out"
    saved = [load_dump(out / f"saved_{r}.pt") for r in range(max(save_procs, 1))]
    loaded = [load_dump(out / f"loaded_{r}.pt") for r in range(max(load_procs, 1))]
    for r, got in enumerate(loaded):
        ref = saved[r] if r < len(saved) else saved[0]
        assert got["world_size"] == max(load_procs, 1)
        for key in ("model", "model_1"):
            assert_tensors_equal(got["models"][key], ref["models"][key], f"rank{r} weights {key}")
            assert_tensors_equal(got["optim"][key]["state"], ref["optim"][key]["state"], f"rank{r} optimizer {key}")
            assert got["optim"][key]["groups"] == ref["optim"][key]["groups"], f"rank{r} param_groups {key}"
        assert got["scheduler"] == ref["scheduler"], f"rank{r} scheduler"
        assert got["counter"] == ref["counter"], f"rank{r} custom object"
        assert got["step"] == ref["step"], f"rank{r} accelerator.step"
        if r < len(saved):  # ranks that existed when saving get their own RNG back
            assert rng_equal(got["rng"], ref["rng"]), f"rank{r} RNG state"
    # exp_avg of AdamW really is there (not a trivially-equal empty state)
    assert saved[0]["optim"]["model"]["state"]["inp.weight"]["exp_avg"].abs().sum() > 0


@pytest.fixture(scope="module")
def two_to_one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_resume(tmp_path_factory.mktemp("acc_2to1"), 2, 1)


@pytest.fixture(scope="module")
def one_to_two_async(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # saved by ONE process without any process group, async, mutating right after save_state
    return run_resume(tmp_path_factory.mktemp("acc_1to2"), 0, 2, "--async-save", "--mutate-after-save", width=512)


def test_resume_two_procs_to_one(two_to_one: Path) -> None:
    check_resume(two_to_one, 2, 1)


def test_default_model_and_optimizer_files_not_written(two_to_one: Path) -> None:
    import bytecheckpoint as bcp

    ckpt = two_to_one / "ckpt"
    files = set(os.listdir(ckpt))
    assert not files & set(DEFAULT_FILES), f"Accelerate's own model/optimizer files written: {files}"
    assert not any(f.startswith("pytorch_model_fsdp") or f.startswith("optimizer_") for f in files), files
    # what Accelerate still handles itself
    assert {"scheduler.bin", "random_states_0.pkl", "random_states_1.pkl", "custom_checkpoint_0.pkl"} <= files, files
    assert bcp.is_checkpoint(str(ckpt / "bytecheckpoint"))


def test_async_resume_one_proc_to_two_with_mutation_after_save(one_to_two_async: Path) -> None:
    # saved_*.pt is the state at save_state time; the saving run then mutated params and optimizer
    # moments in place and trained on before waiting, so equality proves the snapshot was taken.
    check_resume(one_to_two_async, 0, 2)
    info = json.loads((one_to_two_async / "out" / "save_info_0.json").read_text())
    print("async save:", info)


def test_automatic_naming_total_limit_remove_and_legacy(tmp_path: Path) -> None:
    import bytecheckpoint as bcp

    out = launch(2, "auto_naming.py", str(tmp_path / "project"))
    assert "AUTO_NAMING_OK" in out, out[-4000:]
    assert bcp.is_checkpoint(str(tmp_path / "project" / "last" / "bytecheckpoint")), "end_training did not wait"


def test_attach_rejects_non_accelerator() -> None:
    from accelerate_bytecheckpoint import attach

    with pytest.raises(TypeError, match="expects an accelerate.Accelerator"):
        attach(object())


def run_fsdp2(tmp: Path, save_procs: int, load_procs: int, *extra: str, cuda: bool) -> None:
    ckpt, out = tmp / "ckpt", tmp / "out"
    out.mkdir()
    launch(save_procs, "fsdp2_resume.py", "save", str(ckpt), str(out), *extra, cuda=cuda, timeout=240)
    launch(load_procs, "fsdp2_resume.py", "load", str(ckpt), str(out), *extra, cuda=cuda, timeout=240)
    saved, loaded = load_dump(out / "saved_0.pt"), load_dump(out / "loaded_0.pt")
    assert_tensors_equal(loaded["model"], saved["model"], "fsdp2 weights")
    assert_tensors_equal(loaded["optim"], saved["optim"], "fsdp2 optimizer")
    assert saved["optim"], "no optimizer state was dumped"
    files = os.listdir(ckpt)
    assert not set(files) & set(DEFAULT_FILES), files
    assert not any(f.startswith(("pytorch_model_fsdp", "optimizer_")) for f in files), files


def test_fsdp2_resume_two_to_one_cpu_forced(tmp_path: Path) -> None:
    # Accelerate enables FSDP only on GPU backends; the script forces DistributedType.FSDP with an
    # fsdp_version=2 plugin on CPU/gloo so the DTensor path (sharded save, 2 -> 1 reshard) and
    # Accelerate's FSDP branches of save_state/load_state run here too.
    run_fsdp2(tmp_path, 2, 1, "--force-cpu", cuda=False)


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="FSDP2 through Accelerate needs CUDA GPUs")
def test_fsdp2_resume_gpu(tmp_path: Path) -> None:
    run_fsdp2(tmp_path, min(torch.cuda.device_count(), 2), 1, cuda=True)
