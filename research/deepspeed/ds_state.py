"""DeepSpeed ZeRO 1/2/3 state as FlatShard views (prototype for bytecheckpoint).

flat_state(engine) -> {param_name: {"fp32": FlatShard, "exp_avg": FlatShard, "exp_avg_sq": FlatShard,
                                     "step": 0-d tensor, ["lp": FlatShard | tensor]},
                        "__param_groups__": [hyperparameter dicts], "__engine__": {counters}}

Every tensor in it is a *view* into DeepSpeed's own buffers (fp32 master partition, the torch
optimizer's state tensors, bf16 ds_tensor / bit16 flat buffer, the step tensor), so a load that
writes in place restores the engine; then call after_load(engine, state).

Written against DeepSpeed 0.19.8 / torch 2.13.0. Names that are not documented DeepSpeed API are
read only inside the small `_ds_*` functions below, each naming the version it was read from.
Supported: DeepSpeedZeroOptimizer (ZeRO-1/2, fp32/bf16/fp16), BF16_Optimizer (bf16 + ZeRO-1 with
fp32 grad accumulation), DeepSpeedZeroOptimizer_Stage3 (no param/optimizer offload, no NVMe,
no MiCS/hpZ secondary partitions checked). Optimizer: torch.optim.Adam/AdamW (state materialised
on a fresh engine); any optimizer whose state already exists is exposed generically.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Dict, List, Tuple

import torch

from bytecheckpoint import FlatShard  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed import comm as dist  # noqa: E402

PARAM_GROUPS_KEY = "__param_groups__"
ENGINE_KEY = "__engine__"


# --------------------------------------------------------------------------------------------
# Public-ish DeepSpeed names
# --------------------------------------------------------------------------------------------

def zero_stage(engine) -> int:
    """ZeRO stage (0 when ZeRO is off). Public DeepSpeedEngine method."""
    return int(engine.zero_optimization_stage())


def _names(engine) -> Dict[int, str]:
    return {id(p): n for n, p in engine.module.named_parameters()}


# --------------------------------------------------------------------------------------------
# Private DeepSpeed names, isolated (read from DeepSpeed 0.19.8)
# --------------------------------------------------------------------------------------------

def _ds_kind(opt) -> str:
    # DeepSpeed 0.19.8: class names in runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py,
    # runtime/bf16_optimizer.py.
    name = type(opt).__name__
    if name == "DeepSpeedZeroOptimizer_Stage3":
        return "z3"
    if name == "DeepSpeedZeroOptimizer":
        return "z12"
    if name == "BF16_Optimizer":
        return "bf16opt"
    raise NotImplementedError(f"ds_state: unsupported DeepSpeed optimizer wrapper {name}")


def _ds_z12_groups(opt) -> List[Tuple[List[torch.nn.Parameter], torch.Tensor]]:
    # DeepSpeed 0.19.8: stage_1_and_2.py:364 single_partition_of_fp32_groups, bit16_groups;
    # bf16_optimizer.py:105/109 bf16_groups, fp32_groups_flat_partition. Index i of both lists
    # is param group i of the wrapped torch optimizer.
    if _ds_kind(opt) == "bf16opt":
        return list(zip(opt.bf16_groups, opt.fp32_groups_flat_partition))
    return list(zip(opt.bit16_groups, opt.single_partition_of_fp32_groups))


def _ds_z12_fragment(p) -> Tuple[int, int, int]:
    """(start in the flattened param, start in the fp32 partition, numel) or None.
    DeepSpeed 0.19.8 utils/tensor_fragment.py: p._hp_mapping is a tensor_fragment with
    lp_fragment_address / hp_fragment_address (fragment_address(numel, start)); None when this
    rank's partition holds no element of p."""
    m = getattr(p, "_hp_mapping", None)
    if m is None:
        return None
    assert m.lp_fragment_address.numel == m.hp_fragment_address.numel
    return m.lp_fragment_address.start, m.hp_fragment_address.start, m.hp_fragment_address.numel


def _ds_z12_link_optimizer_state(opt) -> None:
    # DeepSpeed 0.19.8 stage_1_and_2.py:852 / bf16_optimizer.py:357: points
    # p._hp_mapping.optim_fragment at the optimizer state (done lazily after the first step);
    # safe_get_full_optimizer_state needs it. Idempotent (guarded by _hp_optimizer_states_linked).
    opt._lazy_init_hp_params_optimizer_state()


def _ds_z3_subgroups(opt):
    """[(params, fp32 flat partition, param group index)] for ZeRO-3.
    DeepSpeed 0.19.8 stage3.py:913-1000 fp16_groups (sub groups of params), fp32_partitioned_groups_flat,
    sub_group_to_group_id; the fp32 flat partition is the concatenation, in fp16_groups order,
    of each param's partition of p.partition_numel() elements (grad_position has the same offsets)."""
    return [(params, opt.fp32_partitioned_groups_flat[i], opt.sub_group_to_group_id[i])
            for i, params in enumerate(opt.fp16_groups)]


def _ds_z3_refresh_lp(opt) -> None:
    # DeepSpeed 0.19.8 stage3.py:2854 _reassign_or_swap_out_partitioned_parameters (what step()
    # does after the optimizer step) : fp16_partitioned_groups_flat[i] <- fp32 partition,
    # then re-point each p.ds_tensor at its slice (already so without offload; kept for safety).
    for i in range(len(opt.fp16_groups)):
        if opt.fp16_partitioned_groups_flat[i] is None:
            raise NotImplementedError("ds_state: ZeRO-3 NVMe param offload is not supported")
        opt._reassign_or_swap_out_partitioned_parameters(i)


def _ds_check_supported(engine) -> None:
    # DeepSpeed 0.19.8 engine.py public config accessors.
    def offloaded(cfg):
        return cfg is not None and getattr(getattr(cfg, "device", None), "value", "none") != "none"
    if offloaded(engine.zero_offload_optimizer()) or engine.zero_nvme_offload_optimizer():
        raise NotImplementedError("ds_state prototype: optimizer offload not supported yet")
    if zero_stage(engine) == 3 and offloaded(engine.zero_offload_param()):
        raise NotImplementedError("ds_state prototype: ZeRO-3 param offload not supported yet")


# --------------------------------------------------------------------------------------------
# Optimizer state
# --------------------------------------------------------------------------------------------

def _hp_flats(engine) -> List[Tuple[torch.Tensor, int]]:
    opt = engine.optimizer
    if _ds_kind(opt) == "z3":
        return [(flat, gid) for _, flat, gid in _ds_z3_subgroups(opt)]
    return [(flat, gid) for gid, (_, flat) in enumerate(_ds_z12_groups(opt))]


def materialize_optimizer_state(engine) -> None:
    """Create the torch optimizer state that a fresh engine lacks (it is created lazily on the
    first step), exactly as torch.optim.Adam(W)._init_group would, so that there is something
    to load into. Idempotent."""
    opt = engine.optimizer
    inner = opt.optimizer  # the client torch optimizer, wrapped by DeepSpeed (public attribute)
    for flat, gid in _hp_flats(engine):
        st = inner.state[flat]
        if len(st) == 0:
            if not isinstance(inner, torch.optim.Adam):  # AdamW subclasses Adam in torch 2.13
                raise NotImplementedError(f"ds_state: cannot create state for {type(inner).__name__}; "
                                          "run one step before loading")
            group = inner.param_groups[gid]
            if group.get("capturable") or group.get("fused"):
                raise NotImplementedError("ds_state: capturable/fused Adam not supported")
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
    if _ds_kind(opt) != "z3":
        _ds_z12_link_optimizer_state(opt)


def _state_views(inner, flat: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], Any]:
    st = inner.state[flat]
    tensors = {k: v for k, v in st.items() if torch.is_tensor(v) and v.shape == flat.shape}
    return tensors, st.get("step")


# --------------------------------------------------------------------------------------------
# flat_state
# --------------------------------------------------------------------------------------------

def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}


def flat_state(engine, *, with_lp: bool = None) -> Dict[str, Any]:
    """Views of this rank's part of every trainable parameter's training state.

    with_lp: include the low-precision module weights (default: only when they are not fp32).
    ZeRO-1/2 lp weights are replicated (plain tensor = written once); ZeRO-3 lp are FlatShards.
    """
    _ds_check_supported(engine)
    opt = engine.optimizer
    kind = _ds_kind(opt)
    inner = opt.optimizer
    names = _names(engine)
    materialize_optimizer_state(engine)
    out: Dict[str, Any] = {}

    def add(p, flat, fp32_start, global_start, numel, lp_view):
        name = names[id(p)]
        shape = tuple(p.ds_shape) if kind == "z3" else tuple(p.shape)
        tensors, step = _state_views(inner, flat)
        # .detach(): the fp32 partition is the torch optimizer's leaf param (requires_grad=True);
        # an in-place write into a plain view of it would raise outside no_grad.
        entry = {"fp32": FlatShard(flat.detach().narrow(0, fp32_start, numel), shape, global_start)}
        for k, t in tensors.items():
            entry[k] = FlatShard(t.detach().narrow(0, fp32_start, numel), shape, global_start)
        if step is not None:
            entry["step"] = step  # the optimizer's own 0-d tensor: replicated, loaded in place
        if with_lp is not False and lp_view is not None:
            lp_dtype = lp_view.local.dtype if isinstance(lp_view, FlatShard) else lp_view.dtype
            if with_lp or lp_dtype != torch.float32:
                entry["lp"] = lp_view
        out[name] = entry

    if kind == "z3":
        for params, flat, gid in _ds_z3_subgroups(opt):
            off = 0
            for p in params:
                pn = p.partition_numel()
                rank = dist.get_rank(group=p.ds_process_group)
                start = min(rank * pn, p.ds_numel)
                numel = max(0, min(pn, p.ds_numel - rank * pn))  # last rank: drop padding_size()
                lp = FlatShard(p.ds_tensor.detach().narrow(0, 0, numel), tuple(p.ds_shape), start)
                add(p, flat, off, start, numel, lp)
                off += pn
            assert off == flat.numel(), (off, flat.numel())
    else:
        for params, flat in _ds_z12_groups(opt):
            for p in params:
                frag = _ds_z12_fragment(p)
                lp = p.data if p.data.is_contiguous() else None  # full, replicated on every rank
                if frag is None:  # this rank owns no element of p: empty shard keeps keys uniform
                    add(p, flat, 0, 0, 0, lp)
                else:
                    lp_start, hp_start, numel = frag
                    add(p, flat, hp_start, lp_start, numel, lp)
    missing = [n for n, p in engine.module.named_parameters() if p.requires_grad and n not in out]
    assert not missing, f"ds_state: params not found in the optimizer: {missing}"
    out[PARAM_GROUPS_KEY] = [_hyper(g) for g in inner.param_groups]
    out[ENGINE_KEY] = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                       "skipped_steps": engine.skipped_steps}
    return out


# --------------------------------------------------------------------------------------------
# after_load
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def after_load(engine, state: Dict[str, Any] = None) -> None:
    """Make the engine consistent after the views of flat_state were written in place.

    Collective: call on every rank.
    - ZeRO-1/2 / BF16_Optimizer: optimizer.update_lp_params() (the model weights are a separate
      buffer, also in fp32 mode: copy own fp32 partition -> own lp partition, then all-gather).
    - ZeRO-3: partition all params, copy fp32 partitions -> lp partitions (ds_tensor), re-gather the
      persistent (small, always-gathered) params: DeepSpeed's own load_checkpoint sequence
      checkpoint_event_prologue / ... / checkpoint_event_epilogue.
    - state given: write back the param-group hyperparameters and engine counters (plain values
      are replaced, not loaded in place, by the library).
    """
    opt = engine.optimizer
    if _ds_kind(opt) == "z3":
        opt.checkpoint_event_prologue()
        _ds_z3_refresh_lp(opt)
        opt.checkpoint_event_epilogue()
    else:
        opt.update_lp_params()
    if state is not None:
        groups = state.get(PARAM_GROUPS_KEY)
        if groups is not None:
            inner = opt.optimizer
            assert len(groups) == len(inner.param_groups), "param group count changed"
            for g, saved in zip(inner.param_groups, groups):
                for k, v in saved.items():
                    g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
        counters = state.get(ENGINE_KEY)
        if counters:
            engine.global_steps = counters["global_steps"]
            engine.global_samples = counters["global_samples"]
            engine.skipped_steps = counters["skipped_steps"]
        if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "step"):
            pass  # an lr_scheduler is a Stateful object: put engine.lr_scheduler in the checkpoint state


def iter_shards(state: Dict[str, Any]):
    """(key, FlatShard-or-tensor) for every tensor entry of flat_state (for tests/tools)."""
    for name, entry in state.items():
        if name.startswith("__"):
            continue
        for k, v in entry.items():
            yield f"{name}.{k}", v
