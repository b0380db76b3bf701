"""ByteCheckpointIO with a real 2-process DDP Trainer on CPU (gloo), and ddp_spawn.

Each multi-process run is this file executed as a script (Lightning's launcher starts rank 1 by
re-running it), in its own session with a hard timeout: a hang kills the whole process group
and fails the test. Saves from DDP resume on 1 device, and 1-device saves resume on 2 processes,
with weights, optimizer moments, LR schedule, loop progress and global_step as saved. DDP state
is replicated: Lightning calls the plugin on rank 0 only, which saves it alone (bcp.LOCAL).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_lightning import Net, assert_resumed, assert_same, dataloader, make_trainer  # noqa: E402

RUN_TIMEOUT_S = 150


def _script(argv: list[str]) -> None:
    """One training run; every rank writes what it saved, loaded and restored to OUT/rank{r}.pt."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_bytecheckpoint import ByteCheckpointIO

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--resume")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--spawn", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)

    torch.set_num_threads(1)
    pl.seed_everything(7)
    model = Net()
    strategy = DDPStrategy(timeout=timedelta(seconds=60), start_method="spawn" if args.spawn else "popen")
    trainer = make_trainer(
        out, plugins=[ByteCheckpointIO(async_save=args.async_save)], devices=args.devices,
        strategy=strategy, max_steps=args.max_steps, max_epochs=-1,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpts", filename="{step}", every_n_train_steps=args.every,
                                   save_top_k=-1)],
    )
    trainer.fit(model, dataloader(), ckpt_path=args.resume)
    if args.spawn:  # main process: the spawn launcher loaded the final weights through the plugin
        torch.save({"weights": {k: v.clone() for k, v in model.state_dict().items()},
                    "threads": [t.name for t in __import__("threading").enumerate()]}, out / "main.pt")
        return
    torch.save(
        {"snapshots": model.snapshots, "loaded": model.loaded, "restored": model.restored,
         "world_size": trainer.world_size, "global_step": trainer.global_step},
        out / f"rank{trainer.global_rank}.pt",
    )


def run_ddp(out: Path, *args: str, script: str = __file__, nprocs: int = 2, reports: bool = True,
            capture: bool = False):
    """Run ``script`` (default: this file) as a DDP job; return each rank's report (``capture``:
    its output instead)."""
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "BCP_COLLECTIVE_TIMEOUT_S": "60", "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen(
        [sys.executable, script, "--out", str(out), *args], env=env, cwd=str(HERE),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"DDP run timed out after {RUN_TIMEOUT_S}s (hang?):\n{log[-6000:]}") from None
    finally:
        try:  # rank 1 is a child of rank 0 in the same session: never leave it behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"DDP run failed (rc={proc.returncode}):\n{log[-6000:]}"
    if capture:
        return log
    if not reports:
        return []
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


if __name__ == "__main__":
    from _leave import leave

    _script(sys.argv[1:])
    leave(0)

if __name__ == "__mp_main__":  # a ddp_spawn worker: Lightning's launcher re-imports this file in it
    # A worker whose job is done (results sent to the main process) leaves without finalizing, as
    # the main process does: Lightning never destroys its gloo group, whose threads race Python's
    # finalization (tests/integration/_leave.py; seen here as an abort at a worker's exit, rc -6).
    import atexit

    from _leave import leave
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    _run_worker = _MultiProcessingLauncher._wrapping_function

    def _run_worker_then_leave(self, *args, **kwargs):
        _run_worker(self, *args, **kwargs)
        atexit.register(leave, 0)  # only after a clean return: a failing worker keeps its exit code

    _MultiProcessingLauncher._wrapping_function = _run_worker_then_leave

# ----------------------------------------------------------------------------------- the tests

import bytecheckpoint as bcp  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_bytecheckpoint import ByteCheckpointIO  # noqa: E402

pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)


@pytest.fixture(scope="module")
def one_then_ddp(tmp_path_factory):
    """A 1-device run saves at step 5; a 2-process DDP run resumes from it, trains to step 7 and
    saves (async) at step 6. One DDP job serves both directions (process start-up dominates)."""
    root = tmp_path_factory.mktemp("one_then_ddp")
    pl.seed_everything(11)
    model = Net()
    trainer = make_trainer(
        root / "one", plugins=[ByteCheckpointIO()], max_steps=5, max_epochs=-1,
        callbacks=[ModelCheckpoint(dirpath=root / "one" / "ckpts", filename="{step}", every_n_train_steps=5)],
    )
    trainer.fit(model, dataloader())
    one_ckpt = root / "one" / "ckpts" / "step=5.ckpt"
    ranks = run_ddp(root / "ddp", "--max-steps", "7", "--every", "6", "--resume", str(one_ckpt), "--async-save")
    return model.snapshots, ranks, root / "ddp" / "ckpts"


def test_one_device_checkpoint_resumes_on_two_processes(one_then_ddp):
    one_snapshots, ranks, _ = one_then_ddp
    expected_live = {k: v for k, v in one_snapshots[5].items() if k != "loops"}
    for rank, report in enumerate(ranks):
        assert report["world_size"] == 2
        assert_same(report["loaded"], one_snapshots[5], f"rank {rank} (loaded)")
        assert_same(report["restored"], expected_live, f"rank {rank} (live)")
        assert report["global_step"] == 7


def test_ddp_saves_from_rank_zero_alone_and_resumes_on_one_device(one_then_ddp, tmp_path):
    _, ranks, ckpts = one_then_ddp
    assert sorted(p.name for p in ckpts.iterdir()) == ["step=6.ckpt"]
    saved = ranks[0]["snapshots"][6]
    assert_same(ranks[1]["snapshots"][6]["state_dict"], saved["state_dict"], "DDP replicas")

    info = bcp.inspect(str(ckpts / "step=6.ckpt"))
    assert info.complete and info.world_size == 1  # replicated state, saved by rank 0 alone (bcp.LOCAL)

    pl.seed_everything(123)
    model = Net()
    trainer = make_trainer(tmp_path, plugins=[ByteCheckpointIO()], max_steps=8, max_epochs=-1)
    trainer.fit(model, dataloader(), ckpt_path=str(ckpts / "step=6.ckpt"))
    assert_resumed(model, saved, "DDP(2) -> 1 device")
    assert trainer.global_step == 8


def test_ddp_spawn_final_weights_go_through_the_plugin(tmp_path):
    """ddp_spawn: at the end of fit the launcher saves the final weights on rank 0 only through
    the CheckpointIO (.temp.ckpt) and loads them in the main process. No collective, no hang;
    the main process's model ends with the trained weights and no engine thread left."""
    run_ddp(tmp_path, "--max-steps", "3", "--every", "2", "--spawn", "--async-save", reports=False)
    main = torch.load(tmp_path / "main.pt", weights_only=False)
    saved = bcp.load_full(str(tmp_path / "ckpts" / "step=2.ckpt"), keys=["state_dict"])["state_dict"]
    assert set(main["weights"]) == set(saved)
    assert any(not torch.equal(main["weights"][k], saved[k]) for k in saved)  # trained one step further
    assert not [t for t in main["threads"] if t.startswith("bytecheckpoint")], main["threads"]
