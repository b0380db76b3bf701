"""Zero-redundancy load: bytes that several ranks need are read from storage once and shared.

Every rank announces the (array, box) pieces it needs; `planner.assign_readers` picks one
balanced reader for each piece wanted by 2+ ranks; each reader reads its pieces into one flat
buffer per reader, and the buffers are broadcast. Pieces only one rank needs are read by that
rank alone. The three steps are separate so that the caller can agree on failures between them
(no rank ever sits in a broadcast while another has failed).
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from .comm import Comm
from .metadata import Metadata, dtype_itemsize
from .planner import ReadItem, assign_readers
from .regions import volume

ENABLED = os.environ.get("BCP_ZERO_REDUNDANCY_LOAD", "1") != "0"

Request = Tuple[str, tuple]  # (array path, box inside the array)


@dataclass
class SharedPlan:
    mine: Dict[Request, List[ReadItem]] = field(default_factory=dict)
    by_reader: Dict[int, List[Request]] = field(default_factory=dict)
    sizes: Dict[Request, int] = field(default_factory=dict)
    buffers: Dict[int, torch.Tensor] = field(default_factory=dict)

    def local_reads(self, reads: Sequence[ReadItem]) -> List[ReadItem]:
        shared = {q for qs in self.by_reader.values() for q in qs}
        return [r for r in reads if (r.array, r.array_box) not in shared]


def plan_shared(comm: Comm, md: Metadata, reads: Sequence[ReadItem]) -> SharedPlan:
    """Collective: agree on who reads each piece that 2+ ranks need."""
    plan = SharedPlan()
    if not ENABLED or not comm.enabled or comm.world_size == 1:
        return plan
    mine: Dict[Request, List[ReadItem]] = defaultdict(list)
    for r in reads:
        mine[(r.array, r.array_box)].append(r)
    plan.mine = dict(mine)
    requests = comm.all_gather(list(mine))
    plan.sizes = {q: volume(q[1][1]) * dtype_itemsize(md.arrays[q[0]].dtype) for qs in requests for q in qs}
    by_reader: Dict[int, List[Request]] = defaultdict(list)
    for q, (reader, _) in sorted(assign_readers(requests, plan.sizes).items(), key=lambda kv: (kv[1][0], kv[0])):
        by_reader[reader].append(q)
    plan.by_reader = dict(by_reader)
    return plan


def _layout(plan: SharedPlan, reader: int) -> Tuple[List[Tuple[Request, int]], int]:
    """Where each piece sits in the reader's buffer (16-byte aligned so any dtype can view it)."""
    out, off = [], 0
    for q in plan.by_reader[reader]:
        out.append((q, off))
        off += -(-plan.sizes[q] // 16) * 16
    return out, off


def _view(buf: torch.Tensor, off: int, q: Request, size: int, dtype: torch.dtype) -> torch.Tensor:
    return buf[off:off + size].view(dtype).view(q[1][1])


def read_assigned(comm: Comm, store, md: Metadata, plan: SharedPlan, stats,
                  execute_reads: Callable, torch_dtype: Callable) -> None:
    """Local: read the pieces this rank was chosen for into its outgoing buffer."""
    reqs = plan.by_reader.get(comm.rank, [])
    if not reqs:
        return
    layout, total = _layout(plan, comm.rank)
    buf = torch.empty(total, dtype=torch.uint8)
    items, views = [], []
    for q, off in layout:
        items.append(ReadItem("<shared>", 0, q[0], q[1], ((0,) * len(q[1][1]), q[1][1]), q[1], q[1]))
        views.append(_view(buf, off, q, plan.sizes[q], torch_dtype(md.arrays[q[0]].dtype)))
    execute_reads(store, md, items, views, stats)
    plan.buffers[comm.rank] = buf


def exchange(comm: Comm, md: Metadata, plan: SharedPlan, dest_of: Callable[[ReadItem], torch.Tensor], stats,
             torch_dtype: Callable) -> None:
    """Collective: broadcast each reader's buffer; every rank copies out what it needs."""
    device = comm.tensor_device()
    for reader in sorted(plan.by_reader):
        layout, total = _layout(plan, reader)
        buf = plan.buffers.pop(reader, None)
        if buf is None:
            buf = torch.empty(total, dtype=torch.uint8)
        wire = buf if device.type == "cpu" else buf.to(device)
        comm.broadcast_tensor(wire, src=reader)
        if wire is not buf:
            buf = wire.cpu()
        for q, off in layout:
            targets = plan.mine.get(q, ())
            if targets and reader != comm.rank:
                stats.bytes_received += plan.sizes[q]
            for r in targets:
                dest_of(r).copy_(_view(buf, off, q, plan.sizes[q], torch_dtype(md.arrays[q[0]].dtype)))
        del buf, wire
