"""Stock DeepSpeed ZeRO 1/2/3 folders (engine.save_checkpoint on 2 gloo ranks) read through
bcp.load without DeepSpeed, onto one plain process and FSDP2 at other world sizes
(core/foreign/deepspeed.py). The oracle is DeepSpeed's own full view at save time."""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402


def stock_save(ds_dir: str, stage: int, oracle: str, bf16: bool = False) -> None:
    """Train 2 steps under ZeRO-`stage`; DeepSpeed's own save_checkpoint with a client state."""
    import scenarios_deepspeed as S
    S._init()
    engine = S._engine(stage, bf16=bf16)
    for s in range(2):
        S._step(engine, s, bf16)
    engine.save_checkpoint(ds_dir, tag="global_step2", client_state={"epoch": 3, "sampler": {"seen": 24},
                                                                       "args": argparse.Namespace(lr=1)})
    full = S.full_view(engine)
    buffers = {n: b.detach().clone() for n, b in engine.module.named_buffers()}
    if dist.get_rank() == 0:
        torch.save({"full": full, "buffers": buffers}, oracle)
    print(f"rank {dist.get_rank()}: DS SAVED {stage}", flush=True)


def _model_and_optim(layout: str):
    import scenarios_deepspeed as S
    torch.manual_seed(77)  # other weights than the saved ones
    model = S._model()
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.5, 0.5), weight_decay=0.0)


def _full(model, optim):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    def whole(v):
        return v.full_tensor() if isinstance(v, DTensor) else v
    msd = {k: whole(v) for k, v in get_model_state_dict(model).items()}
    osd = get_optimizer_state_dict(model, optim)
    return msd, {fqn: {k: whole(v) for k, v in st.items()} for fqn, st in osd["state"].items()}


def stock_load(ds_dir: str, oracle: str, layout: str) -> None:
    """bcp.load of the DeepSpeed folder into a fresh model + AdamW: fp32 master weights, Adam
    moments, buffers, hyper-parameters, step and client state all as DeepSpeed held them."""
    model, optim = _model_and_optim(layout)
    state = bcp.load(ds_dir, {"model": model, "optimizer": optim, "deepspeed": None, "epoch": 0, "sampler": None,
                              "args": None}, allow_pickle=True)  # `args` is an argparse.Namespace
    ref = torch.load(oracle)
    msd, osd = _full(model, optim)
    for name, _ in model.named_parameters():
        assert torch.equal(msd[name], ref["full"][f"{name}.fp32"]), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(osd[name][k], ref["full"][f"{name}.{k}"]), (name, k)
        assert float(osd[name]["step"]) == 2.0, osd[name]["step"]
    for name, want in ref["buffers"].items():
        assert torch.equal(msd[name], want), name
    group = optim.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (1e-2, (0.9, 0.95), 0.1), group
    assert state["epoch"] == 3 and state["sampler"] == {"seen": 24} and state["args"].lr == 1, state
    assert state["deepspeed"]["global_steps"] == 2 and state["deepspeed"]["zero_stage"] in (1, 2, 3)
    model(torch.randn(4, 37)).pow(2).mean().backward()  # training continues
    optim.step()
    print(f"deepspeed -> {layout} ok", flush=True)


def plain_main(ds_dir: str, oracle: str) -> None:
    stock_load(ds_dir, oracle, "plain")


def stock_into_engine(ds_dir: str, oracle: str, stage: int, bf16: bool = False) -> None:
    """The stock folder loaded into a fresh DeepSpeed engine of this world size and ZeRO stage
    through bcp.load (the engine form of the folder): DeepSpeed's full view equals the one at save;
    at the saved world size, one more step equals a resume through DeepSpeed's own load_checkpoint."""
    import scenarios_deepspeed as S
    S._init()
    ref = torch.load(oracle)
    engine = S._engine(stage, seed=123, bf16=bf16)
    state = bcp.load(ds_dir, {"engine": engine, "deepspeed": None, "epoch": 0, "sampler": None, "args": None},
                     allow_pickle=True)
    S._same(ref["full"], S.full_view(engine), f"ZeRO-{stage} on {dist.get_world_size()} vs DeepSpeed's view at save")
    S._same(ref["buffers"], {n: b.detach().clone() for n, b in engine.module.named_buffers()}, "buffers")
    assert engine.global_steps == 2 and state["epoch"] == 3, (engine.global_steps, state["epoch"])
    if dist.get_world_size() == 2:
        theirs = S._engine(stage, seed=321, bf16=bf16)
        theirs.load_checkpoint(ds_dir)
        S._step(engine, 2, bf16)
        S._step(theirs, 2, bf16)
        S._same(S._module_params(theirs), S._module_params(engine), "bytecheckpoint vs DeepSpeed's own resume")
    print(f"rank {dist.get_rank()}: INTO ENGINE ok", flush=True)
