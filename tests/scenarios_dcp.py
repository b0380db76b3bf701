"""PyTorch DCP checkpoints written by dcp.save on gloo ranks (FSDP2, rank-local metadata) and
loaded through bcp.load onto other layouts and world sizes (core/foreign/dcp.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import bytecheckpoint as bcp
from scenarios_fsdp2 import full_state, model_and_optim, train


def _plain_model_and_optim():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 24), torch.nn.ReLU(), torch.nn.Linear(24, 7))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def dcp_save_fsdp2(path: str, reference: str, rank_local: bool = False):
    """Stock DCP: FSDP2 + AdamW trained 3 steps, saved as dcp.save of get_state_dict (DTensors)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = model_and_optim(world)
    train(model, optim, rank)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "step": 3, "extra": {"seen": [rank, 5]}}, checkpoint_id=path,
             **({"use_collectives": False} if rank_local else {}))
    ref = full_state(model, optim)
    if rank == 0:
        torch.save(ref, reference)


def bcp_load_compare(path: str, reference: str, layout: str):
    """bcp.load of the DCP checkpoint into a fresh model + optimizer (fsdp2 at this world size,
    or a plain model on one process), compared bit for bit with the saved state."""
    if layout == "plain":
        model, optim = _plain_model_and_optim()
    else:
        model, optim = model_and_optim(dist.get_world_size())
    state = bcp.load(path, {"model": model, "optim": optim, "step": 0, "extra": {"seen": None}})
    assert state["step"] == 3, state["step"]
    ref = torch.load(reference)
    got = full_state(model, optim) if layout != "plain" else _plain_full(model, optim)
    assert set(got) == set(ref), set(got) ^ set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert optim.param_groups[0]["lr"] == 1e-2
    loss = model(torch.randn(4, 13)).pow(2).mean()  # training continues
    loss.backward()
    optim.step()
    print(f"dcp -> {layout} ok")


def _plain_full(model, optim):
    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, st in optim.state.items():
        for k, v in st.items():
            out[f"optim/{names[p]}/{k}"] = v
    return out


def plain_main(path: str, reference: str):
    """One process without a process group (how an evaluation job loads)."""
    bcp_load_compare(path, reference, "plain")
