"""FSDP2 through Accelerate (CUDA only): `fsdp2_resume.py save|load CKPT OUT` under torchrun.

save: train 3 steps sharded over the launched GPUs, dump FULL weights / optimizer state (by
      parameter name) from rank 0, save_state(CKPT) with an attached accelerator.
load: fresh sharded model (any process count), attach, load_state(CKPT), dump the same way.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, set_seed

from accelerate_bytecheckpoint import attach


def main() -> int:
    mode, ckpt, out = sys.argv[1:4]
    if "--force-cpu" in sys.argv:
        # Accelerate only turns FSDP on for GPU backends; force its FSDP2 code path on CPU/gloo.
        accelerator = Accelerator(cpu=True)
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        accelerator.state.distributed_type = DistributedType.FSDP
    else:
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    assert accelerator.is_fsdp2, accelerator.distributed_type
    set_seed(1 if mode == "save" else 2)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    handle = attach(accelerator)
    if mode == "save":
        for _ in range(3):
            loss = model(torch.randn(8, 16, device=accelerator.device)).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    else:
        accelerator.load_state(ckpt)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    dump = {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, opt.optimizer, options=full).get("state", {}),  # full: rank 0 only
    }
    if mode == "save":
        accelerator.save_state(ckpt)
    if accelerator.is_main_process:
        torch.save(dump, os.path.join(out, "saved_0.pt" if mode == "save" else "loaded_0.pt"))
    handle.remove()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
