"""torchtitan's data stream across data-parallel degrees.

torchtitan's datasets are iterable: DP rank j of W reads its own shard of the documents
(`split_dataset_by_node(ds, j, W)`) and packs tokens into samples; its position is the loader's
`state_dict()` (`{"dp_rank_j": <bytes>, "world_size": W}`), which torchtitan refuses to load at
another W ("dp_degree is inconsistent", components/dataloader.py).

Here every DP rank's position is one row of a byte matrix `[W, L]` (`dataloader/positions`, with
`dataloader/lengths [W]`), each row a `bcp.Shard` held by the ranks of that DP rank, so the engine
reshards it like any tensor: a resume reads exactly the rows it asks for. When the DP degree
shrinks by a whole factor k (W -> W/k), new DP rank r stands for old ranks r*k .. r*k+k-1: it
builds their k loaders (the trainer's own dataloader config at the old degree), restores each,
and per training step takes each old rank's samples of that step in rank order, so every later
global step trains on the tokens the uninterrupted run trains on. Otherwise (growth, a non-whole
factor, another global batch) the resume says so in one line and the loader starts fresh, as
torchtitan's own loader would for a rank it has no state for.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import bytecheckpoint as bcp

from . import _compat

log = logging.getLogger("torchtitan_bytecheckpoint")
POSITIONS, LENGTHS, LAYOUT = "positions", "lengths", "layout"


def dp_states(dataloader: Any) -> Optional[Tuple[int, Dict[int, bytes]]]:
    """(W, {dp rank: its saved position bytes}) of a torchtitan ParallelAwareDataloader (or a
    resumed one); None for a loader whose state_dict() has another form (saved as it is, per rank)."""
    if not all(hasattr(dataloader, n) for n in ("dp_rank", "dp_world_size", "state_dict")):
        return None
    sd = dataloader.state_dict()
    if not isinstance(sd, dict) or not isinstance(sd.get("world_size"), int):
        return None
    ranks = {int(k[len("dp_rank_"):]): v for k, v in sd.items() if str(k).startswith("dp_rank_")}
    first = min(ranks, default=0)
    if (not ranks or sorted(ranks) != list(range(first, first + len(ranks)))
            or not all(isinstance(v, bytes) for v in ranks.values())):
        return None
    return sd["world_size"], ranks


def save_state(positions: Tuple[int, Dict[int, bytes]], layout: Dict[str, int]) -> Dict[str, Any]:
    """The `dataloader` entry of a save: this rank's DP rows as shards of the [W, L] byte matrix
    (`positions`: dp_states() of the loader)."""
    world, ranks = positions
    first, count = min(ranks), len(ranks)
    longest = torch.tensor([max(len(v) for v in ranks.values())], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    width = int(longest.item())
    rows = torch.zeros((count, width), dtype=torch.uint8)
    lengths = torch.zeros((count,), dtype=torch.int64)
    for i in range(count):
        raw = ranks[first + i]
        rows[i, :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        lengths[i] = len(raw)
    return {POSITIONS: bcp.Shard(rows, (world, width), (first, 0)),
            LENGTHS: bcp.Shard(lengths, (world,), (first,)),
            LAYOUT: dict(layout, dp_world_size=world)}


class Plan:
    """What a resume at this DP rank reads of the saved positions, and how it uses them."""

    def __init__(self, saved_world: int, width: int, dp_rank: int, dp_world: int) -> None:
        self.saved_world, self.width = saved_world, width
        self.dp_rank, self.dp_world = dp_rank, dp_world
        if saved_world == dp_world:
            self.first, self.count, self.why = dp_rank, 1, ""
        elif saved_world % dp_world == 0:
            k = saved_world // dp_world
            self.first, self.count, self.why = dp_rank * k, k, ""
        else:
            self.first, self.count = min(dp_rank, saved_world - 1), 1
            self.why = (f"saved at data-parallel degree {saved_world}, resumed at {dp_world}: not a whole "
                        f"shrink factor, so the data stream cannot continue exactly")
        self.rows = torch.zeros((self.count, width), dtype=torch.uint8)
        self.lengths = torch.zeros((self.count,), dtype=torch.int64)
        self._template = {POSITIONS: bcp.Shard(self.rows, (self.saved_world, self.width), (self.first, 0)),
                          LENGTHS: bcp.Shard(self.lengths, (self.saved_world,), (self.first,)), LAYOUT: {}}

    def template(self) -> Dict[str, Any]:
        """The `dataloader` entry of the load's state (the rows this rank reads, the saved layout)."""
        return self._template

    @property
    def layout(self) -> Dict[str, Any]:
        """The saved layout (plain values are assigned into the template by the load)."""
        return self._template[LAYOUT]

    def positions(self) -> Dict[int, bytes]:
        return {self.first + i: bytes(self.rows[i, :int(self.lengths[i])].numpy().tobytes())
                for i in range(self.count)}


def plan_for(info: "bcp.CheckpointInfo", prefix: str, dp_rank: int, dp_world: int) -> Optional[Plan]:
    """The resume plan from a checkpoint's metadata (bcp.inspect), None if it holds no positions."""
    shapes = {t.name: tuple(t.shape) for t in info.tensors}
    shape = shapes.get(f"{prefix}/{POSITIONS}")
    if shape is None or len(shape) != 2:
        return None
    return Plan(shape[0], shape[1], dp_rank, dp_world)


def restore(plan: Plan, dataloader: Any, trainer: Any, layout_now: Dict[str, int]) -> Tuple[Any, str]:
    """Restore the positions into `dataloader` (same degree) or into a loader standing for the old
    DP ranks (whole shrink). Returns (the loader to train from, the one-line report)."""
    saved = plan.positions()
    layout = plan.layout
    if plan.why:
        return dataloader, plan.why + "; the dataloader starts from the beginning of its shard"
    if plan.count == 1:
        dataloader.load_state_dict({f"dp_rank_{plan.dp_rank}": saved[plan.first], "world_size": plan.saved_world})
        return dataloader, f"data order exact: data-parallel degree {plan.saved_world} as saved"
    per_step_old = int(layout.get("batch", 0)) * int(layout.get("batches_per_step", 0))
    per_step_new = layout_now["batch"] * layout_now["batches_per_step"]
    if per_step_old * plan.count != per_step_new:
        return dataloader, (f"saved at data-parallel degree {plan.saved_world} with {per_step_old} samples per rank "
                            f"and step, resumed at {plan.dp_world} with {per_step_new}: the global batch changed, so "
                            f"the data stream cannot continue exactly; the dataloader starts from the beginning")
    subs = []
    for j, raw in sorted(saved.items()):
        sub = _compat.build_dataloader(trainer, dp_world_size=plan.saved_world, dp_rank=j,
                                       local_batch_size=int(layout["batch"]))
        sub.load_state_dict({f"dp_rank_{j}": raw, "world_size": plan.saved_world})
        subs.append(sub)
    loader = ResumedDataLoader(subs, int(layout["batches_per_step"]), layout_now["batch"], plan.saved_world,
                               plan.dp_rank, plan.dp_world)
    return loader, (f"data order exact: data-parallel degree {plan.saved_world} -> {plan.dp_world}, this rank "
                    f"continues the streams of saved dp ranks {sorted(saved)}")


class ResumedDataLoader(_compat.BaseDataLoader):
    """The loader of one DP rank that stands for several saved DP ranks: per training step, each
    saved rank's `batches_per_step` batches in rank order, re-cut into batches of `batch`."""

    def __init__(self, subs: Sequence[Any], batches_per_step: int, batch: int, saved_world: int,
                 dp_rank: int, dp_world_size: int) -> None:
        self.subs, self.batches_per_step = list(subs), batches_per_step
        self.batch, self.saved_world = batch, saved_world
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size  # the DP rank it serves now

    def __iter__(self) -> Iterator[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
        iters = [iter(s) for s in self.subs]
        while True:
            taken: List[Tuple[Dict[str, torch.Tensor], torch.Tensor]] = []
            try:
                for it in iters:
                    for _ in range(self.batches_per_step):
                        taken.append(next(it))
            except StopIteration:
                return
            inputs = {k: torch.cat([t[0][k] for t in taken]) for k in taken[0][0]}
            labels = torch.cat([t[1] for t in taken])
            for start in range(0, labels.shape[0], self.batch):
                yield {k: v[start:start + self.batch] for k, v in inputs.items()}, labels[start:start + self.batch]

    def state_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"world_size": self.saved_world}
        for sub in self.subs:
            out.update({k: v for k, v in sub.state_dict().items() if k.startswith("dp_rank_")})
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        for sub in self.subs:
            sub.load_state_dict(state_dict)
