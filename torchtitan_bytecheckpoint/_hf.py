"""Hugging Face safetensors at the two ends of a torchtitan run, through the model's own state-dict
adapter (torchtitan's `sd_adapter`: to_hf / from_hf rename, split and permute tensors):

* `last_save_in_hf`: the last step's model, saved by every rank (its own shards), is read back whole
  on rank 0 and written as `<folder>/step-<N>/model.safetensors` with the Hugging Face names, as
  torchtitan's DCP manager writes it. The bytecheckpoint copy it is read from is removed after.
* `initial_load_in_hf`: rank 0 reads the safetensors files, turns them into torchtitan's names, and
  saves them as a one-process bytecheckpoint checkpoint; every rank then loads its own shards from it
  (resharded by parameter name, like any checkpoint), and the copy is removed.

Both hold the whole model in rank 0's memory once (as torchtitan's own consolidation does).
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import bytecheckpoint as bcp

log = logging.getLogger("torchtitan_bytecheckpoint")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_last(ckpt: bcp.Checkpointer, path: str, model_state: Dict[str, Any], sd_adapter: Any) -> None:
    """`model_state`: {"model": the parts or their cast state dict}; writes path/model.safetensors."""
    gather = path.rstrip("/") + ".bcp-to-hf"
    ckpt.save(gather, model_state, async_save=False, overwrite=True)
    try:
        if _rank() == 0:
            full = ckpt.load_full(gather, keys=["model"], process_group=bcp.LOCAL)["model"]
            hf = sd_adapter.to_hf(full)
            os.makedirs(path, exist_ok=True)
            save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(path, "model.safetensors"),
                      metadata={"format": "pt"})
            ckpt.delete(gather)
    finally:
        _barrier()  # the other ranks wait for rank 0's file (or its error)
    log.info("bytecheckpoint: wrote %s/model.safetensors (Hugging Face names)", path)


def _hf_files(hf_dir: str) -> List[str]:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {hf_dir} (initial_load_in_hf)")
    return files


def load_initial(ckpt: bcp.Checkpointer, hf_dir: str, model_parts: list, sd_adapter: Any, scratch: str) -> None:
    """Load the model parts from Hugging Face safetensors in `hf_dir` (via a copy under `scratch`)."""
    staged = os.path.join(scratch, ".initial-hf.bcp")
    try:
        if _rank() == 0:
            hf: Dict[str, torch.Tensor] = {}
            for f in _hf_files(hf_dir):
                hf.update(load_file(f))
            ckpt.save(staged, {"model": sd_adapter.from_hf(hf)}, async_save=False, overwrite=True,
                      process_group=bcp.LOCAL)
    finally:
        _barrier()  # the other ranks wait for rank 0's copy (without it their load below fails too)
    ckpt.load(staged, {"model": model_parts})
    _barrier()
    if _rank() == 0:
        ckpt.delete(staged)
