"""DeepSpeed ZeRO 1/2/3 engines as checkpoint state: each rank's own partition, as FlatShard views.

`flat_state(engine)` -> {parameter name: {"fp32": FlatShard, "exp_avg": FlatShard, "exp_avg_sq":
FlatShard, "step": 0-d tensor, ["lp": FlatShard | tensor]}, "__param_groups__": [...],
"__engine__": {counters}}. Every tensor is a view into DeepSpeed's own buffers (the fp32 master
partition, the torch optimizer's state, the bf16/fp16 module weights, the step tensor), so saving
needs no all-gather and a load that writes in place restores the engine; `after_load` then makes
the engine consistent (collective). The saved layout does not depend on the world size or the
ZeRO stage (padding excluded): the engine's load-time resharding does the rest.

The only module that reads DeepSpeed's private names, each inside a small `_ds_*` function that
names the release it was read from (tested with DeepSpeed 0.19.8). Not supported (refused with a
clear error): optimizer or parameter offload, NVMe, fp16 with a loss scaler's own state beyond the
weights, several optimizer wrappers. Measured and checked in tests/dist/test_deepspeed.py; design
notes in docs/deepspeed.md.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..common.errors import CheckpointError
from ..common.shards import FlatShard
from .flatten import Handler

TESTED = "0.19.8"
PARAM_GROUPS_KEY = "__param_groups__"
ENGINE_KEY = "__engine__"
MODULE_KEY = "__module__"   # buffers and frozen parameters: whole on every rank (not partitioned)


class DeepSpeedCompatError(CheckpointError):
    """A DeepSpeed configuration or release this integration does not handle."""


def _unsupported(what: str) -> DeepSpeedCompatError:
    try:
        import deepspeed
        version = deepspeed.__version__
    except ImportError:  # pragma: no cover - only called with an engine in hand
        version = "?"
    return DeepSpeedCompatError(f"bytecheckpoint's DeepSpeed support (tested with {TESTED}; this is {version}) does "
                                f"not handle {what}")


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
    raise _unsupported(f"the optimizer wrapper {name}")


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
    if m.lp_fragment_address.numel != m.hp_fragment_address.numel:
        raise _unsupported("a parameter fragment whose fp32 and module parts differ in size")
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
            raise _unsupported("ZeRO-3 NVMe parameter offload")
        opt._reassign_or_swap_out_partitioned_parameters(i)


def _ds_check_supported(engine) -> None:
    if zero_stage(engine) not in (1, 2, 3):
        raise _unsupported(f"ZeRO stage {zero_stage(engine)} (save the engine's module and optimizer instead)")
    # DeepSpeed 0.19.8 engine.py public config accessors.
    def offloaded(cfg):
        return cfg is not None and getattr(getattr(cfg, "device", None), "value", "none") != "none"
    if offloaded(engine.zero_offload_optimizer()) or engine.zero_nvme_offload_optimizer():
        raise _unsupported("optimizer offload (offload_optimizer)")
    if zero_stage(engine) == 3 and offloaded(engine.zero_offload_param()):
        raise _unsupported("ZeRO-3 parameter offload (offload_param)")


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
                raise _unsupported(f"loading into a fresh {type(inner).__name__} (only Adam/AdamW state is "
                                   f"created before the first step); run one step before loading")
            group = inner.param_groups[gid]
            if group.get("capturable") or group.get("fused"):
                raise _unsupported("capturable or fused Adam")
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


def flat_state(engine, *, with_lp: Optional[bool] = None, for_save: bool = False) -> Dict[str, Any]:
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
                rank = torch.distributed.get_rank(group=p.ds_process_group)
                start = min(rank * pn, p.ds_numel)
                numel = max(0, min(pn, p.ds_numel - rank * pn))  # last rank: drop padding_size()
                lp = FlatShard(p.ds_tensor.detach().narrow(0, 0, numel), tuple(p.ds_shape), start)
                add(p, flat, off, start, numel, lp)
                off += pn
            if off != flat.numel():
                raise _unsupported(f"a ZeRO-3 partition of {flat.numel()} elements whose parameters cover {off}")
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
    if missing:
        raise _unsupported(f"trainable parameters the optimizer does not hold ({missing[:5]})")
    out[MODULE_KEY] = _replicated_module_state(engine, kind, for_save)
    out[PARAM_GROUPS_KEY] = [_hyper(g) for g in inner.param_groups]
    out[ENGINE_KEY] = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                       "skipped_steps": engine.skipped_steps}
    return out


def _replicated_module_state(engine, kind: str, for_save: bool) -> Dict[str, Any]:
    """The module's persistent buffers (e.g. BatchNorm statistics) and frozen parameters: DeepSpeed
    does not partition them under ZeRO-1/2 (nor buffers under ZeRO-3), every rank holds them whole,
    and they may differ between ranks (BatchNorm statistics of each rank's data). As DeepSpeed's own
    checkpoint does, rank 0's copy is saved (a FlatShard of all of it there, empty elsewhere), and
    every rank loads it whole."""
    module = engine.module
    skip = {f"{m}.{b}" if m else b for m, sub in module.named_modules() for b in sub._non_persistent_buffers_set}
    out = {n: b for n, b in module.named_buffers() if n not in skip}
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    if frozen and kind == "z3":
        raise _unsupported(f"frozen parameters under ZeRO-3 ({[n for n, _ in frozen][:5]})")
    out.update({n: p.data for n, p in frozen})
    if not for_save:
        return out
    first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    return {n: FlatShard(t if first else t.reshape(-1)[:0], tuple(t.shape), 0) for n, t in out.items()}


# --------------------------------------------------------------------------------------------
# after_load
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def after_load(engine, state: Optional[Dict[str, Any]] = None) -> None:
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
            if len(groups) != len(inner.param_groups):
                raise CheckpointError(f"DeepSpeed engine: the checkpoint has {len(groups)} optimizer param groups, "
                                      f"this engine {len(inner.param_groups)}; build it with the same groups")
            for g, saved in zip(inner.param_groups, groups):
                for k, v in saved.items():
                    g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
        counters = state.get(ENGINE_KEY)
        if counters:
            engine.global_steps = counters["global_steps"]
            engine.global_samples = counters["global_samples"]
            engine.skipped_steps = counters["skipped_steps"]


# ---------------------------------------------------------------------- the handler

ENGINE_CLASS = "deepspeed.runtime.engine.DeepSpeedEngine"  # registered by name: deepspeed stays optional


class DeepSpeedEngineHandler(Handler):
    """A DeepSpeed ZeRO engine: saved as each rank's own partition (flat_state, no all-gather),
    loaded in place into an engine of any world size and ZeRO stage."""

    def save(self, value, key, walk):
        return walk.save(flat_state(value, for_save=True), key)

    def load(self, value, key, walk, assign):
        state = flat_state(value)
        walk.load(state, key, lambda v: None)
        # plain values (hyperparameters, counters) land in `state` by then; after_load is
        # collective, and every rank of a load runs the finalizers
        walk.flat.finalizers.append(lambda: after_load(value, state))
