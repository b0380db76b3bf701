"""Scenario script for tests/integration/test_data_order_transformers.py: sample ids per global
step under transformers.Trainer + attach (a tiny model that records the ``idx`` it is fed).

  torchrun ... data_ids.py --out DIR --tag T --batch B [--save-steps K] [--resume FOLDER] [--strict]

Rank r writes DIR/T_rank{r}.json: {"seen": {global_step: ids}, "report": attachment.data_order}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

SEEN = {}
STEP = [0]


class Ids(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"idx": torch.tensor(i), "labels": torch.tensor(float(i))}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)

    def forward(self, idx, labels=None):
        SEEN.setdefault(STEP[0], []).extend(int(i) for i in idx)
        out = self.lin(idx.float().unsqueeze(1)).squeeze(1)
        return {"loss": ((out - labels) ** 2).mean() * 1e-6, "logits": out}


def run(out, tag, batch, *, save_steps=0, resume=None, strict=False, n=96, epochs=2):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from transformers_bytecheckpoint import attach

    class Step(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            STEP[0] = state.global_step

    args = TrainingArguments(output_dir=os.path.join(out, tag), per_device_train_batch_size=batch,
                             num_train_epochs=epochs, learning_rate=1e-3, save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500, logging_steps=1000, seed=7, report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
                             ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None)
    trainer = Trainer(model=Model(), args=args, train_dataset=Ids(n), callbacks=[Step()])
    attachment = attach(trainer, strict_data_order=strict)
    SEEN.clear()
    trainer.train(resume_from_checkpoint=resume)
    return attachment


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--resume")
    a = p.parse_args()
    torch.set_num_threads(1)
    attachment = run(a.out, a.tag, a.batch, save_steps=a.save_steps, resume=a.resume)
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(a.out, f"{a.tag}_rank{rank}.json"), "w") as f:
        json.dump({"seen": SEEN, "report": attachment.data_order}, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _leave import leave

    main()
    leave(0)
