"""Fine-tune all-MiniLM-L6-v2 with Accelerate on 2 processes and bytecheckpoint, lose a node,
resume on fewer processes, export to Hugging Face safetensors.

    python examples/accelerate_finetune.py                 # the whole story, ~2 min on 2 CPU cores
    python examples/accelerate_finetune.py --max-steps 6 --save-every 2 --stop-at 3   # smoke run

What happens:
1. `torchrun --nproc_per_node 2` starts a plain Accelerate training loop (DDP on CPU, gloo).
   `attach(accelerator, async_save=True)` is the only bytecheckpoint line: from then on
   `accelerator.save_state(dir)` writes the model and AdamW state with bytecheckpoint (every
   rank writes its share, in the background) and Accelerate keeps the rest (RNG, the step
   counter registered with `register_for_checkpointing`).
2. At step `--stop-at` both processes are SIGKILLed (a lost node: no teardown, no last save).
3. A new job with `--resume-devices 1` process (plain `python`, no torchrun) calls
   `accelerator.load_state(latest committed checkpoint)`: bytecheckpoint reshards the 2-rank
   checkpoint for 1 process. It trains on to `--max-steps` with the same global batch.
4. `bytecheckpoint export <final>/bytecheckpoint` writes `model.safetensors` (+ config and
   tokenizer) and `AutoModelForSequenceClassification.from_pretrained` loads it.

`--checkpoint-io accelerate` runs the same loop with Accelerate's own save_state (the demo's
baseline).
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
    p.add_argument("--workdir", default="runs/accelerate", help="checkpoints, logs and the export go here (wiped)")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=8)
    p.add_argument("--stop-at", type=int, default=20, help="step at which the first job loses its node (0: never)")
    p.add_argument("--devices", type=int, default=2, help="processes of the first job (torchrun)")
    p.add_argument("--resume-devices", type=int, default=1, help="processes of the resumed job")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--train-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--checkpoint-io", choices=["bytecheckpoint", "accelerate"], default="bytecheckpoint")
    p.add_argument("--no-resume", action="store_true", help="only run the first job (the demo's baseline)")
    p.add_argument("--timeout", type=float, default=600, help="limit for each job, seconds")
    p.add_argument("--results", help="write the summary as JSON here")
    p.add_argument("--quiet", action="store_true", help="send the jobs' output to WORKDIR/jobs.log")
    p.add_argument("--phase", choices=["all", "train", "resume"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--resume-from", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class TrainProgress:
    """The step counter, checkpointed by Accelerate (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


# ----------------------------------------------------------------------------- training (one job)

def train(args: argparse.Namespace) -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    set_seed(0)
    resuming = args.phase == "resume"
    workdir = Path(args.workdir)
    accelerator = Accelerator(cpu=True)
    if args.checkpoint_io == "bytecheckpoint":
        from accelerate_bytecheckpoint import attach
        attachment = attach(accelerator, async_save=True)       # <- the one bytecheckpoint line
    main = accelerator.is_main_process
    log = task.RunLog(str(workdir / "log.jsonl"), phase=args.phase) if main else None

    train_data, eval_data = task.make_datasets(args.train_size, seq_len=args.seq_len)
    model = task.load_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(train_data, batch_size=args.global_batch // accelerator.num_processes, shuffle=True,
                        drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress)

    load_s = eval_loss = None
    if resuming:
        t0 = time.perf_counter()
        accelerator.load_state(args.resume_from)
        load_s = time.perf_counter() - t0
        if main:
            eval_loss = task.evaluate(accelerator.unwrap_model(model), eval_data)["loss"]

    def save(path: Path) -> float:
        t0 = time.perf_counter()
        accelerator.save_state(str(path))
        return time.perf_counter() - t0

    first = True
    while progress.step < args.max_steps:
        epoch, done = divmod(progress.step, len(loader))
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done) if done else loader  # continue the epoch
        for ids, mask, labels in batches:
            if first and main:
                log.write(event="resumed" if resuming else "started", step=progress.step,
                          world_size=accelerator.num_processes, resume_s=time.time() - T_PROCESS_START,
                          load_s=load_s, eval_loss=eval_loss)
            first = False
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            mean = accelerator.gather(loss.detach()).mean()
            if main:
                log.write(event="loss", step=progress.step, loss=float(mean))
            if progress.step % args.save_every == 0:
                stall = save(workdir / "checkpoints" / f"step{progress.step:03d}")
                if main:
                    ev = task.evaluate(accelerator.unwrap_model(model), eval_data)
                    log.write(event="save", step=progress.step, stall_s=stall, eval_loss=ev["loss"])
            if not resuming and progress.step == args.stop_at:
                task.lose_this_node(log, progress.step)
            if progress.step >= args.max_steps:
                break

    if resuming:
        final = workdir / "checkpoints" / "final"
        save(final)
        if args.checkpoint_io == "bytecheckpoint":
            attachment.wait()  # committed before we report it
        if main:
            unwrapped = accelerator.unwrap_model(model)
            task.save_hf_config(unwrapped, str(workdir / "hf_config"))
            ev = task.evaluate(unwrapped, eval_data)
            log.write(event="final", step=progress.step, path=str(final), eval_loss=ev["loss"],
                      accuracy=ev["accuracy"])
    accelerator.end_training()


# ----------------------------------------------------------------------------- the story

def is_committed(kind: str):
    if kind == "bytecheckpoint":
        import bytecheckpoint as bcp
        from accelerate_bytecheckpoint import CHECKPOINT_SUBDIR
        return lambda p: bcp.is_checkpoint(str(p / CHECKPOINT_SUBDIR))
    return lambda p: (p / "model.safetensors").is_file() and (p / "optimizer.bin").is_file()


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

    def launch(nproc: int):
        return task.launcher(nproc, script)

    print(f"== 1. train on {args.devices} processes ({args.checkpoint_io}), node lost at step {args.stop_at}")
    results = {"example": "accelerate", "checkpoint_io": args.checkpoint_io, "args": vars(args)}
    log_path = str(workdir / "log.jsonl")
    output = str(workdir / "jobs.log") if args.quiet else None
    results["train_s"] = task.run_phase([*launch(args.devices), "--phase", "train", *common], timeout=args.timeout,
                                        env=env, killed_log=log_path if 0 < args.stop_at < args.max_steps else None,
                                        label="training job", output=output)
    if not args.no_resume:
        latest = task.latest_step_dir((workdir / "checkpoints").glob("step*"), is_committed(args.checkpoint_io))
        if latest is None:
            raise SystemExit("no committed checkpoint to resume from")
        print(f"\n== 2. resume on {args.resume_devices} process(es) from {latest.name}")
        results["resume_job_s"] = task.run_phase(
            [*launch(args.resume_devices), "--phase", "resume", "--resume-from", str(latest), *common],
            timeout=args.timeout, env=env, label="resumed job", output=output)
        if args.checkpoint_io == "bytecheckpoint":
            from accelerate_bytecheckpoint import CHECKPOINT_SUBDIR
            print("\n== 3. export to Hugging Face safetensors and reload with from_pretrained")
            _, eval_data = task.make_datasets(16, seq_len=args.seq_len)
            results.update(task.export_and_reload(
                str(workdir / "checkpoints" / "final" / CHECKPOINT_SUBDIR), str(workdir / "hf_export"),
                str(workdir / "hf_config"), eval_data, ["--key", "model"], output=output))
    results.update(task.summarize(task.RunLog.read(str(workdir / "log.jsonl"))))
    task.report(results)
    if args.results:
        Path(args.results).write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
