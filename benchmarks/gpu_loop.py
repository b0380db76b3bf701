"""The training-loop part of bench_gpu.py (issue 34): what an async save costs a GPU training loop,
with async staging against the blocking copy, the raw D2H copy and DCP's async staging.

A run: `steps` training steps (forward on random tokens, backward, AdamW step, zero_grad) with a save
every `every` steps, timed end to end with a final synchronize and the last save's wait; after a
warm-up of 3 steps and one save (allocations, plan cache, cuDNN/cuBLAS heuristics). Per mode, the
median over `repeats` runs, the modes interleaved:

  none          no saves (the reference)
  bcp_blocking  Checkpointer(async_save=True, async_staging=False): save() returns once the D2H copy landed
  bcp_staging   Checkpointer(async_save=True, async_staging=True): the optimizers' tensors copied on a
                side stream, the next optimizer step's stream waits for them (no CPU block)
  dcp_staging   DCP async_save with one DefaultStager(StagingOptions(use_pinned_memory=True,
                use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True)), its
                staging_completion waited right before optimizer.step (torchtitan's placement)

`run_loop(..., device="cpu")` runs the same code on CPU tensors (a smoke test of this script only;
bench_loop.py is the CPU measurement).
"""
from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Dict, List

import torch

MODES = ("none", "bcp_blocking", "bcp_staging", "dcp_staging")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Saver:
    stall: List[float]

    def __init__(self, mode: str, model, optim, root: str):
        self.mode, self.model, self.optim, self.root = mode, model, optim, root
        self.stall, self.fence, self.n = [], [], 0
        self.ckpt = self.stager = self.future = self.staging = None
        if mode.startswith("bcp"):
            import bytecheckpoint as bcp
            self.ckpt = bcp.Checkpointer(async_save=True, async_staging=mode == "bcp_staging")
            self.handles = []
        elif mode == "dcp_staging":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            gpu = torch.cuda.is_available()  # pinned memory and non-blocking copies need one (CPU: the smoke test)
            self.stager = DefaultStager(StagingOptions(gpu, False, True, gpu))

    def save(self) -> None:
        path = os.path.join(self.root, f"{self.mode}-{self.n % 2}")
        self.n += 1
        t0 = time.perf_counter()
        if self.ckpt is not None:
            self.handles.append(self.ckpt.save(path, {"model": self.model, "optim": self.optim}, overwrite=True))
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict
            if self.future is not None:
                self.future.result()
            shutil.rmtree(path, ignore_errors=True)
            msd, osd = get_state_dict(self.model, self.optim)
            r = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, async_stager=self.stager)
            self.staging, self.future = r.staging_completion, r.upload_completion
        self.stall.append(time.perf_counter() - t0)

    def before_step(self) -> None:
        if self.staging is not None:
            t0 = time.perf_counter()
            self.staging.result()
            self.staging = None
            self.stall[-1] += time.perf_counter() - t0

    def finish(self) -> None:
        if self.ckpt is not None:
            self.ckpt.wait()
            self.fence += [h.stats.get("fence_wait_s", 0.0) for h in self.handles]
            self.handles = []
        elif self.future is not None:
            self.future.result()

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.stager is not None:
            self.stager.close()


def run_loop(model, optim, root: str, *, steps: int = 60, every: int = 20, repeats: int = 3, batch: int = 8,
             seq: int = 256, vocab: int = 32000, device: str = "cuda") -> Dict[str, Dict[str, float]]:
    tokens = torch.randint(0, vocab, (batch, seq), device=device)

    def step(saver) -> None:
        model(tokens).float().pow(2).mean().backward()
        if saver is not None:
            saver.before_step()
        optim.step()
        optim.zero_grad(set_to_none=True)

    runs: Dict[str, List[float]] = {m: [] for m in MODES}
    stalls: Dict[str, List[float]] = {m: [] for m in MODES}
    fences: Dict[str, List[float]] = {m: [] for m in MODES}
    for rep in range(repeats):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            saver = None if mode == "none" else _Saver(mode, model, optim, root)
            for _ in range(3):
                step(saver)
            if saver is not None:
                saver.save()
                step(saver)
                saver.finish()
                saver.stall, saver.fence = [], []
            _sync(device)
            t0 = time.perf_counter()
            for i in range(steps):
                step(saver)
                if saver is not None and (i + 1) % every == 0:
                    saver.save()
            if saver is not None:
                saver.finish()
            _sync(device)
            runs[mode].append(time.perf_counter() - t0)
            if saver is not None:
                stalls[mode] += saver.stall
                fences[mode] += saver.fence
                saver.close()
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
    med = statistics.median
    saves = steps // every
    out = {}
    for mode in MODES:
        out[mode] = {"run_s": med(runs[mode]), "runs": runs[mode]}
        if mode != "none":
            out[mode].update(stall_s=med(stalls[mode]), cost_per_save_s=(med(runs[mode]) - med(runs["none"])) / saves)
            if fences[mode]:
                out[mode]["fence_wait_s"] = med(fences[mode])
    return out
