"""Handlers for torch.distributed value types (state/registry.py registers what `handlers()` lists):
DTensor (any mix of Replicate / Shard / _StridedShard), ShardedTensor (FSDP1's sharded state
dict) and DistributedDataParallel (saved as the module it wraps)."""
from __future__ import annotations

from typing import Any, List, Tuple

from ..common import torch_compat
from . import dtensors
from .flatten import Handler, Piece, TensorEntry, tensor_entry

try:  # optional at import time (torch builds without distributed)
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel
except ImportError:  # pragma: no cover
    DTensor = DistributedDataParallel = None


class DTensorHandler(Handler):
    """The boxes this rank holds (a rank's part under _StridedShard may be several), loaded in place."""

    def __init__(self) -> None:
        self.layouts = dtensors.LayoutCache()

    def save(self, value, key, walk):
        shape, layout, pieces = dtensors.dtensor_pieces(key, value, self.layouts)
        walk.add_tensor(tensor_entry(key, value, shape, layout, pieces, dtensors.dtensor_grid(value, self.layouts)))
        return {"tensor": key}

    def load(self, value, key, walk, assign):
        self.save(value, key, walk)


class ShardedTensorHandler(Handler):
    """FSDP1's SHARDED_STATE_DICT values: each local shard is a box (loaded in place)."""

    def save(self, value, key, walk):
        shape, dtype, layout, pieces = dtensors.sharded_tensor_pieces(key, value)
        walk.add_tensor(TensorEntry(key, dtype, shape, layout, [
            Piece(tuple(offs), tuple(t.shape), t) for offs, t in pieces]))
        return {"tensor": key}

    def load(self, value, key, walk, assign):
        self.save(value, key, walk)


class DDPHandler(Handler):
    """The wrapped module, without DDP's 'module.' prefix (as DCP's state_dict API names it), so a
    DDP checkpoint and any other layout's have the same keys."""

    def save(self, value, key, walk):
        return walk.save(value.module, key)

    def load(self, value, key, walk, assign):
        walk.load(value.module, key, lambda v: None)


def handlers() -> List[Tuple[Any, Handler]]:
    """(type, handler) for each of these types this torch build has."""
    out: List[Tuple[Any, Handler]] = []
    if DTensor is not None:
        out += [(DTensor, DTensorHandler()), (DistributedDataParallel, DDPHandler())]
    if torch_compat.sharded_tensor_class() is not None:
        out.append((torch_compat.sharded_tensor_class(), ShardedTensorHandler()))
    return out
