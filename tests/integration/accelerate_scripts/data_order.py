"""Scenario script for tests/integration/test_data_order_accelerate.py (torchrun): sample ids per
global step under an attached Accelerator, in a loop written like transformers'
``run_clm_no_trainer.py`` (set_seed, prepare, load_state, ``skip_first_batches(dl, resume_step)``).

  data_order.py --out DIR --tag T [--seedable] [--stateful] [--save-at K ...]
                [--resume FOLDER --resume-step K] [--no-data-order]

The main process writes DIR/T.json: {"seen": {completed step: sorted global ids}, "report": [...]}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import DataLoader, TensorDataset

    from accelerate_bytecheckpoint import attach

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--seedable", action="store_true")
    p.add_argument("--stateful", action="store_true")
    p.add_argument("--save-at", type=int, nargs="*", default=[])
    p.add_argument("--resume")
    p.add_argument("--resume-step", type=int, default=0)
    p.add_argument("--no-data-order", action="store_true")
    p.add_argument("--n", type=int, default=96)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)

    config = DataLoaderConfiguration(use_seedable_sampler=args.seedable, use_stateful_dataloader=args.stateful)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    set_seed(7)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dl = DataLoader(TensorDataset(torch.arange(args.n)), batch_size=args.global_batch // accelerator.num_processes,
                    shuffle=True)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    attachment = attach(accelerator, data_order=not args.no_data_order)
    starting_epoch, resume_step, completed = 0, 0, 0
    if args.resume:
        accelerator.load_state(args.resume)
        completed = args.resume_step                   # the folder's step; gradient accumulation 1
        starting_epoch = completed // len(dl)
        resume_step = completed - starting_epoch * len(dl)
    seen = {}
    for epoch in range(starting_epoch, args.epochs):
        if args.resume and epoch == starting_epoch and resume_step and not args.stateful:
            active = accelerator.skip_first_batches(dl, resume_step)
        else:
            active = dl
        for (x,) in active:
            seen[completed] = sorted(int(i) for i in accelerator.gather(x))
            accelerator.backward(model(x.float().unsqueeze(1)).pow(2).mean())
            opt.step()
            opt.zero_grad()
            completed += 1
            if completed in args.save_at:
                accelerator.save_state(os.path.join(args.out, f"{args.tag}_step_{completed}"))
    attachment.remove()
    if accelerator.is_main_process:
        with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
            json.dump({"seen": seen, "report": attachment.data_order}, f)
        print("\n".join(attachment.data_order or []))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _leave import leave

    main()
    leave(0)
