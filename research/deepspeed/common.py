"""Shared helpers for the checks: CPU init, model, engine, data, gather/reassemble/load."""
from __future__ import annotations

import importlib
import math
import os
import time

T0 = time.time()
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

T_TORCH = time.time()
import deepspeed  # noqa: E402

T_DS = time.time()
import torch.distributed as tdist  # noqa: E402

sys_path = os.path.dirname(os.path.abspath(__file__))
import ds_state  # noqa: E402
from ds_state import FlatShard  # noqa: E402


def init_dist():
    # Skip the ~60 s JIT build of DeepSpeed's shared-memory allreduce op (CPU accelerator).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    t = time.time()
    deepspeed.init_distributed(dist_backend="gloo")  # torchrun provides RANK/WORLD_SIZE/MASTER_*
    torch.set_num_threads(1)
    return time.time() - t


def rank():
    return tdist.get_rank()


def world():
    return tdist.get_world_size()


def log(*a):
    print(f"[rank{rank()}/{world()}]", *a, flush=True)


def log0(*a):
    if rank() == 0:
        print(*a, flush=True)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.LayerNorm(53), torch.nn.GELU(),
                               torch.nn.Linear(53, 11))


def ds_config(stage, bf16=False, persist=None, universal=False, clip=1.0):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if stage == 3 and persist is not None:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persist
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def make_engine(stage, bf16=False, seed=0, persist=None, universal=False, lr=1e-2):
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=ds_config(stage, bf16, persist, universal))
    return engine


def batch(step, r=None, ws=None, bf16=False):
    """Global batch of 12 samples per step, split evenly over the world."""
    r = rank() if r is None else r
    ws = world() if ws is None else ws
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(12, 37, generator=g)
    y = torch.randn(12, 11, generator=g)
    n = 12 // ws
    x, y = x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]
    if bf16:
        x = x.to(torch.bfloat16)
    return x, y


def train_step(engine, step, bf16=False):
    x, y = batch(step, bf16=bf16)
    out = engine(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


# ------------------------------------------------------------------ gather / load

def gather_full(state):
    """Reassemble every entry of flat_state across ranks -> {key: full tensor (global shape)}."""
    mine = {}
    for key, v in ds_state.iter_shards(state):
        if isinstance(v, FlatShard):
            mine[key] = ("flat", v.global_shape, v.start, v.local.detach().clone().reshape(-1))
        else:
            mine[key] = ("rep", tuple(v.shape), 0, v.detach().clone())
    allr = [None] * world()
    tdist.all_gather_object(allr, mine)
    full = {}
    for key in mine:
        kinds = {a[key][0] for a in allr}
        assert len(kinds) == 1, (key, kinds)
        kind, shape = allr[0][key][0], allr[0][key][1]
        if kind == "rep":
            for a in allr[1:]:
                assert torch.equal(a[key][3], allr[0][key][3]), f"replicated {key} differs across ranks"
            full[key] = allr[0][key][3]
            continue
        n = math.prod(shape)
        dtype = allr[0][key][3].dtype
        buf = torch.zeros(n, dtype=dtype)
        cover = torch.zeros(n, dtype=torch.int32)
        for a in allr:
            _, s, start, t = a[key]
            assert tuple(s) == tuple(shape)
            buf[start:start + t.numel()] = t
            cover[start:start + t.numel()] += 1
        assert bool((cover == 1).all()), f"{key}: coverage {cover.min().item()}..{cover.max().item()}"
        full[key] = buf.view(shape)
    return full


def zero_views(state):
    for _, v in ds_state.iter_shards(state):
        (v.local if isinstance(v, FlatShard) else v).zero_()


def load_into(state, full):
    """What the library does at load: write the saved values into the views, in place."""
    for key, v in ds_state.iter_shards(state):
        src = full[key]
        if isinstance(v, FlatShard):
            v.local.view(-1).copy_(src.reshape(-1)[v.start:v.stop])
        else:
            v.copy_(src)


def safe_full(engine, key):
    """DeepSpeed's own reassembly for a flat_state key (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    name, what = key.rsplit(".", 1)
    p = dict(engine.module.named_parameters())[name]
    if what == "fp32":
        return safe_get_full_fp32_param(p)
    if what in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        return safe_get_full_optimizer_state(p, what)
    return None


def full_module_params(engine):
    """Full lp module params (ZeRO-3: gathered)."""
    out = {}
    for n, p in engine.module.named_parameters():
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p]):
                out[n] = p.data.detach().clone()
        else:
            out[n] = p.data.detach().clone()
    return out


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
