"""Fine-tune all-MiniLM-L6-v2 with Accelerate and bytecheckpoint under torchrun's elastic agent,
lose a node, continue on the smaller world, export to Hugging Face safetensors.

    python examples/accelerate_finetune.py                 # the whole story, ~2 min on 2 CPU cores
    python examples/accelerate_finetune.py --max-steps 6 --save-every 2 --stop-at 3   # smoke run

What happens:
1. Two torchrun elastic agents, one per simulated node (`torchrun --nnodes=1:2 --nproc-per-node=1
   --rdzv-backend=c10d --rdzv-endpoint=... --max-restarts=3`, what each node of a cluster runs;
   see elastic_job in minilm_task.py), start a plain Accelerate training loop (DDP on CPU, gloo)
   with automatic checkpoint naming. `attach(accelerator, async_save=True)` makes
   `accelerator.save_state()` write the model and AdamW state with bytecheckpoint in the
   background; Accelerate keeps the rest (RNG, the step counter registered with
   `register_for_checkpointing`).
2. At step `--stop-at` the second node is lost: its agent and its process are SIGKILLed (no
   teardown, no last save).
3. The surviving node's agent restarts its process on a world of 1. The same script resumes by
   itself: `if attachment.latest() is not None: accelerator.load_state()` loads the newest
   committed `checkpoint_<n>`, resharded for 1 process, and the naming counter continues past
   every existing folder. It trains on to `--max-steps` with the same global batch.
4. `bytecheckpoint export <final>/bytecheckpoint` writes `model.safetensors` (+ config and
   tokenizer) and `AutoModelForSequenceClassification.from_pretrained` loads it.

`--checkpoint-io accelerate` runs the first job with Accelerate's own save_state (the demo's
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
    p.add_argument("--stop-at", type=int, default=20, help="step at which the second node is lost (0: never)")
    p.add_argument("--nodes", type=int, default=2, help="torchrun agents (simulated nodes), one process each")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--train-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--checkpoint-io", choices=["bytecheckpoint", "accelerate"], default="bytecheckpoint")
    p.add_argument("--no-resume", action="store_true", help="stop when the node is lost (the demo's baseline)")
    p.add_argument("--timeout", type=float, default=600, help="limit for the job, seconds")
    p.add_argument("--results", help="write the summary as JSON here")
    p.add_argument("--quiet", action="store_true", help="send the job's output to WORKDIR/jobs.log")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class TrainProgress:
    """The step counter, checkpointed by Accelerate (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


# ----------------------------------------------------------------------------- training (every (re)start)

def train(args: argparse.Namespace) -> None:
    """One start of the training process by torchrun's agent: the first, or a restart on a new
    world after a node was lost. Resumes from the newest committed checkpoint when there is one."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader

    task.first_launch_waits_for(args.nodes)
    torch.set_num_threads(1)
    set_seed(0)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    workdir = Path(args.workdir)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(workdir), automatic_checkpoint_naming=True))       # workdir/checkpoints/checkpoint_<n>
    attachment = None
    if args.checkpoint_io == "bytecheckpoint":
        from accelerate_bytecheckpoint import attach
        attachment = attach(accelerator, async_save=True)       # <- the one bytecheckpoint line
    main = accelerator.is_main_process
    log = task.RunLog(str(workdir / "log.jsonl"), phase="resume" if restarted else "train") if main else None

    train_data, eval_data = task.make_datasets(args.train_size, seq_len=args.seq_len)
    model = task.load_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(train_data, batch_size=args.global_batch // accelerator.num_processes, shuffle=True,
                        drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress)

    load_s = eval_loss = None
    if attachment is not None and attachment.latest() is not None:   # None: a first launch
        t0 = time.perf_counter()
        accelerator.load_state()       # the newest committed checkpoint_<n>, on any number of processes
        load_s = time.perf_counter() - t0
    ready = time.time()  # restored; the first step starts now (the evaluation below is the demo's)
    if restarted and main:
        eval_loss = task.evaluate(accelerator.unwrap_model(model), eval_data)["loss"]

    def save() -> float:
        t0 = time.perf_counter()
        accelerator.save_state()
        return time.perf_counter() - t0

    first = True
    while progress.step < args.max_steps:
        epoch, done = divmod(progress.step, len(loader))
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done) if done else loader  # continue the epoch
        for ids, mask, labels in batches:
            if first and main:
                log.write(event="resumed" if restarted else "started", step=progress.step,
                          world_size=accelerator.num_processes, resume_s=ready - T_PROCESS_START,
                          ready_unix=ready, load_s=load_s, eval_loss=eval_loss,
                          data_order=attachment.data_order if attachment is not None else None)
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
                stall = save()
                if main:
                    ev = task.evaluate(accelerator.unwrap_model(model), eval_data)
                    log.write(event="save", step=progress.step, stall_s=stall, eval_loss=ev["loss"])
            if not restarted and progress.step == args.stop_at and accelerator.num_processes > 1:
                # The story is the resume: the node is lost once the save in flight has committed
                # (the main process writes it alone). A loss in the middle of a save is tested in
                # tests/integration/test_elastic.py: an uncommitted checkpoint is never loaded.
                if attachment is not None and main:
                    attachment.wait()
                accelerator.wait_for_everyone()
                if accelerator.process_index == accelerator.num_processes - 1:  # the last node is lost
                    task.lose_this_node(task.RunLog(str(workdir / "log.jsonl"), phase="train"), progress.step)
            if progress.step >= args.max_steps:
                break

    save()
    final = os.path.join(accelerator.project_dir, "checkpoints",
                         f"checkpoint_{accelerator.project_configuration.iteration - 1}")
    if attachment is not None:
        attachment.wait()  # committed before we report it
    if main:
        unwrapped = accelerator.unwrap_model(model)
        task.save_hf_config(unwrapped, str(workdir / "hf_config"))
        ev = task.evaluate(unwrapped, eval_data)
        log.write(event="final", step=progress.step, path=final, eval_loss=ev["loss"], accuracy=ev["accuracy"])
    accelerator.end_training()


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
    results = {"example": "accelerate", "checkpoint_io": args.checkpoint_io, "args": vars(args)}
    output = str(workdir / "jobs.log") if args.quiet else None
    job = task.elastic_job(os.path.abspath(__file__), common, nodes=args.nodes, timeout=args.timeout,
                           max_restarts=0 if args.no_resume else 3, output=output, label="training job")
    results["train_s"] = job["wall_s"]
    records = task.RunLog.read(str(workdir / "log.jsonl"))
    task.check_exits(job, records, args, output)
    if not args.no_resume and args.checkpoint_io == "bytecheckpoint":
        from accelerate_bytecheckpoint import CHECKPOINT_SUBDIR
        final = [r for r in records if r.get("event") == "final"][-1]["path"]
        print("\n== 2. export to Hugging Face safetensors and reload with from_pretrained")
        _, eval_data = task.make_datasets(16, seq_len=args.seq_len)
        results.update(task.export_and_reload(
            os.path.join(final, CHECKPOINT_SUBDIR), str(workdir / "hf_export"), str(workdir / "hf_config"),
            eval_data, ["--key", "model"], output=output))
    results.update(task.summarize(records))
    task.report(results)
    if args.results:
        Path(args.results).write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
