"""Accelerate + DeepSpeed ZeRO (CPU, gloo) with attach(): `--mode save` trains 3 steps on N
processes and calls save_state on every process (DeepSpeed's calling contract); `--mode load`
builds a fresh engine (another seed) on M processes, load_state, and checks the engine's fp32
master weights and Adam moments against DeepSpeed's own full view at save time, bit for bit."""
import argparse
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from accelerate import Accelerator, DeepSpeedPlugin  # noqa: E402
from accelerate.utils import InitProcessGroupKwargs  # noqa: E402

from accelerate_bytecheckpoint import attach  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
from scenarios_deepspeed import full_view, skip_shm_build  # noqa: E402  full_view: DeepSpeed's own, the oracle


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["save", "load"], required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--stock", action="store_true", help="save without attach: Accelerate's own DeepSpeed folders")
    args = p.parse_args()
    skip_shm_build()
    torch.set_num_threads(1)
    plugin = DeepSpeedPlugin(zero_stage=args.stage)
    plugin.deepspeed_config.update({"zero_allow_untested_optimizer": True, "train_micro_batch_size_per_gpu": 2})
    acc = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    torch.manual_seed(0 if args.mode == "save" else 77)
    model = torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.LayerNorm(53), torch.nn.GELU(), torch.nn.Linear(53, 11))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, opt = acc.prepare(model, opt)
    handle = attach(acc) if not (args.stock and args.mode == "save") else None
    if args.mode == "save":
        for step in range(3):
            g = torch.Generator().manual_seed(step * 10 + acc.process_index)
            loss = torch.nn.functional.mse_loss(engine(torch.randn(2, 37, generator=g)), torch.randn(2, 11, generator=g))
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        acc.save_state(os.path.join(args.dir, "ckpt"))
        view = full_view(engine)
        if acc.is_main_process:
            torch.save(view, os.path.join(args.dir, "oracle.pt"))
            print("FILES", sorted(os.listdir(os.path.join(args.dir, "ckpt"))), flush=True)
    else:
        acc.load_state(os.path.join(args.dir, "ckpt"))
        want = torch.load(os.path.join(args.dir, "oracle.pt"), weights_only=False)
        got = full_view(engine)
        bad = [k for k in want if not torch.equal(want[k], got[k])]
        if bad:
            print(f"MISMATCH {bad[:5]}", flush=True)
            sys.exit(1)
        print(f"LOADED OK on {acc.num_processes}", flush=True)
    if handle is not None:
        handle.remove()
    acc.end_training()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _leave import leave

    main()
    leave(0)
