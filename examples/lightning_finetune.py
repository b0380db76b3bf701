"""Fine-tune all-MiniLM-L6-v2 with Lightning DDP and ByteCheckpointIO under torchrun's elastic
agent, lose a node, continue on the smaller world, export to Hugging Face safetensors.

    python examples/lightning_finetune.py                 # the whole story, ~2 min on 2 CPU cores
    python examples/lightning_finetune.py --max-steps 6 --save-every 2 --stop-at 3   # smoke run

What happens:
1. Two torchrun elastic agents, one per simulated node (`torchrun --nnodes=1:2 --nproc-per-node=1
   --rdzv-backend=c10d --rdzv-endpoint=... --max-restarts=3`, exactly what each node of a cluster
   runs; see elastic_job in minilm_task.py), start one CPU process each (Lightning DDP, gloo).
   They fine-tune the model on a generated topic dataset and save a checkpoint every
   `--save-every` steps with `ByteCheckpointIO(async_save=True)`: the training loop only waits for
   a copy of the state, the write happens in the background.
2. At step `--stop-at` the second node is lost: its agent and its process are SIGKILLed (no
   teardown, no last save).
3. The surviving node's agent restarts its process on a world of 1. The same script resumes by
   itself from the newest *committed* checkpoint (`trainer.fit(ckpt_path=bcp.latest(dir))`:
   weights, AdamW moments, step counter) and trains on to `--max-steps`, with the same global
   batch (per-process batch = global / processes). Nothing is launched by hand.
4. `bytecheckpoint export` turns the final checkpoint into `model.safetensors` +
   config/tokenizer, and `AutoModelForSequenceClassification.from_pretrained` loads it.

The bytecheckpoint-specific lines of the training code: `Trainer(plugins=[ByteCheckpointIO(
async_save=True)])` and `ckpt_path=bcp.latest(dir)`; `num_nodes`/`devices` come from torchrun's
environment at every (re)start. `--checkpoint-io torch` runs the first job with Lightning's default
`TorchCheckpointIO` for comparison (examples/demo.py does both).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

T_PROCESS_START = time.time()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import minilm_task as task  # noqa: E402  (sets HF_HUB_OFFLINE=1 before transformers is imported)

import torch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", default="runs/lightning", help="checkpoints, logs and the export go here (wiped)")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=8)
    p.add_argument("--stop-at", type=int, default=20, help="step at which the second node is lost (0: never)")
    p.add_argument("--nodes", type=int, default=2, help="torchrun agents (simulated nodes), one process each")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--train-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--checkpoint-io", choices=["bytecheckpoint", "torch"], default="bytecheckpoint")
    p.add_argument("--no-resume", action="store_true", help="stop when the node is lost (the demo's baseline)")
    p.add_argument("--timeout", type=float, default=600, help="limit for the job, seconds")
    p.add_argument("--results", help="write the summary as JSON here")
    p.add_argument("--quiet", action="store_true", help="send the job's output to WORKDIR/jobs.log")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- training (every (re)start)

def make_checkpoint_io(kind: str):
    if kind == "bytecheckpoint":
        from lightning_bytecheckpoint import ByteCheckpointIO
        return ByteCheckpointIO(async_save=True)
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    return TorchCheckpointIO()


def train(args: argparse.Namespace) -> None:
    """One start of the training process by torchrun's agent: the first, or a restart on a new
    world after a node was lost. Resumes from the newest committed checkpoint when there is one."""
    import datetime

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    import bytecheckpoint as bcp

    task.first_launch_waits_for(args.nodes)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    workdir = Path(args.workdir)
    ckpt_dir = workdir / "checkpoints"
    log = task.RunLog(str(workdir / "log.jsonl"), phase="resume" if restarted else "train")
    train_data, eval_data = task.make_datasets(args.train_size, seq_len=args.seq_len)
    world = int(os.environ.get("WORLD_SIZE", "1"))

    class TopicClassifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = task.load_model()

        def training_step(self, batch, batch_idx):
            ids, mask, labels = batch
            loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
            mean = self.all_gather(loss.detach()).mean()  # the global batch's loss, on every rank
            if self.trainer.is_global_zero:
                log.write(event="loss", step=self.global_step + 1, loss=float(mean))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    class TimedCheckpoint(ModelCheckpoint):
        """ModelCheckpoint that records how long the training loop waited for each save, and
        the held-out loss of the weights it saved (to compare with the loss after resume)."""

        def _save_checkpoint(self, trainer, filepath):
            t0 = time.perf_counter()
            super()._save_checkpoint(trainer, filepath)
            stall = time.perf_counter() - t0
            if trainer.is_global_zero:
                ev = task.evaluate(trainer.lightning_module.model, eval_data)
                log.write(event="save", step=trainer.global_step, stall_s=stall, eval_loss=ev["loss"],
                          path=os.path.basename(filepath))

    class Story(Callback):
        """The simulated node loss, and the timings of a resume."""

        def __init__(self) -> None:
            self.first = True
            self.eval_loss = None

        def on_train_start(self, trainer, pl_module):
            self.ready = time.time()  # restored; the first step starts now (the evaluation is the demo's)
            if restarted and trainer.is_global_zero:
                self.eval_loss = task.evaluate(pl_module.model, eval_data)["loss"]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.first and trainer.is_global_zero:
                log.write(event="resumed" if restarted else "started", step=trainer.global_step,
                          world_size=trainer.world_size, resume_s=self.ready - T_PROCESS_START,
                          ready_unix=self.ready, load_s=getattr(io, "load_s", None), eval_loss=self.eval_loss,
                          data_order=getattr(io, "data_order_report", None))
            self.first = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if restarted or trainer.global_step != args.stop_at or trainer.world_size < 2:
                return
            if hasattr(io, "checkpointer"):
                # The story is the resume: the node is lost once the save in flight has
                # committed (under DDP the main process writes it alone, like Lightning's own
                # default). A loss in the middle of a save is tested in tests/integration/
                # test_elastic.py: an uncommitted checkpoint is never loaded, the previous one is.
                if trainer.is_global_zero:
                    io.checkpointer.wait()
            trainer.strategy.barrier("node-loss")
            if trainer.global_rank == trainer.world_size - 1:  # the last node is lost
                task.lose_this_node(task.RunLog(log.path, phase="train"), trainer.global_step)

    io = make_checkpoint_io(args.checkpoint_io)
    _time_loads(io)
    trainer = pl.Trainer(
        accelerator="cpu",
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),   # torchrun's, at every (re)start
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=120)),
        max_steps=args.max_steps, max_epochs=-1,
        plugins=[io],
        callbacks=[Story(), TimedCheckpoint(dirpath=ckpt_dir, filename="step{step:03d}",
                                            auto_insert_metric_name=False, every_n_train_steps=args.save_every,
                                            save_top_k=-1)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    module = TopicClassifier()
    loader = DataLoader(train_data, batch_size=args.global_batch // world, shuffle=True, drop_last=True)
    resume_from = bcp.latest(ckpt_dir) if args.checkpoint_io == "bytecheckpoint" else None
    trainer.fit(module, loader, ckpt_path=resume_from)   # None: a first launch
    final = str(ckpt_dir / "final.ckpt")
    trainer.save_checkpoint(final)
    # fit() has already torn the plugin down, so nothing else waits for this async save before
    # the process exits: wait here, so that a failure is raised instead of lost.
    trainer.strategy.checkpoint_io.teardown()
    if trainer.is_global_zero:
        task.save_hf_config(module.model, str(workdir / "hf_config"))
        ev = task.evaluate(module.model, eval_data)
        log.write(event="final", step=trainer.global_step, path=final, eval_loss=ev["loss"],
                  accuracy=ev["accuracy"])


def _time_loads(io) -> None:
    """Record how long the plugin's load_checkpoint took (demo instrumentation only)."""
    original = io.load_checkpoint

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            io.load_s = time.perf_counter() - t0

    io.load_checkpoint = timed


# ----------------------------------------------------------------------------- the story

def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        train(args)
        return {}
    workdir = Path(args.workdir).resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    common = ["--workdir", str(workdir), "--max-steps", str(args.max_steps), "--save-every", str(args.save_every),
              "--stop-at", str(args.stop_at), "--nodes", str(args.nodes), "--global-batch", str(args.global_batch),
              "--seq-len", str(args.seq_len), "--train-size", str(args.train_size), "--lr", str(args.lr),
              "--checkpoint-io", args.checkpoint_io, "--worker"]
    print(f"== 1. train on {args.nodes} nodes ({args.checkpoint_io}) under torchrun's elastic agent; the last node "
          f"is lost at step {args.stop_at}" + ("" if args.no_resume else "; the survivors go on by themselves"))
    results = {"example": "lightning", "checkpoint_io": args.checkpoint_io, "args": vars(args)}
    output = str(workdir / "jobs.log") if args.quiet else None
    job = task.elastic_job(os.path.abspath(__file__), common, nodes=args.nodes, timeout=args.timeout,
                           max_restarts=0 if args.no_resume else 3, output=output, label="training job")
    results["train_s"] = job["wall_s"]
    records = task.RunLog.read(str(workdir / "log.jsonl"))
    task.check_exits(job, records, args, output)
    if not args.no_resume and args.checkpoint_io == "bytecheckpoint":
        print("\n== 2. export to Hugging Face safetensors and reload with from_pretrained")
        _, eval_data = task.make_datasets(16, seq_len=args.seq_len)
        results.update(task.export_and_reload(
            str(workdir / "checkpoints" / "final.ckpt"), str(workdir / "hf_export"), str(workdir / "hf_config"),
            eval_data, ["--key", "state_dict", "--prefix", "model."], output=output))
    results.update(task.summarize(records))
    task.report(results)
    if args.results:
        Path(args.results).write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
