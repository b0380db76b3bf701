"""Distributed tensor values -> the boxes this rank holds: DTensor (any mix of Replicate, Shard and
FSDP2-over-TP `_StridedShard`) and ShardedTensor (FSDP1's sharded state dict).

Each function returns (global shape, layout, [(global offsets, local view)]); the views alias the
value's local storage, so loading writes into it in place. Placements that hold no part of the
tensor (Partial: a pending reduction) are refused here, before anything is planned or written.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..common import torch_compat
from ..common.errors import CheckpointError
from ..geometry import placements as pm

Pieces = List[Tuple[Tuple[int, ...], torch.Tensor]]

SUPPORTED = "Replicate(), Shard(dim) and _StridedShard(dim, sf) (FSDP2 over tensor parallel)"

try:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard
except ImportError:  # pragma: no cover - torch built without distributed
    Replicate = DShard = None


def describe_placements(key: str, placements: Sequence[Any]) -> List[pm.PlacementDesc]:
    """Plain descriptions (see geometry/placements.py) of DTensor placements, or a refusal naming the key."""
    strided = torch_compat.strided_shard_class()
    out: List[pm.PlacementDesc] = []
    for p in placements:
        if strided is not None and isinstance(p, strided):
            out.append(("strided", int(p.dim), torch_compat.strided_split_factor(p)))
        elif isinstance(p, DShard):
            out.append(("shard", int(p.dim)))
        elif isinstance(p, Replicate):
            out.append(("replicate",))
        else:
            raise CheckpointError(_refusal(key, placements, p))
    return out


def _refusal(key: str, placements: Sequence[Any], bad: Any) -> str:
    shown = "(" + ", ".join(repr(p) for p in placements) + ")"
    if getattr(bad, "is_partial", lambda: False)():
        why = ("a Partial placement is a pending reduction: every rank holds an addend of the value, not a part "
               "of it, so there is nothing to write until it is reduced")
        fix = ("call value.redistribute(value.device_mesh, [Replicate() if p.is_partial() else p for p in "
               "value.placements]) (or .full_tensor()) before saving")
    else:
        why = f"bytecheckpoint does not know placement type {type(bad).__name__}"
        fix = "redistribute the value to supported placements before saving"
    return (f"tensor {key!r}: DTensor placements {shown} include {bad!r}, which cannot be saved: {why}. "
            f"Supported placements: {SUPPORTED}; {fix}. Nothing was written")


class LayoutCache:
    """What a DTensor's walk derives from its layout alone, kept per layout: (global shape, mesh shape,
    coordinate, placements) -> this rank's boxes and local shape, checked against torch's own
    computation once per layout; a placements tuple -> its descriptions; a mesh -> its shape and this
    rank's coordinate. Every save of an unchanged model describes the same layouts, and deriving
    them again was most of a DTensor's walk (~0.1 ms each, thousands per save)."""

    MAX = 1 << 16

    def __init__(self) -> None:
        self._boxes: dict = {}
        self._descs: dict = {}
        self._meshes: dict = {}   # id(mesh) -> (mesh, its shape, this rank's coordinate)

    def descs(self, key: str, placements: Sequence[Any]) -> List[pm.PlacementDesc]:
        try:
            hit = self._descs.get(placements)
        except TypeError:  # an unhashable placement type: described (and refused) every time
            return describe_placements(key, placements)
        if hit is None:
            hit = self._descs[placements] = describe_placements(key, placements)
        return hit

    def mesh(self, mesh: Any) -> Tuple[Tuple[int, ...], Optional[Tuple[int, ...]]]:
        hit = self._meshes.get(id(mesh))
        if hit is None or hit[0] is not mesh:  # (the id of a mesh that is gone may be reused)
            if len(self._meshes) >= self.MAX:
                self._meshes.clear()
            coordinate = mesh.get_coordinate()
            hit = self._meshes[id(mesh)] = (mesh, tuple(int(m) for m in mesh.shape),
                                            None if coordinate is None else tuple(int(c) for c in coordinate))
        return hit[1], hit[2]

    def boxes(self, key: str, dt: Any, shape, mesh_shape, coordinate, descs, local: torch.Tensor):
        k = (shape, mesh_shape, coordinate, tuple(descs))
        hit = self._boxes.get(k)
        if hit is None:
            runs = pm.local_runs(shape, mesh_shape, coordinate, descs)
            _check_against_torch(key, dt, runs, local)
            if len(self._boxes) >= self.MAX:
                self._boxes.clear()
            hit = self._boxes[k] = (pm.local_boxes(runs), pm.local_shape(runs))
        elif hit[1] != tuple(local.shape):  # the local tensor is not what this layout gives
            _check_against_torch(key, dt, pm.local_runs(shape, mesh_shape, coordinate, descs), local)
        return hit[0]


def dtensor_pieces(key: str, dt: Any, cache: Optional[LayoutCache] = None) -> Tuple[Tuple[int, ...], str, Pieces]:
    cache = cache or LayoutCache()
    descs = cache.descs(key, dt.placements)
    shape = tuple(int(s) for s in dt.shape)
    layout = "replicated" if all(d[0] == "replicate" for d in descs) else "sharded"
    mesh_shape, coordinate = cache.mesh(dt.device_mesh)
    local = dt.to_local()
    if coordinate is None:  # this rank is not in the DTensor's mesh
        return shape, layout, []
    boxes = cache.boxes(key, dt, shape, mesh_shape, coordinate, descs, local)
    if len(boxes) == 1:
        return shape, layout, [(boxes[0][0], local)]
    return shape, layout, [(offs, local[tuple(slice(lo, hi) for lo, hi in sl)]) for offs, _, sl in boxes]


def dtensor_grid(dt: Any, cache: Optional[LayoutCache] = None
                 ) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]]:
    """(mesh shape, the tensor dim each mesh dim shards or -1, this rank's coordinate) when every
    placement is Shard or Replicate: what the save planner describes once per tensor. None otherwise."""
    cache = cache or LayoutCache()
    mesh_shape, coordinate = cache.mesh(dt.device_mesh)
    if coordinate is None:
        return None
    descs = cache.descs("", dt.placements)
    if any(d[0] not in ("shard", "replicate") for d in descs):
        return None
    dims = tuple(d[1] % dt.ndim if d[0] == "shard" else -1 for d in descs)
    return mesh_shape, dims, coordinate


def _check_against_torch(key: str, dt: Any, runs: Sequence[Sequence[pm.Run]], local: torch.Tensor) -> None:
    """Our exact per-rank pieces must agree with torch's own local shape and first offset."""
    ours = pm.local_shape(runs)
    ref_shape, ref_offsets = torch_compat.compute_local_shape_and_global_offset()(dt.shape, dt.device_mesh,
                                                                                 dt.placements)
    first = tuple(r[0][0] if r else o for r, o in zip(runs, ref_offsets))
    if ours != tuple(local.shape) or ours != tuple(ref_shape) or (
            all(ours) and tuple(first) != tuple(int(o) for o in ref_offsets)):
        raise CheckpointError(
            f"tensor {key!r}: DTensor placements {tuple(dt.placements)} on mesh {tuple(dt.device_mesh.shape)} give "
            f"local shape {list(ours)} starting at {list(first)} by bytecheckpoint's computation, but torch says "
            f"{list(ref_shape)} at {list(ref_offsets)} and the local tensor is {list(local.shape)}; this layout "
            f"is not supported: redistribute to Shard/Replicate placements before saving. Nothing was written")


def sharded_tensor_pieces(key: str, st: Any) -> Tuple[Tuple[int, ...], torch.dtype, str, Pieces]:
    shape, dtype, pieces = torch_compat.sharded_tensor_local_pieces(st)
    for offsets, t in pieces:
        if len(offsets) != len(shape) or any(o + n > s for o, n, s in zip(offsets, t.shape, shape)):
            raise CheckpointError(f"tensor {key!r}: ShardedTensor local shard at {list(offsets)} of shape "
                                  f"{list(t.shape)} does not fit in its global shape {list(shape)}")
        if t.dtype != dtype:
            raise CheckpointError(f"tensor {key!r}: ShardedTensor local shard has dtype {t.dtype} but the tensor "
                                  f"is {dtype}")
    return shape, dtype, "sharded", pieces
