"""User-facing descriptions of a rank's part of a global tensor."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Tuple

import torch


def _as_shape(value: Sequence[int], what: str) -> Tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in value)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {value!r}") from None
    if any(v < 0 for v in shape):
        raise ValueError(f"{what} must not contain negative values, got {list(shape)}")
    return shape


@dataclass(frozen=True)
class Shard:
    """A box of a global tensor held by this rank: `local` sits at `offsets`."""
    local: torch.Tensor
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise TypeError(f"Shard.local must be a torch.Tensor, got {type(self.local).__name__}")
        gs = _as_shape(self.global_shape, "Shard.global_shape")
        offs = _as_shape(self.offsets, "Shard.offsets")
        if not (len(gs) == len(offs) == self.local.dim()):
            raise ValueError(f"Shard: local has {self.local.dim()} dims, global_shape {list(gs)} and offsets "
                             f"{list(offs)} must have the same number of dims")
        for d, (o, l, g) in enumerate(zip(offs, self.local.shape, gs)):
            if o + l > g:
                raise ValueError(f"Shard: dim {d} covers [{o}, {o + l}) but global_shape[{d}] is {g}; "
                                 f"fix offsets or global_shape")
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "offsets", offs)


@dataclass(frozen=True)
class FlatShard:
    """Elements [start, start + local.numel()) of the row-major flattened global tensor.

    This is how ZeRO / FSDP1 hold parameters: a cut of the flat buffer that need not be a box.
    `local` may have any shape; its elements are taken in row-major order. It must be
    contiguous so that loading can write into it in place.
    """
    local: torch.Tensor
    global_shape: Tuple[int, ...]
    start: int

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise TypeError(f"FlatShard.local must be a torch.Tensor, got {type(self.local).__name__}")
        gs = _as_shape(self.global_shape, "FlatShard.global_shape")
        start = int(self.start)
        if start < 0 or start + self.local.numel() > math.prod(gs):
            raise ValueError(f"FlatShard: elements [{start}, {start + self.local.numel()}) do not fit in global "
                             f"shape {list(gs)} ({math.prod(gs)} elements)")
        if not self.local.is_contiguous():
            raise ValueError("FlatShard.local must be contiguous; call .contiguous() or pass the flat buffer")
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "start", start)

    @property
    def stop(self) -> int:
        return self.start + self.local.numel()
