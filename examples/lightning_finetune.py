"""Fine-tune all-MiniLM-L6-v2 with Lightning DDP and ByteCheckpointIO, lose a node, resume on
fewer processes, export to Hugging Face safetensors.

    python examples/lightning_finetune.py                 # the whole story, ~2 min on 2 CPU cores
    python examples/lightning_finetune.py --max-steps 6 --save-every 2 --stop-at 3   # smoke run

What happens:
1. `torchrun --nproc_per_node 2` starts `--devices 2` CPU processes (Lightning DDP, gloo; Lightning
   picks up torchrun's environment) that fine-tune the model on a generated topic dataset and
   save a checkpoint every `--save-every` steps with `ByteCheckpointIO(async_save=True)`: the
   training loop only waits for a copy of the state, every rank writes its share in the
   background.
2. At step `--stop-at` both processes are SIGKILLed (a lost node: no teardown, no last save).
3. A new job on `--resume-devices 1` process resumes from the newest *committed* checkpoint
   (`trainer.fit(ckpt_path=...)`: weights, AdamW moments, step counter) and trains on to
   `--max-steps`. The same global batch is kept (per-process batch = global / processes).
4. `bytecheckpoint export` turns the final checkpoint into `model.safetensors` +
   config/tokenizer, and `AutoModelForSequenceClassification.from_pretrained` loads it.

The only bytecheckpoint-specific line in the training code is
`Trainer(plugins=[ByteCheckpointIO(async_save=True)])`. `--checkpoint-io torch` runs the same
job with Lightning's default `TorchCheckpointIO` for comparison (examples/demo.py does both).
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
    p.add_argument("--stop-at", type=int, default=20, help="step at which the first job loses its node (0: never)")
    p.add_argument("--devices", type=int, default=2, help="processes of the first job")
    p.add_argument("--resume-devices", type=int, default=1, help="processes of the resumed job")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--train-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--checkpoint-io", choices=["bytecheckpoint", "torch"], default="bytecheckpoint")
    p.add_argument("--no-resume", action="store_true", help="only run the first job (the demo's baseline)")
    p.add_argument("--timeout", type=float, default=600, help="limit for each job, seconds")
    p.add_argument("--results", help="write the summary as JSON here")
    p.add_argument("--quiet", action="store_true", help="send the jobs' output to WORKDIR/jobs.log")
    p.add_argument("--phase", choices=["all", "train", "resume"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--resume-from", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- training (one job)

def make_checkpoint_io(kind: str):
    if kind == "bytecheckpoint":
        from lightning_bytecheckpoint import ByteCheckpointIO
        return ByteCheckpointIO(async_save=True)
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    return TorchCheckpointIO()


def train(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    resuming = args.phase == "resume"
    devices = args.resume_devices if resuming else args.devices
    workdir = Path(args.workdir)
    log = task.RunLog(str(workdir / "log.jsonl"), phase=args.phase)
    train_data, eval_data = task.make_datasets(args.train_size, seq_len=args.seq_len)

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
        """Simulated node loss, and the timings of a resume."""

        def __init__(self) -> None:
            self.first = True
            self.eval_loss = None

        def on_train_start(self, trainer, pl_module):
            if resuming and trainer.is_global_zero:
                self.eval_loss = task.evaluate(pl_module.model, eval_data)["loss"]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.first and trainer.is_global_zero:
                log.write(event="resumed" if resuming else "started", step=trainer.global_step,
                          world_size=trainer.world_size, resume_s=time.time() - T_PROCESS_START,
                          load_s=getattr(io, "load_s", None), eval_loss=self.eval_loss)
            self.first = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not resuming and trainer.global_step == args.stop_at:
                if hasattr(io, "checkpointer"):
                    # The story is the resume: the node is lost once the save in flight has
                    # committed (under DDP the main process writes it alone, like Lightning's own
                    # default; the other process waits for it, or the launcher would stop the main
                    # one as soon as it dies). A loss in the middle of a save is covered by
                    # tests/faults: an uncommitted checkpoint is never loaded, the previous one is.
                    if trainer.is_global_zero:
                        io.checkpointer.wait()
                    trainer.strategy.barrier("node-loss")
                task.lose_this_node(log if trainer.is_global_zero else None, trainer.global_step)

    io = make_checkpoint_io(args.checkpoint_io)
    _time_loads(io)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, max_steps=args.max_steps, max_epochs=-1,
        strategy=DDPStrategy(process_group_backend="gloo") if devices > 1 else "auto",
        plugins=[io],
        callbacks=[Story(), TimedCheckpoint(dirpath=workdir / "checkpoints", filename="step{step:03d}",
                                            auto_insert_metric_name=False, every_n_train_steps=args.save_every,
                                            save_top_k=-1)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    module = TopicClassifier()
    loader = DataLoader(train_data, batch_size=args.global_batch // devices, shuffle=True, drop_last=True)
    trainer.fit(module, loader, ckpt_path=args.resume_from if resuming else None)
    if resuming:
        final = str(workdir / "checkpoints" / "final.ckpt")
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

def is_committed(kind: str):
    if kind == "bytecheckpoint":
        import bytecheckpoint as bcp
        return lambda p: bcp.is_checkpoint(str(p))
    return lambda p: p.is_file()


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.phase != "all":
        train(args)
        return {}
    workdir = Path(args.workdir).resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    script = os.path.abspath(__file__)
    common = ["--workdir", str(workdir), "--max-steps", str(args.max_steps), "--save-every", str(args.save_every),
              "--stop-at", str(args.stop_at), "--devices", str(args.devices), "--resume-devices",
              str(args.resume_devices), "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
              "--train-size", str(args.train_size), "--lr", str(args.lr), "--checkpoint-io", args.checkpoint_io]
    env = {"BCP_COLLECTIVE_TIMEOUT_S": "120"}

    print(f"== 1. train on {args.devices} processes ({args.checkpoint_io}), node lost at step {args.stop_at}")
    results = {"example": "lightning", "checkpoint_io": args.checkpoint_io, "args": vars(args)}
    log_path = str(workdir / "log.jsonl")
    output = str(workdir / "jobs.log") if args.quiet else None
    results["train_s"] = task.run_phase([*task.launcher(args.devices, script), "--phase", "train", *common],
                                        timeout=args.timeout, env=env, killed_log=log_path if 0 < args.stop_at < args.max_steps else None,
                                        label="training job", output=output)
    if not args.no_resume:
        latest = task.latest_step_dir((workdir / "checkpoints").glob("step*.ckpt"), is_committed(args.checkpoint_io))
        if latest is None:
            raise SystemExit("no committed checkpoint to resume from")
        print(f"\n== 2. resume on {args.resume_devices} process(es) from {latest.name}")
        results["resume_job_s"] = task.run_phase([*task.launcher(args.resume_devices, script), "--phase", "resume",
                                                  "--resume-from", str(latest), *common],
                                                 timeout=args.timeout, env=env, label="resumed job", output=output)
        if args.checkpoint_io == "bytecheckpoint":
            print("\n== 3. export to Hugging Face safetensors and reload with from_pretrained")
            _, eval_data = task.make_datasets(16, seq_len=args.seq_len)
            results.update(task.export_and_reload(
                str(workdir / "checkpoints" / "final.ckpt"), str(workdir / "hf_export"), str(workdir / "hf_config"),
                eval_data, ["--key", "state_dict", "--prefix", "model."], output=output))
    results.update(task.summarize(task.RunLog.read(str(workdir / "log.jsonl"))))
    task.report(results)
    if args.results:
        Path(args.results).write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
