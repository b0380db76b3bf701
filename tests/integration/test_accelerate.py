"""Accelerate adapter, tested with real processes (torchrun / python, gloo on CPU).

Each scenario is a subprocess with a hard timeout; on timeout its whole process group is killed
and the test fails with the output tail, so nothing hangs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List

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


def launch_nodes(nodes: int, script: str, *args: str, timeout: float = TIMEOUT_S) -> List[str]:
    """Run `nodes` processes of one process group, each the only (local main) process of its
    "node" (LOCAL_RANK=0 for all): node-local directories and save_on_each_node on one machine."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", WORLD_SIZE=str(nodes),
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / script), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**env, "RANK": str(r)}, start_new_session=True)
             for r in range(nodes)]
    outs: List[str] = []
    failed = None
    try:
        deadline = time.monotonic() + timeout
        for r, proc in enumerate(procs):
            try:
                outs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                failed = f"rank {r} timed out after {timeout}s"
                break
            if proc.returncode != 0:
                failed = f"rank {r} exited {proc.returncode}"
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    if failed is not None:
        tails = [(p.communicate()[0] or "") if i >= len(outs) else outs[i] for i, p in enumerate(procs)]
        pytest.fail(f"{script} on {nodes} nodes: {failed}:\n" + "\n".join(
            f"--- rank {i} ---\n{t[-5000:]}" for i, t in enumerate(tails)))
    return outs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_automatic_naming_total_limit_remove_legacy_and_node_local_dirs(tmp_path: Path) -> None:
    import bytecheckpoint as bcp

    # two single-process "nodes", so that save_on_each_node / node-local directories are real
    outs = launch_nodes(2, "auto_naming.py", str(tmp_path / "project"), timeout=240)  # many saves: slow under load
    assert "AUTO_NAMING_OK" in outs[0] and "NODE_LOCAL_OK" in outs[0], outs[0][-4000:]
    assert bcp.is_checkpoint(str(tmp_path / "project" / "last" / "bytecheckpoint")), "end_training did not wait"


def test_attach_rejects_non_accelerator() -> None:
    from accelerate_bytecheckpoint import attach

    with pytest.raises(TypeError, match="expects an accelerate.Accelerator"):
        attach(object())


def run_fsdp(tmp: Path, save_procs: int, load_procs: int, save_args=(), load_args=(), *, cuda: bool) -> str:
    ckpt, out = tmp / "ckpt", tmp / "out"
    out.mkdir()
    save_out = launch(save_procs, "fsdp_resume.py", "save", str(ckpt), str(out), *save_args, cuda=cuda, timeout=240)
    launch(load_procs, "fsdp_resume.py", "load", str(ckpt), str(out), *load_args, cuda=cuda, timeout=240)
    saved, loaded = load_dump(out / "saved_0.pt"), load_dump(out / "loaded_0.pt")
    assert_tensors_equal(loaded["model"], saved["model"], "fsdp weights")
    assert_tensors_equal(loaded["optim"], saved["optim"], "fsdp optimizer")
    assert saved["optim"], "no optimizer state was dumped"
    files = os.listdir(ckpt)
    assert not set(files) & set(DEFAULT_FILES), files
    assert not any(f.startswith(("pytorch_model_fsdp", "optimizer_")) for f in files), files
    return save_out


def test_fsdp2_resume_two_to_one_cpu_forced_and_main_only_save_is_bounded(tmp_path: Path) -> None:
    # Accelerate enables FSDP only on GPU backends; the script forces DistributedType.FSDP with an
    # fsdp_version=2 plugin on CPU/gloo so the DTensor path (sharded save, 2 -> 1 reshard) and
    # Accelerate's FSDP branches of save_state/load_state run here too.
    # Then diffusers' `if accelerator.is_main_process: save_state(d)` + wait_for_everyone() with
    # this sharded state: the main process raises PeerTimeoutError within its timeout_s (5 s),
    # the other process's barrier fails once the main process has gone; nobody hangs.
    forced = ("--force-cpu", "--fsdp-version", "2")
    out = run_fsdp(tmp_path, 2, 1, (*forced, "--main-only-then-fail"), forced, cuda=False)
    found = re.search(r"MAIN PeerTimeoutError after ([0-9.]+) s: (.*)", out)
    assert found, out[-6000:]
    assert 4.5 <= float(found.group(1)) < 60, found.group(0)
    assert "FSDP state is collective" in found.group(2) and "is_main_process" in found.group(2), found.group(2)
    assert re.search(r"OTHER ERROR after [0-9.]+ s", out), out[-6000:]
    assert os.listdir(tmp_path / "ckpt_main_only") == [], "the refused save wrote something"


def _engine_has_fsdp1() -> bool:
    from accelerate_bytecheckpoint import _routes

    return _routes.engine_has_fsdp1()


@pytest.mark.skipif(not _engine_has_fsdp1(), reason="this bytecheckpoint has no FSDP1 support (branch fsdp)")
def test_fsdp1_default_plugin_two_to_one_cpu_forced_into_fsdp1_and_fsdp2(tmp_path: Path) -> None:
    # Accelerate's default FullyShardedDataParallelPlugin() (fsdp_version=1), forced on CPU/gloo:
    # saved on 2 processes with SHARDED_STATE_DICT set, and again with FULL_STATE_DICT set;
    # the first resumes on 1 process as FSDP1, the second as FSDP2.
    ckpt, full, out = tmp_path / "ckpt", tmp_path / "full", tmp_path / "out"
    out.mkdir()
    launch(2, "fsdp_resume.py", "save", str(ckpt), str(out), "--force-cpu", "--state-dict-type", "SHARDED_STATE_DICT",
           "--also-full-to", str(full), timeout=240)
    launch(1, "fsdp_resume.py", "load", str(ckpt), str(out), "--force-cpu", "--tag", "fsdp1", timeout=240)
    launch(1, "fsdp_resume.py", "load", str(full), str(out), "--force-cpu", "--fsdp-version", "2", "--tag", "fsdp2",
           timeout=240)
    saved = load_dump(out / "saved_0.pt")
    assert saved["optim"], "no optimizer state was dumped"
    for tag in ("fsdp1", "fsdp2"):
        loaded = load_dump(out / f"loaded_{tag}.pt")
        assert_tensors_equal(loaded["model"], saved["model"], f"{tag} weights")
        assert_tensors_equal(loaded["optim"], saved["optim"], f"{tag} optimizer")
    for d in (ckpt, full):
        files = os.listdir(d)
        assert not any(f.startswith(("pytorch_model", "optimizer", "model")) for f in files), files


def test_stock_fsdp_sharded_folders_resume_on_one_plain_process_and_on_fsdp(tmp_path: Path) -> None:
    """Switching: a run checkpointed by stock Accelerate (FSDP2 SHARDED_STATE_DICT on 2 processes:
    pytorch_model_fsdp_0/ and optimizer_0/ DCP folders, no attach) resumes with an attached
    accelerator on one process without FSDP (stock load_state cannot) and on FSDP at 1 process."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    forced = ("--force-cpu", "--fsdp-version", "2")
    launch(2, "fsdp_resume.py", "save", str(ckpt), str(out), *forced, "--state-dict-type", "SHARDED_STATE_DICT",
           "--stock", timeout=240)
    assert (ckpt / "pytorch_model_fsdp_0" / ".metadata").is_file() and (ckpt / "optimizer_0" / ".metadata").is_file()
    launch(1, "fsdp_resume.py", "load", str(ckpt), str(out), "--plain", "--tag", "plain", timeout=240)
    launch(1, "fsdp_resume.py", "load", str(ckpt), str(out), *forced, "--tag", "fsdp", timeout=240)
    saved = load_dump(out / "saved_0.pt")
    assert saved["optim"], "no optimizer state was dumped"
    for tag in ("plain", "fsdp"):
        loaded = load_dump(out / f"loaded_{tag}.pt")
        assert_tensors_equal(loaded["model"], saved["model"], f"stock FSDP(2) -> {tag}: weights")
        assert_tensors_equal(loaded["optim"], saved["optim"], f"stock FSDP(2) -> {tag}: optimizer")


def test_leaving_convert_layout_accelerate_resumes_in_stock_accelerate(tmp_path: Path) -> None:
    """Leaving: an attached FSDP2 save_state on 2 processes, `bytecheckpoint convert --layout accelerate`,
    and stock Accelerate (no attach, FSDP2 SHARDED_STATE_DICT) load_state resumes it on 2 processes
    with the saved weights and optimizer state."""
    ckpt, conv, out = tmp_path / "ckpt", tmp_path / "converted", tmp_path / "out"
    out.mkdir()
    forced = ("--force-cpu", "--fsdp-version", "2", "--state-dict-type", "SHARDED_STATE_DICT")
    launch(2, "fsdp_resume.py", "save", str(ckpt), str(out), *forced, timeout=240)
    done = subprocess.run([sys.executable, "-m", "bytecheckpoint", "convert", str(ckpt / "bytecheckpoint"), str(conv),
                           "--to", "dcp", "--layout", "accelerate"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(os.listdir(conv))
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(files) and "bytecheckpoint" not in files, files
    assert any(f.startswith("random_states_") for f in files), files   # Accelerate's own files come along
    launch(2, "fsdp_resume.py", "load", str(conv), str(out), *forced, "--stock", "--tag", "stock", timeout=240)
    saved, loaded = load_dump(out / "saved_0.pt"), load_dump(out / "loaded_stock.pt")
    assert saved["optim"], "no optimizer state was dumped"
    assert_tensors_equal(loaded["model"], saved["model"], "converted -> stock Accelerate: weights")
    assert_tensors_equal(loaded["optim"], saved["optim"], "converted -> stock Accelerate: optimizer")


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="FSDP through Accelerate needs CUDA GPUs")
def test_fsdp2_resume_gpu(tmp_path: Path) -> None:
    run_fsdp(tmp_path, min(torch.cuda.device_count(), 2), 1, ("--fsdp-version", "2"), ("--fsdp-version", "2"),
             cuda=True)


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="FSDP through Accelerate needs CUDA GPUs")
@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
@pytest.mark.parametrize("load_version", ["1", "2"])
def test_fsdp1_default_plugin_resume_gpu(tmp_path: Path, state_dict_type: str, load_version: str) -> None:
    # FullyShardedDataParallelPlugin() with no fsdp_version: Accelerate's default, FSDP1; resumed
    # on another process count where there are 2 GPUs, as FSDP1 and as FSDP2
    n = torch.cuda.device_count()
    run_fsdp(tmp_path, min(n, 2), 1 if n >= 2 else n, ("--state-dict-type", state_dict_type),
             ("--fsdp-version", load_version), cuda=True)


@pytest.mark.skipif(_engine_has_fsdp1(), reason="the engine has FSDP1 support")
def test_fsdp1_refused_clearly_without_engine_support() -> None:
    # until the engine's FSDP1 support (branch fsdp) is installed, FSDP1 is refused by name
    import types

    from accelerate_bytecheckpoint import _routes

    fsdp1 = types.SimpleNamespace(distributed_type=types.SimpleNamespace(name="FSDP"), is_fsdp2=False)
    with pytest.raises(NotImplementedError, match="FSDP1 .*fsdp_version=2"):
        _routes.route_for(fsdp1, [])


# ---------------------------------------------------------------- calling patterns (diffusers & co)

@pytest.fixture(scope="module")
def patterns(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("acc_patterns")
    launch(2, "diffusers_pattern.py", "save", str(out))
    launch(0, "diffusers_pattern.py", "resume", str(out))
    return out


def assert_same(a, b, what: str) -> None:
    """Bit-for-bit equality of nested dicts / lists / tensors / plain values."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), f"{what} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", ["main", "every", "collective"])
def test_diffusers_pattern_resumes_bit_for_bit_like_accelerate(patterns: Path, name: str) -> None:
    # main:       `if accelerator.is_main_process: save_state(d)` then wait_for_everyone()  (diffusers)
    # every:      save_state(d) on every process                                         (Accelerate, transformers)
    # collective: attach(acc, collective_save=True), save_state(d) on every process
    # Saved on 2 processes, resumed on 1, 3 more steps: weights (the hook-saved unet and the
    # bytecheckpoint-saved text encoder), EMA, optimizer, scheduler, RNG equal Accelerate's own run.
    reference = load_dump(patterns / "final_default.pt")
    got = load_dump(patterns / f"final_{name}.pt")
    assert reference["optimizer"]["state"] and reference["ema"]["steps"] == 7
    assert_same(got, reference, name)


def test_diffusers_pattern_hooks_decide_what_bytecheckpoint_saves(patterns: Path) -> None:
    import bytecheckpoint as bcp

    info = json.loads((patterns / "save_info.json").read_text())
    # replicated state: the main process writes alone unless collective_save=True
    assert info["world_size"] == {"main": 1, "every": 1, "collective": 2}
    for name in ("main", "every", "collective"):
        d = patterns / name
        files = set(os.listdir(d))
        assert {"unet", "bytecheckpoint", "scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"} <= files
        assert not files & set(DEFAULT_FILES), files
        assert ("random_states_1.pkl" in files) == (name != "main"), files  # RNG: each calling process, as Accelerate
        tensors = [t.name for t in bcp.inspect(str(d / "bytecheckpoint")).tensors]
        # the save hook popped the unet's weights: only the text encoder (model index 0) and the
        # optimizer are in bytecheckpoint; the unet is in unet/ (save_pretrained)
        assert any(k.startswith("model/") for k in tensors), sorted(tensors)[:10]
        assert not any(k.startswith("model_1/") for k in tensors), sorted(tensors)[:10]
        assert any(k.startswith("optimizer/") for k in tensors)
    default = set(os.listdir(patterns / "default"))
    assert {"optimizer.bin", "unet"} <= default and "bytecheckpoint" not in default, default
    assert default & {"model.safetensors", "pytorch_model.bin"}, default  # .bin before accelerate 0.25


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])  # ZeRO-2: the stock-folder test
def test_deepspeed_save_state_on_every_process_resumes_on_1_and_3(tmp_path: Path, stage: int, monkeypatch) -> None:
    """DeepSpeedPlugin(zero_stage=2 or 3) on 2 CPU processes: save_state on every process writes the
    engines' own partitions (no DeepSpeed files); load_state on 1 and on 3 processes restores fp32
    master weights and Adam moments equal to DeepSpeed's own full view at save time."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    out = launch(2, "deepspeed_resume.py", "--mode", "save", "--dir", str(tmp_path), "--stage", str(stage))
    assert "FILES ['bytecheckpoint', 'random_states_0.pkl', 'random_states_1.pkl']" in out, out[-3000:]
    for n in (1, 3):
        out = launch(n, "deepspeed_resume.py", "--mode", "load", "--dir", str(tmp_path), "--stage", str(stage))
        assert f"LOADED OK on {n}" in out, out[-3000:]


def test_stock_deepspeed_folders_resume_on_another_process_count(tmp_path, monkeypatch):
    """save_state without attach (Accelerate's own DeepSpeed folder, ZeRO-2 on 2 processes), then
    load_state with attach on 1 and 3 processes as ZeRO-3, which DeepSpeed's own loader cannot:
    fp32 master weights and Adam moments equal DeepSpeed's full view at save time."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    out = launch(2, "deepspeed_resume.py", "--mode", "save", "--dir", str(tmp_path), "--stage", "2", "--stock")
    assert "'pytorch_model'" in out and "bytecheckpoint" not in out.split("FILES", 1)[1][:200], out[-3000:]
    for n in (1, 3):
        out = launch(n, "deepspeed_resume.py", "--mode", "load", "--dir", str(tmp_path), "--stage", "3")
        assert f"LOADED OK on {n}" in out, out[-3000:]
