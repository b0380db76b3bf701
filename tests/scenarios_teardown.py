"""The engine holds no process group: after its saves, loads and failed loads, destroy_process_group
ends every gloo thread (a group kept alive past it races Python's finalization: its worker thread
can abort the process at exit, "terminate called without an active exception")."""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from launcher_worker import gloo_threads


def save_load_fail_then_teardown(root: str) -> None:
    rank = dist.get_rank()
    state = {"model": {"w": torch.arange(4096, dtype=torch.float32), "mine": torch.full((3,), float(rank))},
             "step": 7}
    good, bad = os.path.join(root, "good"), os.path.join(root, "bad")
    bcp.save(good, state).wait()
    with bcp.Checkpointer(async_save=True, zero_redundancy=True) as ckpt:
        ckpt.save(bad, state).wait()
        ckpt.load(good, {"model": {"w": torch.zeros(4096), "mine": torch.zeros(3)}, "step": 0})
    dist.barrier()
    if rank == 0:  # damage every pack file of the second checkpoint: its load fails on every rank
        for d, _, files in os.walk(bad):
            for f in files:
                if f.endswith(".bin") and "pack" in d:
                    at = os.path.getsize(os.path.join(d, f)) // 2
                    with open(os.path.join(d, f), "r+b") as fh:
                        fh.seek(at)
                        b = fh.read(1)
                        fh.seek(at)
                        fh.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    try:
        bcp.load(bad, {"model": {"w": torch.zeros(4096), "mine": torch.zeros(3)}, "step": 0})
    except bcp.CheckpointError as exc:
        print(f"rank {rank}: load failed as expected: {type(exc).__name__}")
    else:
        raise AssertionError("a damaged checkpoint loaded")
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    left = gloo_threads()
    assert not left, f"rank {rank}: gloo threads still running after destroy_process_group: {left}"
    print(f"rank {rank}: teardown clean")
