"""Rank programs for tests/dist/test_deepspeed.py: DeepSpeed ZeRO engines on CPU with gloo.

The oracle is DeepSpeed itself: `safe_get_full_fp32_param` / `safe_get_full_optimizer_state`
(its own reassembly of every rank's partition) at save time, and its own
`save_checkpoint` / `load_checkpoint` for the next training step at the same world size."""
from __future__ import annotations

import importlib
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402

KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def skip_shm_build() -> None:
    """Before DeepSpeed's init: its CPU accelerator JIT-builds a shared-memory allreduce op there
    (~60 s with g++); gloo needs none. (`import deepspeed.comm.torch as m` would give torch itself.)"""
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _init():
    import deepspeed
    skip_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)


def _model(bf16: bool = False) -> torch.nn.Module:
    """Odd sizes, a LayerNorm, and (fp32) a BatchNorm whose running statistics (buffers, different
    on each rank) training changes; DeepSpeed's bf16 mode casts the module, which BatchNorm's
    fp32 statistics do not follow."""
    norm = [] if bf16 else [torch.nn.BatchNorm1d(53)]
    return torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.LayerNorm(53), torch.nn.GELU(), *norm,
                               torch.nn.Linear(53, 11))


def _engine(stage: int, seed: int = 0, bf16: bool = False):
    import deepspeed
    torch.manual_seed(seed)
    model = _model(bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    config = {"train_micro_batch_size_per_gpu": 12 // dist.get_world_size() if dist.get_world_size() in (1, 2, 3)
              else 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _step(engine, step: int, bf16: bool = False) -> None:
    r, w = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(12, 37, generator=g), torch.randn(12, 11, generator=g)
    n = 12 // w
    x, y = x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]
    out = engine(x.to(torch.bfloat16) if bf16 else x)
    engine.backward(torch.nn.functional.mse_loss(out.float(), y))
    engine.step()


def full_view(engine) -> dict:
    """DeepSpeed's own full view of the fp32 master weights and Adam moments (collective): the
    oracle of every DeepSpeed test (also the Lightning and Accelerate ones)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"{name}.fp32"] = safe_get_full_fp32_param(p).clone()
        for key in KEYS[1:]:
            out[f"{name}.{key}"] = safe_get_full_optimizer_state(p, key).clone()
    return out


def _full(engine) -> dict:
    """DeepSpeed's own view of the training state, with the step."""
    return {**full_view(engine), "step": engine.global_steps}


def _buffers(engine) -> dict:
    return {n: b.detach().clone() for n, b in engine.module.named_buffers()}


def _module_params(engine) -> dict:
    import deepspeed
    out = {}
    for n, p in engine.module.named_parameters():
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p]):
                out[n] = p.data.detach().clone()
        else:
            out[n] = p.data.detach().clone()
    return out


def _differs(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y))
    return x != y


def _same(a: dict, b: dict, what: str) -> None:
    bad = [k for k in a if _differs(a[k], b[k])]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} entries differ, e.g. {bad[:4]}")


def save(path: str, stage: int, oracle: str, bf16: bool = False, ds_dir: str = "") -> None:
    """Train 2 steps; save with bytecheckpoint (and with DeepSpeed's own save_checkpoint to ds_dir);
    record DeepSpeed's full view, then one more step's parameters (the continuation oracle)."""
    _init()
    engine = _engine(stage, bf16=bf16)
    for s in range(2):
        _step(engine, s, bf16)
    handle = bcp.save(path, {"engine": engine, "note": "deepspeed"})
    assert not handle.is_async
    if ds_dir:
        engine.save_checkpoint(ds_dir, tag="t")
    full = _full(engine)
    buffers = _buffers(engine)
    _step(engine, 2, bf16)
    after = _module_params(engine)
    if dist.get_rank() == 0:
        torch.save({"full": full, "after": after, "buffers": buffers}, oracle)
    print(f"rank {dist.get_rank()}: SAVED stage {stage}", flush=True)


def load(path: str, stage: int, oracle: str, bf16: bool = False, next_step: bool = False, ds_dir: str = "") -> None:
    """Load into a fresh engine (other seed) of this world size and stage: DeepSpeed's full view
    must equal the saved one bit for bit; with next_step (same world size), one more step gives the
    same parameters as the uninterrupted run and as a resume through DeepSpeed's own checkpoint."""
    _init()
    ref = torch.load(oracle, weights_only=False)
    engine = _engine(stage, seed=123, bf16=bf16)
    state = {"engine": engine, "note": None}
    bcp.load(path, state)
    got = _full(engine)
    _same(ref["full"], got, f"stage {stage} on {dist.get_world_size()} ranks vs DeepSpeed's view at save")
    _same(ref["buffers"], _buffers(engine), "module buffers (BatchNorm statistics)")
    if state["note"] != "deepspeed":
        raise AssertionError(state["note"])
    if next_step:
        _step(engine, 2, bf16)
        _same(ref["after"], _module_params(engine), "the next step after a bytecheckpoint resume")
        if ds_dir:
            theirs = _engine(stage, seed=321, bf16=bf16)
            theirs.load_checkpoint(ds_dir, tag="t")
            _step(theirs, 2, bf16)
            _same(_module_params(theirs), _module_params(engine), "bytecheckpoint vs DeepSpeed's own resume")
    print(f"rank {dist.get_rank()}: LOADED stage {stage} OK", flush=True)


def load_into_plain_model(path: str, oracle: str) -> None:
    """One process, no DeepSpeed: the engine's checkpoint read whole (load_full) gives each
    parameter's fp32 master weights, the same as DeepSpeed's full view."""
    ref = torch.load(oracle, weights_only=False)["full"]
    whole = bcp.load_full(path)["engine"]
    for key, want in ref.items():
        if key == "step":
            continue
        name, what = key.rsplit(".", 1)
        if not torch.equal(whole[name][what], want):
            raise AssertionError(f"{key}: load_full differs from DeepSpeed's view")
    print("PLAIN OK", flush=True)


def load_vs_universal(path: str, stage: int, universal: str) -> None:
    """This world size: a bytecheckpoint load and DeepSpeed's own way to change the world size
    (ds_to_universal, then load_checkpoint with load_universal) give the same engine: same full
    view (fp32 master weights, Adam moments), same step counter, and one more step gives the
    same parameters."""
    _init()
    ours = _engine(stage, seed=123)
    bcp.load(path, {"engine": ours, "note": None})
    import deepspeed
    torch.manual_seed(321)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    config = dict(ours.config)
    config["checkpoint"] = {"load_universal": True}
    theirs, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    theirs.load_checkpoint(universal, tag="t")
    _same(_full(theirs), _full(ours), "bytecheckpoint load vs DeepSpeed's universal load")
    _step(ours, 2)
    _step(theirs, 2)
    _same(_module_params(theirs), _module_params(ours), "the next step after each")
    print(f"rank {dist.get_rank()}: UNIVERSAL MATCH on {dist.get_world_size()}", flush=True)
