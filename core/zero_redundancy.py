"""Zero-redundancy load: bytes that several ranks need are read from storage once and shared.

Every rank announces the (array, box) pieces it needs; `planner.assign_readers` picks one
balanced reader for each piece wanted by 2+ ranks; each reader reads its pieces into one flat
buffer which is broadcast to the group. Pieces only one rank needs are read by that rank.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from .comm import Comm
from .metadata import Metadata, dtype_itemsize
from .planner import ReadItem, assign_readers
from .regions import volume

ENABLED = os.environ.get("BCP_ZERO_REDUNDANCY_LOAD", "1") != "0"


def shared_reads(comm: Comm, store, md: Metadata, reads: Sequence[ReadItem],
                 dest_of: Callable[[ReadItem], torch.Tensor], stats) -> List[ReadItem]:
    """Serve the shared pieces collectively; return the reads this rank still does alone."""
    from .load import execute_reads  # avoid an import cycle

    if not ENABLED or not comm.enabled or comm.world_size == 1:
        return list(reads)
    mine: Dict[Tuple[str, tuple], List[ReadItem]] = defaultdict(list)
    for r in reads:
        mine[(r.array, r.array_box)].append(r)
    requests = comm.all_gather(list(mine))
    sizes = {req: volume(req[1][1]) * dtype_itemsize(md.arrays[req[0]].dtype) for reqs in requests for req in reqs}
    shared = assign_readers(requests, sizes)
    if not shared:
        return list(reads)

    by_reader: Dict[int, List[Tuple[str, tuple]]] = defaultdict(list)
    for req, (reader, _) in sorted(shared.items(), key=lambda kv: (kv[1][0], kv[0])):
        by_reader[reader].append(req)
    device = comm.tensor_device()
    for reader in sorted(by_reader):
        reqs = by_reader[reader]
        offsets, total = [], 0
        for req in reqs:
            offsets.append(total)
            total += sizes[req]
        buf = torch.empty(total, dtype=torch.uint8)
        if reader == comm.rank:
            views, items = [], []
            for req, off in zip(reqs, offsets):
                dtype = _dtype(md.arrays[req[0]].dtype)
                views.append(buf[off:off + sizes[req]].view(dtype).view(req[1][1]))
                items.append(ReadItem("<shared>", 0, req[0], req[1], ((0,) * len(req[1][1]), req[1][1]), req[1], req[1]))
            execute_reads(store, md, items, views, stats)
        wire = buf if device.type == "cpu" else buf.to(device)
        comm.broadcast_tensor(wire, src=reader)
        if wire is not buf:
            buf = wire.cpu()
        if reader != comm.rank:
            stats.bytes_received += sum(sizes[q] for q in reqs if q in mine)
        for req, off in zip(reqs, offsets):
            for r in mine.get(req, ()):
                dtype = _dtype(md.arrays[req[0]].dtype)
                dest_of(r).copy_(buf[off:off + sizes[req]].view(dtype).view(req[1][1]))
        del buf, wire
    return [r for r in reads if (r.array, r.array_box) not in shared]


def _dtype(name: str) -> torch.dtype:
    from .load import torch_dtype
    return torch_dtype(name)
