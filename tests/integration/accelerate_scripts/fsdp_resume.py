"""FSDP through Accelerate: `fsdp_resume.py save|load CKPT OUT [options]` under torchrun.

save: train 3 steps sharded over the launched processes, dump FULL weights / optimizer state (by
      parameter name) from rank 0, save_state(CKPT) with an attached accelerator.
load: fresh sharded model (any process count, any FSDP version), attach, load_state(CKPT), dump
      the same way.

Options: --fsdp-version 1|2 (Accelerate's default plugin is FSDP1), --state-dict-type
FULL_STATE_DICT|SHARDED_STATE_DICT (the plugin's; bytecheckpoint's format does not depend on it),
--force-cpu (Accelerate enables FSDP only on GPU backends: force its FSDP code path on CPU/gloo,
FSDP2 only), --main-only-then-fail (see main_only_save_of_sharded_state).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

import bytecheckpoint as bcp
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, set_seed

from accelerate_bytecheckpoint import attach


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    if args.plain:  # no FSDP at all: one process or DDP on CPU
        return Accelerator(cpu=True)
    plugin_kwargs = {} if args.fsdp_version is None else {"fsdp_version": args.fsdp_version}
    if args.state_dict_type:
        plugin_kwargs["state_dict_type"] = args.state_dict_type
    if args.force_cpu:
        accelerator = Accelerator(cpu=True)
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_kwargs)
        accelerator.state.distributed_type = DistributedType.FSDP
        # ...in PartialState too, as AcceleratorState does on GPU (every AcceleratorState() made
        # later, e.g. by AcceleratedOptimizer, copies the type from PartialState)
        PartialState().distributed_type = DistributedType.FSDP
        if args.fsdp_version != 2:  # FSDP1 on CPU wants device_id=cpu; Accelerate's CPU device is cpu:0
            accelerator.state.device = PartialState().device = torch.device("cpu")
        return accelerator
    # FullyShardedDataParallelPlugin() with no arguments is Accelerate's default: FSDP1
    return Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**plugin_kwargs))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--fsdp-version", type=int, default=None)
    p.add_argument("--state-dict-type", default=None)
    p.add_argument("--force-cpu", action="store_true")
    p.add_argument("--main-only-then-fail", action="store_true")
    p.add_argument("--also-full-to", default=None, help="save: then save again with FULL_STATE_DICT set on the model")
    p.add_argument("--tag", default="0", help="load: dump to loaded_<tag>.pt")
    p.add_argument("--stock", action="store_true", help="save: Accelerate's own save_state (no attach)")
    p.add_argument("--plain", action="store_true", help="load: a plain accelerator (no FSDP)")
    args = p.parse_args()
    mode, ckpt, out = args.mode, args.ckpt, args.out
    accelerator = make_accelerator(args)
    assert args.plain or accelerator.is_fsdp2 == (args.fsdp_version == 2), (accelerator.is_fsdp2, args.fsdp_version)
    set_seed(1 if mode == "save" else 2)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    if args.plain or accelerator.is_fsdp2:  # FSDP2 (and no FSDP): model and optimizer prepared together
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:  # FSDP1: the optimizer is built on the prepared model's parameters
        model = accelerator.prepare(model)
        opt = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if not args.plain:
        assert accelerator.distributed_type == DistributedType.FSDP, accelerator.distributed_type  # still, after prepare
    handle = None if args.stock else attach(accelerator)
    if mode == "save":
        for _ in range(3):
            loss = model(torch.randn(8, 16, device=accelerator.device)).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    else:
        accelerator.load_state(ckpt)
    # FSDP1 on CPU cannot offload what is already on the CPU
    full = StateDictOptions(full_state_dict=True, cpu_offload=accelerator.device.type != "cpu")
    dump = {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, opt.optimizer, options=full).get("state", {}),  # full: rank 0 only
    }
    if mode == "save":
        accelerator.save_state(ckpt)
        if args.also_full_to:  # the state dict type Accelerate set on the FSDP1 module must not matter
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
            FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)
            accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
            accelerator.save_state(args.also_full_to)
    if accelerator.is_main_process:
        torch.save(dump, os.path.join(out, "saved_0.pt" if mode == "save" else f"loaded_{args.tag}.pt"))
    if handle is not None:
        handle.remove()
    accelerator.wait_for_everyone()
    if args.main_only_then_fail:
        main_only_save_of_sharded_state(accelerator, ckpt + "_main_only")
    accelerator.end_training()
    return 0


def main_only_save_of_sharded_state(accelerator, directory: str) -> None:
    """diffusers' `if accelerator.is_main_process: save_state(d)` + wait_for_everyone() with sharded
    (FSDP) state, whose save is collective: the main process must raise PeerTimeoutError within
    the checkpointer's timeout_s, and the other process must end with an error (its barrier
    fails once the main process is gone), not hang. Each prints its outcome and leaves at once."""
    attach(accelerator, bcp.Checkpointer(timeout_s=5))
    t0 = time.monotonic()
    if accelerator.is_main_process:
        try:
            accelerator.save_state(directory)
            print("MAIN SAVED (unexpected)", flush=True)
            os._exit(1)
        except bcp.PeerTimeoutError as exc:
            print(f"MAIN PeerTimeoutError after {time.monotonic() - t0:.2f} s: {exc}", flush=True)
            os._exit(0)
    try:
        accelerator.wait_for_everyone()
        print("OTHER BARRIER PASSED (unexpected)", flush=True)
        os._exit(1)
    except Exception as exc:  # noqa: BLE001 - the main process left: any error is the expected outcome
        print(f"OTHER ERROR after {time.monotonic() - t0:.2f} s: {type(exc).__name__}", flush=True)
        os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _leave import leave

    leave(main() or 0)
