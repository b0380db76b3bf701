"""The calling patterns of diffusers' / transformers' training scripts, with and without attach.

    diffusers_pattern.py save OUT   (torchrun, 2 processes, gloo, Accelerator(cpu=True))
    diffusers_pattern.py resume OUT (plain python, 1 process)

Like diffusers' train_text_to_image.py / train_dreambooth.py: a save pre-hook saves the "unet"
itself with save_pretrained and pops its entry from `weights`; a load pre-hook pops it from
`models` and loads it with from_pretrained; an EMA copy of the unet is registered with
register_for_checkpointing; one AdamW over both models; an LR scheduler; noise drawn from the
global RNG every step.

save: trains 4 steps on 2 processes, then saves the same state four times:
  default/     Accelerate alone:                 `if is_main_process: save_state(d)`; wait_for_everyone()
  main/        attach(acc):                      `if is_main_process: save_state(d)`; wait_for_everyone()
  every/       attach(acc):                      save_state(d) on every process;   wait_for_everyone()
  collective/  attach(acc, collective_save=True): save_state(d) on every process
resume: for each directory, a fresh 1-process run (different seed) loads it (attached for the
  three bytecheckpoint ones), trains 3 more steps and dumps weights, EMA, optimizer, scheduler and
  step to OUT/final_<name>.pt. The test compares them bit for bit with default's.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from accelerate import Accelerator
from accelerate.utils import set_seed

import bytecheckpoint as bcp
from accelerate_bytecheckpoint import CHECKPOINT_SUBDIR, attach

NAMES = ("default", "main", "every", "collective")


class TinyUNet(nn.Module):
    """A diffusers-like model: a config plus save_pretrained / from_pretrained."""

    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.config = {"width": width, "depth": depth}
        self.inp = nn.Linear(8, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.SiLU())
                                      for _ in range(depth)])
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))

    def save_pretrained(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(self.config, f)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()},
                  os.path.join(directory, "diffusion_pytorch_model.safetensors"))

    @classmethod
    def from_pretrained(cls, directory: str) -> "TinyUNet":
        with open(os.path.join(directory, "config.json")) as f:
            model = cls(**json.load(f))
        model.load_state_dict(load_file(os.path.join(directory, "diffusion_pytorch_model.safetensors")))
        return model


class EMA:
    """An exponential moving average of the unet's parameters (state_dict/load_state_dict)."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.steps = 0
        self.shadow = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def step(self, model: nn.Module) -> None:
        for s, p in zip(self.shadow, model.parameters()):
            s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)
        self.steps += 1

    def state_dict(self) -> dict:
        return {"decay": self.decay, "steps": self.steps, "shadow": [t.clone() for t in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.steps = state["decay"], state["steps"]
        for s, t in zip(self.shadow, state["shadow"]):
            s.copy_(t)


def build(seed: int):
    accelerator = Accelerator(cpu=True)
    set_seed(seed)
    text_encoder = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    unet = TinyUNet()
    optimizer = torch.optim.AdamW([{"params": unet.parameters(), "lr": 1e-2},
                                   {"params": text_encoder.parameters(), "lr": 5e-3}], weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    # unet prepared last, so diffusers' `weights.pop()` pops its entry
    text_encoder, unet, optimizer, scheduler, loader = accelerator.prepare(text_encoder, unet, optimizer, scheduler,
                                                                           loader)
    ema = EMA(accelerator.unwrap_model(unet))
    accelerator.register_for_checkpointing(ema)

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            for model in models:
                if isinstance(accelerator.unwrap_model(model), TinyUNet):
                    accelerator.unwrap_model(model).save_pretrained(os.path.join(output_dir, "unet"))
                    weights.pop()  # make sure the unet is not saved again

    def load_model_hook(models, input_dir):
        for i in reversed(range(len(models))):
            if isinstance(accelerator.unwrap_model(models[i]), TinyUNet):
                model = models.pop(i)  # loaded here, not by load_state
                loaded = TinyUNet.from_pretrained(os.path.join(input_dir, "unet"))
                accelerator.unwrap_model(model).load_state_dict(loaded.state_dict())

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)
    return accelerator, text_encoder, unet, optimizer, scheduler, loader, ema


def train(parts, steps: int) -> None:
    accelerator, text_encoder, unet, optimizer, scheduler, loader, ema = parts
    it = iter(loader)
    for _ in range(steps):
        x, cond = next(it)
        noise = torch.randn_like(x)
        pred = unet(x + 0.1 * noise + text_encoder(cond))
        loss = torch.nn.functional.mse_loss(pred, noise)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ema.step(accelerator.unwrap_model(unet))


def dump(parts) -> dict:
    accelerator, text_encoder, unet, optimizer, scheduler, loader, ema = parts
    return {
        "unet": {k: v.clone() for k, v in accelerator.unwrap_model(unet).state_dict().items()},
        "text_encoder": {k: v.clone() for k, v in accelerator.unwrap_model(text_encoder).state_dict().items()},
        "ema": ema.state_dict(),
        "optimizer": optimizer.optimizer.state_dict(),
        "scheduler": scheduler.scheduler.state_dict(),
        "step": accelerator.step,
        "rng": torch.get_rng_state(),
    }


def save(out: str) -> None:
    parts = build(seed=1234)
    accelerator = parts[0]
    train(parts, steps=4)
    dirs = {name: os.path.join(out, name) for name in NAMES}

    if accelerator.is_main_process:  # the reference: Accelerate's own files
        accelerator.save_state(dirs["default"])
    accelerator.wait_for_everyone()

    handle = attach(accelerator)
    if accelerator.is_main_process:  # diffusers' pattern
        accelerator.save_state(dirs["main"])
    accelerator.wait_for_everyone()
    accelerator.save_state(dirs["every"])  # Accelerate's / transformers' no_trainer pattern
    accelerator.wait_for_everyone()
    handle.remove()

    handle = attach(accelerator, collective_save=True)  # balanced writes: every process must call
    accelerator.save_state(dirs["collective"])
    accelerator.wait_for_everyone()
    handle.remove()

    if accelerator.is_main_process:
        world = {n: bcp.inspect(os.path.join(dirs[n], CHECKPOINT_SUBDIR)).world_size for n in NAMES[1:]}
        with open(os.path.join(out, "save_info.json"), "w") as f:
            json.dump({"world_size": world}, f)
        print("SAVED", world, flush=True)
    accelerator.end_training()


def resume(out: str) -> None:
    for name in NAMES:
        parts = build(seed=999)  # a different init: loading must overwrite everything
        accelerator = parts[0]
        # data_order=False: compared with Accelerate's own resume, whose 1-process order is its own
        # (with data order the resume continues the 2-process run's order: test_data_order_accelerate.py)
        handle = attach(accelerator, data_order=False) if name != "default" else None
        accelerator.load_state(os.path.join(out, name))
        train(parts, steps=3)
        torch.save(dump(parts), os.path.join(out, f"final_{name}.pt"))
        if handle is not None:
            handle.remove()
    print("RESUMED", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _leave import leave

    {"save": save, "resume": resume}[sys.argv[1]](sys.argv[2])
    leave(0)
