"""The local tier under Lightning, as a failure: a 2-process DDP Trainer simulating 2 nodes x 1
rank (each node its own local directory) saves to the local tier every step (replicas=1) and
persistently every 4 steps through ModelCheckpoint. Node 1's process is killed (-9) at a random
step and its local directory deleted; a restart on one process resumes with
``ckpt_path=resume_path(...)`` from the newest step node 0 holds completely (its own part and node
1's replica), bit-exact, with every persistent chunk read failing. With replicas=0 the same
restart falls back to the newest persistent checkpoint and says why.

Each run is this file executed as a script (Lightning's launcher starts rank 1 by re-running it),
in its own session with a hard timeout (run_ddp)."""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_lightning import Net, assert_same, current_state, dataloader, make_trainer  # noqa: E402
from test_lightning_ddp import RUN_TIMEOUT_S, run_ddp  # noqa: E402

PERSIST_EVERY = 4


def newest_local(node_dir: Path):
    """The newest step committed in a node's local directory (read as a user would look)."""
    steps = [json.loads(m.read_text())["info"].get("step") for m in node_dir.glob("bcp-local/*/*/local-metadata.json")]
    return max(steps) if steps else None


def _script(argv: list[str]) -> None:
    import bytecheckpoint as bcp
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_bytecheckpoint import ByteCheckpointIO, LocalTierCheckpoint, resume_path

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    run = Path(args.out)
    torch.set_num_threads(1)

    class Reference(Callback):
        """Rank 0 writes the state of every step (the test's oracle); node 1 dies at --kill-at."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if trainer.global_rank == 0 and not args.resume:
                torch.save(current_state(trainer), run / "ref" / f"step_{step}.pt")
            if trainer.global_rank == 1 and step == args.kill_at:
                # killed after an observed commit, not after a sleep (a loaded CI machine may lag):
                # the previous step is committed on node 0; this step's local save is in flight
                deadline = time.monotonic() + 60
                while (newest_local(run / "local" / "node0") or 0) < step - 1 and time.monotonic() < deadline:
                    time.sleep(0.02)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_start(self, trainer, pl_module):
            if args.resume:
                torch.save({"step": trainer.global_step, "state": current_state(trainer)}, run / "resumed.pt")

    tier = bcp.LocalTier(dir=str(run / "local" / "node{node}"), replicas=args.replicas, keep=3, node=lambda r: r)
    ckpt = bcp.Checkpointer.from_env(local_tier=tier, dead_peer_s=10, timeout_s=60)
    (run / "ref").mkdir(parents=True, exist_ok=True)
    pl.seed_everything(5 if not args.resume else 77)   # the restart's init and RNG must not matter
    strategy = DDPStrategy(timeout=timedelta(seconds=30)) if args.devices > 1 else "auto"
    trainer = make_trainer(
        run, plugins=[ByteCheckpointIO(checkpointer=ckpt)], devices=args.devices, strategy=strategy,
        max_steps=args.max_steps, max_epochs=-1,
        callbacks=[Reference(), LocalTierCheckpoint(every_n_train_steps=1),
                   ModelCheckpoint(dirpath=run / "persistent", filename="{step}", every_n_train_steps=PERSIST_EVERY,
                                   save_top_k=-1)],
    )
    trainer.fit(Net(), dataloader(), ckpt_path=resume_path(run / "persistent") if args.resume else None)
    ckpt.close()


if __name__ == "__main__":
    from _leave import leave

    _script(sys.argv[1:])
    leave(0)

# ----------------------------------------------------------------------------------- the tests

import bytecheckpoint as bcp  # noqa: E402
import pytest  # noqa: E402


pytestmark = pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
SEED = int(os.environ.get("BCP_LOCAL_TIER_SEED", str(int(time.time()) % 10000)))


def _lose_node_1(run: Path, replicas: int) -> int:
    kill_at = random.Random(SEED + replicas).randint(PERSIST_EVERY + 2, 9)
    try:
        run_ddp(run, "--replicas", str(replicas), "--max-steps", "12", "--kill-at", str(kill_at), script=__file__,
                reports=False)
    except AssertionError as exc:   # node 0's rank fails on its next collective with the dead peer
        assert "timed out" not in str(exc), exc
    else:
        raise AssertionError("the run survived the loss of node 1")
    shutil.rmtree(run / "local" / "node1", ignore_errors=True)   # node 1's disk is gone too
    return kill_at


def _resume(run: Path, replicas: int, env: dict | None = None) -> dict:
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        log = run_ddp(run, "--replicas", str(replicas), "--max-steps", "14", "--devices", "1", "--resume", script=__file__,
                      reports=False, capture=True)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    resumed = torch.load(run / "resumed.pt", weights_only=False)
    ref = torch.load(run / "ref" / f"step_{resumed['step']}.pt", weights_only=False)
    assert_same(resumed["state"], ref, f"resumed at step {resumed['step']}")
    return {"step": resumed["step"], "log": log}


def test_lightning_lost_node_resumes_from_the_local_tier_on_one_process(tmp_path):
    kill_at = _lose_node_1(tmp_path, replicas=1)
    expected = newest_local(tmp_path / "local" / "node0")
    assert expected is not None and expected >= kill_at - 1, (expected, kill_at, SEED)
    faults = {"BCP_FAULTS": json.dumps([{"op": "read", "kind": "error", "key": "/pack/"}])}
    got = _resume(tmp_path, replicas=1, env=faults)
    assert got["step"] == expected, (got["step"], expected, kill_at, SEED)
    assert f"resuming from the local checkpoint step_{expected}" in got["log"], got["log"][-3000:]


def test_lightning_without_replicas_falls_back_to_the_persistent_checkpoint(tmp_path):
    kill_at = _lose_node_1(tmp_path, replicas=0)
    newest = max(int(p.name.split("=")[1].split(".")[0]) for p in (tmp_path / "persistent").iterdir()
                 if bcp.is_checkpoint(str(p)))
    got = _resume(tmp_path, replicas=0)
    assert got["step"] == newest and newest <= kill_at, (got["step"], newest, kill_at, SEED)
    assert "resuming from the persistent checkpoint" in got["log"], got["log"][-3000:]
    assert "no local checkpoint is held completely by these 1 ranks" in got["log"], got["log"][-3000:]
