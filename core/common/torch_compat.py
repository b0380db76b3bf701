"""Every access to a private torch attribute or module, in one place.

bytecheckpoint uses torch's public APIs wherever they exist. Where none does (FSDP1's flat
parameter bookkeeping, the `_StridedShard` placement of FSDP2 over TP, the ShardedTensor class of
FSDP1's sharded state dict), the access goes through a function here that checks the attribute is
present and otherwise fails with a message naming the torch version and what to do instead.
Tested with torch 2.11 to 2.15 (tests/unit and tests/dist pass on 2.11.0, 2.13.0 and 2.15.0: make
test-compat-torch).
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple, Type

import torch
from torch import nn

from .errors import CheckpointError

TESTED = "2.11 to 2.15"
FSDP1_ROUTE_ENV = "BCP_FSDP1_ROUTE"


class TorchCompatError(CheckpointError):
    """A private torch attribute bytecheckpoint relies on is missing in this torch version."""


def _missing(what: str, fix: str) -> TorchCompatError:
    return TorchCompatError(f"torch {torch.__version__} has no {what} (bytecheckpoint was tested with torch "
                            f"{TESTED}); {fix}")


def _attr(obj: Any, name: str, what: str, fix: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(f"{what} ({type(obj).__name__}.{name})", fix) from None


_FSDP1_FIX = (f"save FSDP1 models through their sharded state dict instead: Checkpointer(fsdp1_route="
              f"'sharded_tensor') ({FSDP1_ROUTE_ENV}=sharded_tensor for bcp.save/load; slower, all-gathers inside "
              f"FSDP), or use a torch version bytecheckpoint was tested with")


# ------------------------------------------------------------------ FSDP1 (FullyShardedDataParallel)

def fsdp1_class() -> Optional[Type[nn.Module]]:
    """FullyShardedDataParallel (public), or None in torch builds without distributed."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return FullyShardedDataParallel


def fsdp1_handle(fsdp_module: nn.Module) -> Any:
    """The FlatParamHandle of one FSDP1 module (None if it manages no parameters)."""
    return _attr(fsdp_module, "_handle", "FSDP1 flat-parameter handle", _FSDP1_FIX)


class ShardParamInfo(NamedTuple):
    """One original parameter's part of this rank's flat-parameter shard."""
    in_shard: bool
    offset_in_shard: int              # where it starts in the local flat shard
    numel_in_shard: int
    intra_param_start: int            # where that part starts in the flattened original parameter


class FlatParamInfo(NamedTuple):
    flat_param: torch.Tensor          # the FlatParameter; its .data is the local (padded) shard
    fqns: Tuple[str, ...]             # original parameters, relative to the FSDP module's wrapped module
    shapes: Tuple[Tuple[int, ...], ...]
    contiguous: Tuple[bool, ...]      # False: the flat data is in storage order, not row-major
    shards: Tuple[ShardParamInfo, ...]
    aliases: Tuple[Tuple[str, str], ...]  # tied weights, flattened once: (alias fqn, primary fqn), relative
    local_now: bool                   # False inside forward/backward, while the parameter is unsharded


def flat_param_info(handle: Any) -> FlatParamInfo:
    """FSDP1's bookkeeping of which original-parameter elements this rank's flat shard holds."""
    fp = _attr(handle, "flat_param", "FSDP1 FlatParamHandle.flat_param", _FSDP1_FIX)
    what = "FSDP1 FlatParameter bookkeeping"
    fqns = tuple(_attr(fp, "_fqns", what, _FSDP1_FIX))
    shapes = tuple(tuple(int(s) for s in shape) for shape in _attr(fp, "_shapes", what, _FSDP1_FIX))
    contiguous = tuple(bool(c) for c in _attr(fp, "_contiguities", what, _FSDP1_FIX))
    shards = []
    for info in _attr(fp, "_shard_param_infos", what, _FSDP1_FIX):
        try:
            if info.in_shard:
                shards.append(ShardParamInfo(True, int(info.offset_in_shard), int(info.numel_in_shard),
                                             int(info.intra_param_start_idx)))
            else:
                shards.append(ShardParamInfo(False, 0, 0, 0))
        except AttributeError as exc:
            raise _missing(f"{what} (_ShardParamInfo.{exc.name})", _FSDP1_FIX) from None
    if not (len(fqns) == len(shapes) == len(contiguous) == len(shards)):
        raise _missing(f"consistent {what} ({len(fqns)} names, {len(shapes)} shapes, {len(shards)} shard infos)",
                       _FSDP1_FIX)
    aliases = []
    for info in _attr(fp, "_shared_param_infos", what, _FSDP1_FIX):
        try:
            aliases.append((_join(info.module_name, info.param_name), _join(info.prim_module_name, info.prim_param_name)))
        except AttributeError as exc:
            raise _missing(f"{what} (SharedParamInfo.{exc.name})", _FSDP1_FIX) from None
    uses_sharding = bool(_attr(handle, "uses_sharded_strategy", "FSDP1 FlatParamHandle.uses_sharded_strategy",
                               _FSDP1_FIX))
    # NO_SHARD keeps the whole flat parameter at all times; sharded strategies hold the local shard
    # only between forward/backward passes.
    local_now = not uses_sharding or tuple(fp.shape) == tuple(_attr(fp, "_sharded_size", what, _FSDP1_FIX))
    return FlatParamInfo(fp, fqns, shapes, contiguous, tuple(shards), tuple(aliases), local_now)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def clean_fqn(name: str) -> str:
    """A parameter/buffer name without FSDP1 and activation-checkpoint wrapper prefixes (as FSDP1's
    own state dict names it)."""
    try:
        from torch.distributed.fsdp._common_utils import clean_tensor_name
    except ImportError:
        raise _missing("torch.distributed.fsdp._common_utils.clean_tensor_name", _FSDP1_FIX) from None
    return clean_tensor_name(name)


def non_persistent_buffers(module: nn.Module) -> frozenset:
    """Names of `module`'s own buffers that state_dict() leaves out."""
    return frozenset(_attr(module, "_non_persistent_buffers_set", "nn.Module non-persistent buffer names",
                           "report this torch version to bytecheckpoint"))


# ------------------------------------------------------------------ ShardedTensor (FSDP1 sharded state dict)

def sharded_tensor_class() -> Optional[type]:
    """ShardedTensorBase, the type of FSDP1 SHARDED_STATE_DICT values (None if torch has none)."""
    try:
        from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
    except ImportError:
        return None
    return ShardedTensorBase


def sharded_tensor_local_pieces(st: Any) -> Tuple[Tuple[int, ...], torch.dtype, List[Tuple[Tuple[int, ...], torch.Tensor]]]:
    """(global shape, dtype, [(offsets, local tensor)]) of a ShardedTensor, through its public methods."""
    meta = st.metadata()
    pieces = [(tuple(int(o) for o in shard.metadata.shard_offsets), shard.tensor) for shard in st.local_shards()]
    return tuple(int(s) for s in meta.size), meta.tensor_properties.dtype, pieces


# ------------------------------------------------------------------ DTensor placements

def strided_shard_class() -> Optional[type]:
    """_StridedShard (FSDP2 over a TP-sharded dim), or None if this torch has none."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return None
    return _StridedShard


def strided_split_factor(placement: Any) -> int:
    return int(_attr(placement, "split_factor", "_StridedShard.split_factor",
                     "redistribute the DTensor to Shard/Replicate placements before saving"))


def compute_local_shape_and_global_offset() -> Any:
    """torch's reference computation of a DTensor's local shape and first global offset."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as fn
    except ImportError:
        raise _missing("torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
                       "redistribute DTensors to Replicate() before saving, or use a tested torch version") from None
    return fn


def default_store() -> Optional[Any]:
    """The c10d key-value store of the default process group (the rendezvous every rank reached),
    or None. torch has no public accessor: `_get_default_store` since torch 1.x, checked here."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        raise _missing("torch.distributed.distributed_c10d._get_default_store",
                       "the local tier's liveness check needs it; pin torch to a release that has it")
    return getter()
