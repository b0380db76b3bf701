"""Zero-redundancy load: chunks that several ranks need are read from storage once and shared.

Whether it runs is the Checkpointer's policy (`zero_redundancy="auto"`: remote or shared storage,
ranks on several hosts, or NCCL; off for ranks that share a host reading local files, where
re-reading the page cache beats a broadcast over gloo).

Every rank announces the stored chunks it needs; `planner.assign_readers` picks one balanced
reader for each chunk wanted by 2+ ranks; each reader reads (and checksums) its chunks into one
flat buffer, and the buffers are broadcast. Chunks only one rank needs are read by that rank.
The three steps are separate so the caller agrees on failures between them: no rank ever sits
in a broadcast while another has failed.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .comm import Comm
from .metadata import Metadata, dtype_itemsize
from .planner import assign_readers
from .storage import chunks

ChunkRef = Tuple[str, Tuple[int, ...]]


@dataclass
class SharedPlan:
    by_reader: Dict[int, List[ChunkRef]] = field(default_factory=dict)
    sizes: Dict[ChunkRef, int] = field(default_factory=dict)
    buffers: Dict[int, torch.Tensor] = field(default_factory=dict)

    def shared(self) -> set:
        return {q for qs in self.by_reader.values() for q in qs}

    def local_needs(self, needs: Dict[ChunkRef, Any]) -> Dict[ChunkRef, Any]:
        shared = self.shared()
        return {q: parts for q, parts in needs.items() if q not in shared}


def whole_chunks(md: Metadata, needs: Dict[ChunkRef, Any]) -> List[ChunkRef]:
    """The chunks this rank needs entirely. Only those are shared: a chunk that several ranks need
    *parts* of (a resharding boundary) is cheaper to read twice than to broadcast to everyone."""
    out = []
    for (array, index), parts in needs.items():
        meta = md.arrays[array]
        full = 1
        for c in meta.chunks:
            full *= c
        got = 0
        for part, _ in parts:
            n = 1
            for x in part[1]:
                n *= x
            got += n
        if got >= full:
            out.append((array, index))
    return out


def no_sharing(comm: Comm, md: Metadata, needs: Dict[ChunkRef, Any]) -> SharedPlan:
    """Every rank reads every chunk it needs itself."""
    return SharedPlan()


def plan_shared(comm: Comm, md: Metadata, needs: Dict[ChunkRef, Any]) -> SharedPlan:
    """Collective: agree on who reads each chunk that 2+ ranks need whole (see whole_chunks)."""
    plan = SharedPlan()
    if not comm.enabled or comm.world_size == 1:
        return plan
    requests = comm.all_gather(whole_chunks(md, needs))
    plan.sizes = {q: chunks.chunk_nbytes(md.arrays[q[0]], dtype_itemsize(md.arrays[q[0]].dtype))
                  for qs in requests for q in qs}
    by_reader: Dict[int, List[ChunkRef]] = defaultdict(list)
    for q, (reader, _) in sorted(assign_readers(requests, plan.sizes).items(), key=lambda kv: (kv[1][0], kv[0])):
        by_reader[reader].append(q)
    plan.by_reader = dict(by_reader)
    return plan


def _layout(plan: SharedPlan, reader: int) -> Tuple[List[Tuple[ChunkRef, int]], int]:
    """Where each chunk sits in the reader's buffer (16-byte aligned so any dtype can view it)."""
    out, off = [], 0
    for q in plan.by_reader[reader]:
        out.append((q, off))
        off += -(-plan.sizes[q] // 16) * 16
    return out, off


def read_assigned(comm: Comm, store, md: Metadata, plan: SharedPlan, stats) -> None:
    """Local: read and checksum the chunks this rank was chosen for, into its outgoing buffer."""
    if comm.rank not in plan.by_reader:
        return
    layout, total = _layout(plan, comm.rank)
    buf = torch.empty(total, dtype=torch.uint8)
    futures = chunks.start_chunk_reads(store, [(md.arrays[a], i) for (a, i), _ in layout])
    for ((array, index), off), fut in zip(layout, futures):
        raw = chunks.chunk_bytes(fut, md.arrays[array], index, f"loading {array!r}")
        buf[off:off + len(raw)].copy_(chunks.as_uint8(raw))
        stats.bytes_read += len(raw)
        stats.reads += 1
    plan.buffers[comm.rank] = buf


def exchange(comm: Comm, md: Metadata, plan: SharedPlan, needs: Dict[ChunkRef, Any], stats) -> None:
    """Collective: broadcast each reader's buffer; every rank copies out the parts it needs."""
    from .loader import torch_dtype
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
        for (array, index), off in layout:
            parts = needs.get((array, index))
            if not parts:
                continue
            if reader != comm.rank:
                stats.bytes_received += plan.sizes[(array, index)]
            meta = md.arrays[array]
            chunk = chunks.chunk_tensor(buf[off:off + plan.sizes[(array, index)]], meta, torch_dtype(meta.dtype))
            chunks.copy_parts(chunk, index, meta, parts)
        del buf, wire
