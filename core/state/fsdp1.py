"""FSDP1 (FullyShardedDataParallel) models and their optimizers, keyed like every other layout.

Users pass the model and the optimizer; ModuleHandler / OptimizerHandler (state/flatten.py) send any
module that is or contains FSDP1 modules (and, on the flat route, its optimizer) here. The route
is the Checkpointer's `fsdp1_route` option (default "flat"; BCP_FSDP1_ROUTE for Checkpointers
built from the environment):

- "flat" (default, the paper's route). Each rank's FlatParameter shard is cut into per-original-
  parameter `FlatShard`s (elements [start, stop) of the flattened original parameter), from FSDP's
  own bookkeeping (`_fqns`, `_shapes`, `_shard_param_infos`, see common/torch_compat.py). Nothing is
  all-gathered and nothing is copied: the save writes straight from the flat shard, and a load
  reads straight into it. Optimizer state that is element-wise (exp_avg, ...) is a flat shard too
  (use_orig_params=False: of the FlatParameter; True: of the original parameter's local part) and
  is cut the same way; scalar state (step) is stored per original parameter, like DCP does.
- "sharded_tensor" (fallback). The values FSDP1's SHARDED_STATE_DICT and sharded optimizer state
  dict produce (get_model_state_dict here; the optimizer takes OptimizerHandler's generic path,
  whose get_optimizer_state_dict gives FSDP's sharded optimizer state dict): ShardedTensor local
  shards become regions. FSDP all-gathers every flat parameter (and its optimizer state) and copies
  out row chunks before anything is written, and all-gathers again on load. Kept, selected with
  fsdp1_route="sharded_tensor", for a torch version whose FSDP1 internals the flat route does not
  know (common/torch_compat.py then fails saying so) and as the measured alternative. docs/sharded.md has
  the measurements.

Both routes produce the same keys as DCP's get_state_dict on any other layout, so a checkpoint
saved from FSDP1 loads into FSDP1 at another world size, FSDP2, DDP or a plain model, and back.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..common import torch_compat
from ..common.errors import CheckpointError
from ..common.shards import FlatShard
from ..collectives.comm import Comm
from . import optimizers

log = logging.getLogger("bytecheckpoint")
ROUTES = ("flat", "sharded_tensor")
_FSDP = torch_compat.fsdp1_class()


def holds_fsdp1(module: Optional[nn.Module]) -> bool:
    """True if `module` is or contains a FullyShardedDataParallel module."""
    if _FSDP is None or module is None:
        return False
    return isinstance(module, _FSDP) or any(isinstance(m, _FSDP) for m in module.modules())


def uses_flat_route(module: Optional[nn.Module], route: str) -> bool:
    """FSDP1 through the flat route. (On the ShardedTensor route an FSDP1 model's optimizer goes
    through the generic DCP-named path, which gives FSDP's sharded optimizer state dict.)"""
    return holds_fsdp1(module) and route == "flat"


# ------------------------------------------------------------------ the flat layout of a model

@dataclass
class ParamPart:
    """One original parameter's part of this rank's flat shard."""
    fqn: str
    shape: Tuple[int, ...]
    flat_param: torch.Tensor
    offset: int                       # in the local flat shard
    numel: int                        # 0: this rank holds none of it
    start: int                        # in the flattened original parameter

    def cut(self, flat: torch.Tensor) -> FlatShard:
        """This parameter's elements of a tensor laid out like the local flat shard."""
        return FlatShard(flat.detach()[self.offset:self.offset + self.numel], self.shape, self.start)


@dataclass
class FlatLayout:
    params: Dict[str, ParamPart] = field(default_factory=dict)          # fqn -> part, in flat order
    by_flat_param: Dict[int, List[str]] = field(default_factory=dict)   # id(FlatParameter) -> fqns
    aliases: Dict[str, str] = field(default_factory=dict)               # tied weight name -> primary fqn
    groups: List[Any] = field(default_factory=list)                     # distinct FSDP process groups


def flat_layout(model: nn.Module) -> FlatLayout:
    """Where each FSDP-managed original parameter lies in this rank's flat shards."""
    layout = FlatLayout()
    for name, module in model.named_modules():
        if not isinstance(module, _FSDP):
            continue
        handle = torch_compat.fsdp1_handle(module)
        if handle is None:
            continue
        info = torch_compat.flat_param_info(handle)
        fqns = []
        for rel, shape, contiguous, shard in zip(info.fqns, info.shapes, info.contiguous, info.shards):
            fqn = torch_compat.clean_fqn(f"{name}.{rel}" if name else rel)
            fqns.append(fqn)
            if not contiguous:
                raise CheckpointError(
                    f"parameter {fqn!r} was not contiguous when FSDP1 flattened it, so its flat shard holds it in "
                    f"storage order, which neither bytecheckpoint nor FSDP's own sharded state dict can describe. "
                    f"Make it contiguous before wrapping (module.weight = nn.Parameter(weight.contiguous())). "
                    f"Nothing was written")
            if not info.local_now:
                raise CheckpointError(
                    f"parameter {fqn!r}: its FSDP1 flat parameter is unsharded right now (inside forward/backward, "
                    f"or summon_full_params); save and load between training steps")
            layout.params[fqn] = ParamPart(fqn, shape, info.flat_param, shard.offset_in_shard, shard.numel_in_shard,
                                           shard.intra_param_start)
        layout.by_flat_param[id(info.flat_param)] = fqns
        for alias, primary in info.aliases:
            layout.aliases[torch_compat.clean_fqn(f"{name}.{alias}" if name else alias)] = \
                torch_compat.clean_fqn(f"{name}.{primary}" if name else primary)
        group = getattr(module, "process_group", None)
        if all(group is not g for g in layout.groups):
            layout.groups.append(group)
    return layout


def route_for(model: nn.Module, route: str) -> Tuple[str, Optional[FlatLayout]]:
    return (route, flat_layout(model)) if route == "flat" else (route, None)


# ------------------------------------------------------------------ model

def model_state(model: nn.Module, layout: FlatLayout) -> Dict[str, Any]:
    """key -> FlatShard (FSDP-managed parameters), tensor (other parameters, persistent buffers) or
    extra state; the same keys as the model's state_dict() without FSDP (a tied weight under each name)."""
    sd: Dict[str, Any] = {fqn: part.cut(part.flat_param) for fqn, part in layout.params.items()}
    for alias, primary in layout.aliases.items():  # a tied weight is stored under each of its names
        sd[alias] = layout.params[primary].cut(layout.params[primary].flat_param)
    for name, p in model.named_parameters():
        fqn = torch_compat.clean_fqn(name)
        if id(p) not in layout.by_flat_param and fqn not in layout.params:  # not managed by FSDP (ignored)
            sd[fqn] = p.detach()
    for mname, module in model.named_modules():
        skip = torch_compat.non_persistent_buffers(module)
        for bname, buf in module.named_buffers(recurse=False):
            if bname not in skip:
                sd[torch_compat.clean_fqn(f"{mname}.{bname}" if mname else bname)] = buf
    for module, key in _extra_state_keys(model):
        sd[key] = module.get_extra_state()
    return sd


def save_module(model: nn.Module, key: str, walk: Any) -> Any:
    route, layout = route_for(model, walk.fsdp1_route)
    if route == "sharded_tensor":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return walk.save(get_model_state_dict(model), key)
    return walk.save(model_state(model, layout), key)


def load_module(model: nn.Module, key: str, walk: Any) -> None:
    route, layout = route_for(model, walk.fsdp1_route)
    if route == "sharded_tensor":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
        sd = get_model_state_dict(model)
        walk.load(sd, key, lambda v: None)
        walk.flat.finalizers.append(lambda: set_model_state_dict(model, sd))
        return
    sd = model_state(model, layout)  # parameters and buffers are loaded in place
    walk.load(sd, key, lambda v: None)
    extra = {k: m for m, k in _extra_state_keys(model)}
    if extra:
        walk.flat.finalizers.append(lambda: [m.set_extra_state(sd[k]) for k, m in extra.items() if k in sd])


def _extra_state_keys(model: nn.Module):
    """(module, key) of every module that keeps extra state (get_extra_state overridden)."""
    for mname, module in model.named_modules():
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            yield module, torch_compat.clean_fqn(f"{mname}._extra_state" if mname else "_extra_state")


# ------------------------------------------------------------------ optimizer

def save_optimizer(optim: torch.optim.Optimizer, model: nn.Module, key: str, walk: Any) -> Any:
    return walk.save(optimizer_state(optim, model, flat_layout(model), for_load=False), key)


def load_optimizer(optim: torch.optim.Optimizer, model: nn.Module, key: str, walk: Any) -> None:
    layout = flat_layout(model)
    if optimizers.saved_without_state(walk.saved, key):  # saved before its first step: groups only, no state
        loaded = {"osd": {"state": {}, "param_groups": optimizer_state(optim, model, layout, True)["param_groups"]}}
        walk.load(loaded["osd"], key, lambda v: loaded.__setitem__("osd", v))
        walk.flat.finalizers.append(lambda: optimizers.load_groups_only(optim, loaded["osd"]))
        return
    ensure_state(optim)  # loading needs state tensors to read into
    osd = optimizer_state(optim, model, layout, for_load=True)
    walk.load(osd, key, lambda v: None)
    walk.flat.finalizers.append(lambda: apply_param_groups(optim, osd["param_groups"],
                                                           layout_fqns(optim, model, layout)))


def layout_fqns(optim: torch.optim.Optimizer, model: nn.Module, layout: FlatLayout) -> List[List[str]]:
    """For each param group: the original-parameter names of its parameters."""
    names = {id(p): torch_compat.clean_fqn(n) for n, p in model.named_parameters()}
    out = []
    for group in optim.param_groups:
        fqns: List[str] = []
        for p in group["params"]:
            fqns.extend(layout.by_flat_param.get(id(p)) or [names.get(id(p), f"<unnamed {id(p)}>")])
        out.append(fqns)
    return out


def optimizer_state(optim: torch.optim.Optimizer, model: nn.Module, layout: FlatLayout, for_load: bool
                    ) -> Dict[str, Any]:
    """{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}, as DCP's
    get_optimizer_state_dict names it, with element-wise state cut into per-parameter FlatShards."""
    names = {id(p): torch_compat.clean_fqn(n) for n, p in model.named_parameters()}
    state: Dict[str, Dict[str, Any]] = {}
    lacking: List[Tuple[str, ParamPart]] = []   # orig params this rank holds no state for (not in its shard)
    problems: List[str] = []
    uses_orig_params = False
    for p in (p for g in optim.param_groups for p in g["params"]):
        st = optim.state.get(p, {})
        flat_fqns = layout.by_flat_param.get(id(p))
        if flat_fqns is not None:                       # use_orig_params=False: a FlatParameter
            for fqn in flat_fqns:
                state[fqn] = _cut_state(st, p, layout.params[fqn].cut, fqn, problems)
            continue
        fqn = names.get(id(p))
        part = layout.params.get(fqn) if fqn is not None else None
        if part is not None:                            # use_orig_params=True: a view of the flat shard
            uses_orig_params = True
            if st:
                cut = lambda v, part=part: FlatShard(v.detach(), part.shape, part.start if part.numel else 0)
                state[fqn] = _cut_state(st, p, cut, fqn, problems)
            else:
                lacking.append((fqn, part))
        elif st:                                        # a parameter FSDP does not manage: whole
            state[fqn or f"<unnamed {id(p)}>"] = dict(st)
    if uses_orig_params and not for_load:  # the same decision on every rank: the model's configuration
        _fill_lacking(state, lacking, layout, problems)
    elif problems:
        raise CheckpointError(problems[0])
    groups = []
    for group, fqns in zip(optim.param_groups, layout_fqns(optim, model, layout)):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}


def _cut_state(st: Dict[str, Any], p: torch.Tensor, cut: Callable[[torch.Tensor], FlatShard], fqn: str,
               problems: List[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, v in st.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if tuple(v.shape) != tuple(p.shape):
                problems.append(f"optimizer state {name!r} of parameter {fqn!r} has shape {list(v.shape)}, neither "
                                f"a scalar nor shaped like its FSDP1 flat shard {list(p.shape)}; FSDP1 checkpoints "
                                f"support element-wise optimizer state (Adam, AdamW, SGD momentum, ...) only")
                continue
            out[name] = cut(v)
        else:
            out[name] = v
    return out


def _fill_lacking(state: Dict[str, Dict[str, Any]], lacking: List[Tuple[str, ParamPart]], layout: FlatLayout,
                  problems: List[str]) -> None:
    """use_orig_params=True: a rank holding none of a parameter has no optimizer state for it, but every
    rank must describe the same keys. Learn their names/dtypes from the peers that hold the state
    (one small all-gather over each FSDP process group; errors travel with it so no rank waits)."""
    schema = {fqn: {n: _kind(v) for n, v in st.items()} for fqn, st in state.items() if fqn in layout.params}
    gathered = [peer for group in layout.groups or [None]
                for peer in Comm(group).all_gather((schema, problems[:1]))]
    errors = [e for _, errs in gathered for e in errs]
    if errors:
        raise CheckpointError(errors[0])
    for fqn, part in lacking:
        kinds: Dict[str, Tuple] = {}
        for peer, _ in gathered:
            kinds.update(peer.get(fqn, {}))
        entry: Dict[str, Any] = {}
        for name, kind in kinds.items():
            if kind[0] == "flat":            # element-wise: this rank holds no elements
                entry[name] = FlatShard(torch.empty(0, dtype=kind[1]), part.shape, 0)
            elif kind[0] == "scalar":        # held (and written) by the ranks that have it
                entry[name] = FlatShard(torch.empty(0, dtype=kind[1]), (), 0)
        if entry:
            state[fqn] = entry


def _kind(v: Any) -> Tuple:
    if isinstance(v, FlatShard):
        return ("flat", v.local.dtype)
    if isinstance(v, torch.Tensor):
        return ("scalar", v.dtype)
    return ("object",)


def ensure_state(optim: torch.optim.Optimizer) -> None:
    """Give every trainable parameter lacking optimizer state its state, as DCP does for a fresh
    optimizer: one step with zero gradients at lr=0, touching only those parameters. Needed before a
    load (the state tensors are the targets) and for FSDP1 use_orig_params=True, where a rank has no
    state for parameters outside its shard."""
    params = [p for g in optim.param_groups for p in g["params"]]
    missing = [p for p in params if p.requires_grad and not optim.state.get(p)]
    if not missing:
        return
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optim.param_groups]
    try:
        for p in params:
            p.grad = None
        for p in missing:
            p.grad = torch.zeros_like(p)
        for g in optim.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def apply_param_groups(optim: torch.optim.Optimizer, loaded: List[Dict[str, Any]], fqns: List[List[str]]) -> None:
    """Set each param group's hyperparameters from the saved group holding the same parameters
    (by name), or, failing that, from the saved group at the same index."""
    if not isinstance(loaded, list):
        return
    owner = {fqn: g for g in loaded if isinstance(g, dict) for fqn in g.get("params", ())}
    for i, (group, names) in enumerate(zip(optim.param_groups, fqns)):
        saved = next((owner[n] for n in names if n in owner), None)
        if saved is None and i < len(loaded) and len(loaded) == len(optim.param_groups):
            saved = loaded[i]
        if isinstance(saved, dict):
            for k, v in saved.items():
                if k != "params" and k in group:
                    group[k] = v
