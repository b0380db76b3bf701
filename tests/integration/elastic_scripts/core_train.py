"""An elastic training script on the core API, as a user writes it (see elastic_common.py for the
test controls and the events it reports):

    path = bcp.latest(ckpt_dir)                      # None on a first launch
    if path is not None:
        bcp.load(path, state)                        # any world size: resharded at load
    ...
    bcp.save(f"{ckpt_dir}/step_{step}", state, async_save=True, step=step)   # every rank

Launched by torchrun's elastic agent (--nnodes=MIN:MAX, c10d rendezvous, --max-restarts), it is
restarted on the new world after a node is lost or joins and resumes by itself.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_common as ec  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    ec.hold_until_full()
    ec.init_gloo()
    ckpt_dir = os.path.join(ec.DIR, "ckpt")
    net = ec.model()
    ddp = DDP(net) if dist.is_initialized() else net
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    state = {"model": net, "optimizer": opt, "step": 0}

    path = bcp.latest(ckpt_dir)
    if path is not None:
        t0 = time.perf_counter()
        bcp.load(path, state)
        ec.emit("resumed", path=path, step=state["step"], load_s=time.perf_counter() - t0,
                digest=ec.digest(net.state_dict(), opt.state_dict()["state"]))
    else:
        ec.emit("fresh")

    step = state["step"]
    while step < ec.STEPS:
        step += 1
        ec.gate(step)
        loss = ec.loss_of(ddp, step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ec.emit("step", step=step, loss=loss.item())
        if ec.slow_from(step):
            ec.slow_writes(bcp.default_checkpointer())
        saved = ec.digest(net.state_dict(), opt.state_dict()["state"])
        path = f"{ckpt_dir}/step_{step}"
        bcp.save(path, {"model": net, "optimizer": opt, "step": step}, async_save=True, step=step)
        ec.emit("saving", step=step, digest=saved, path=path)
    bcp.wait_pending()
    ec.emit("done", step=step, digest=ec.digest(net.state_dict(), opt.state_dict()["state"]))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    ec.run(main)
    sys.stdout.flush()
    os._exit(0)  # gloo threads must not race interpreter finalization (tests/integration/_leave.py)
