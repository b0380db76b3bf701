"""Scenario script for tests/integration/test_accelerate.py, launched with torchrun or python.

  --mode save : train a few steps with an attached Accelerator, dump the reference state of every
                rank to <out>/saved_<rank>.pt, then save_state(<ckpt>) (optionally async,
                mutating the live state right after save_state returns).
  --mode load : fresh Accelerator (different seed, different process count), attach,
                load_state(<ckpt>), dump the loaded state to <out>/loaded_<rank>.pt.

The test process compares the dumps; this script only asserts what it alone can see.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np
import torch
from torch import nn

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed

from accelerate_bytecheckpoint import attach


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls += 1
        return self.out(torch.relu(self.hidden(torch.relu(self.norm(self.inp(x))))))


class Counter:
    """A custom object registered with accelerator.register_for_checkpointing."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def build(args: argparse.Namespace, seed: int):
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,  # accelerator.step then matters (it decides when to sync)
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(seed)
    model = Net(args.width)
    head = nn.Linear(4, 2)  # a second model with its own optimizer: model_1 / optimizer_1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    head_opt = torch.optim.SGD(head.parameters(), lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 2, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, head, opt, head_opt, sched, loader = accelerator.prepare(model, head, opt, head_opt, sched, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, head, opt, head_opt, sched, loader, counter


def train(accelerator, model, head, opt, head_opt, sched, loader, counter, steps: int) -> None:
    it = iter(loader)
    for _ in range(steps):
        x, y = next(it)
        with accelerator.accumulate(model, head):
            loss = torch.nn.functional.mse_loss(head(model(x)), y)
            accelerator.backward(loss)
            opt.step()
            head_opt.step()
            sched.step()
            opt.zero_grad()
            head_opt.zero_grad()
        counter.value += 1
        torch.rand(3)  # consume RNG so RNG state differs from the seed's
        random.random()
        np.random.rand()


def snapshot(accelerator, model, head, opt, head_opt, sched, counter) -> dict:
    """Everything the test compares, by parameter name, cloned to CPU."""
    out: dict = {"models": {}, "optim": {}}
    for key, wrapped, optimizer in (("model", model, opt), ("model_1", head, head_opt)):
        m = accelerator.unwrap_model(wrapped)
        out["models"][key] = {k: v.detach().clone().cpu() for k, v in m.state_dict().items()}
        names = {id(p): n for n, p in m.named_parameters()}
        inner = optimizer.optimizer
        out["optim"][key] = {
            "state": {
                names[id(p)]: {k: (v.detach().clone().cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
                for p, s in inner.state.items()
            },
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        }
    out["scheduler"] = sched.scheduler.state_dict()
    out["rng"] = {
        "torch": torch.get_rng_state().clone(),
        "random": random.getstate(),
        "numpy": [np.asarray(x) if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
    }
    out["step"] = accelerator.step
    out["counter"] = counter.value
    out["world_size"] = accelerator.num_processes
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["save", "load"], required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--mutate-after-save", action="store_true")
    args = p.parse_args()

    if args.mode == "save":
        parts = build(args, seed=1234)
        accelerator = parts[0]
        handle = attach(accelerator, async_save=args.async_save)  # attach after prepare
        train(*parts, steps=args.steps)
        reference = snapshot(*parts[:6], parts[7])
        torch.save(reference, os.path.join(args.out, f"saved_{accelerator.process_index}.pt"))
        t0 = time.perf_counter()
        accelerator.save_state(args.ckpt)
        info = {"save_state_s": time.perf_counter() - t0}
        if args.mutate_after_save:
            info["in_flight_at_mutation"] = bool(handle.pending)
            # Training goes on while the write is (possibly) in flight: the checkpoint must hold
            # the state at save_state time, not this.
            _, model, head, opt, head_opt = parts[:5]
            with torch.no_grad():
                for m in (model, head):
                    for prm in m.parameters():
                        prm.add_(1000.0)
                for o in (opt, head_opt):
                    for s in o.optimizer.state.values():
                        for v in s.values():
                            if torch.is_tensor(v) and v.is_floating_point():
                                v.mul_(3.0).add_(1.0)  # stays >= 0 for exp_avg_sq
            train(*parts, steps=2)
        handle.wait()
        info["wait_done_s"] = time.perf_counter() - t0
        handle.remove()
        accelerator.wait_for_everyone()
        with open(os.path.join(args.out, f"save_info_{accelerator.process_index}.json"), "w") as f:
            json.dump(info, f)
        accelerator.end_training()
    else:
        parts = build(args, seed=999)  # different init: loading must overwrite everything
        accelerator = parts[0]
        handle = attach(accelerator)
        accelerator.load_state(args.ckpt)
        loaded = snapshot(*parts[:6], parts[7])
        torch.save(loaded, os.path.join(args.out, f"loaded_{accelerator.process_index}.pt"))
        # One more training step must work on the loaded state (optimizer state is usable).
        train(*parts, steps=1)
        handle.remove()
        accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _leave import leave

    leave(main())  # every save was waited for and its results written above
