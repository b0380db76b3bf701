"""Format-6 safetensors packs saved by 2 gloo ranks from replicated (DDP-style) state."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.tools.safetensors import link_views


def save_replicated_views(path: str, folder: str):
    """Every rank holds the same model; each tensor is written whole by one rank, so each rank writes
    one safetensors pack, and link_views shows them as a sharded Hugging Face folder (index + shards)."""
    torch.manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(512, 1024) for i in range(4)}  # 2 MiB each
    model["bias"] = torch.randn(7)
    bcp.save(path, {"model": model, "step": 3}, safetensors=["model"],
             before_commit=lambda md: link_views(path, md, "model", folder))
    dist.barrier()
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        md = bcp.Checkpointer().metadata(path)
        names = sorted(os.listdir(folder))
        assert md.version == 6 and len(md.safetensors["model"]) == 2, md.safetensors
        assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                         "model.safetensors.index.json"], names
        index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
        assert sorted(index["weight_map"]) == sorted(model)
        assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in model.values())
        got = {}
        for shard in sorted(set(index["weight_map"].values())):
            got.update(load_file(os.path.join(folder, shard)))
        assert got.keys() == model.keys() and all(torch.equal(got[k], v) for k, v in model.items())
        print("views ok", [sum(1 for v in index["weight_map"].values() if v == n) for n in names[:2]], flush=True)
