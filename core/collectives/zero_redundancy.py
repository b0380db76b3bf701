"""Zero-redundancy load: chunks that several ranks need are read from storage once and shared.

Whether it runs is the Checkpointer's policy (`zero_redundancy="auto"`: remote or shared storage,
ranks on several hosts, or NCCL; off for ranks that share a host reading local files, where
re-reading the page cache beats a broadcast over gloo).

Every rank announces the stored chunks it needs; `planner.assign_readers` picks one balanced
reader for each chunk wanted by 2+ ranks; each reader reads (and checksums) its chunks and they
are broadcast one by one, pipelined: the readers' storage reads all start at once and overlap
the broadcasts, which go out in turn from each reader (`schedule`), a few in flight. A chunk
lands straight in its target when it fills one contiguous tensor (no staging copy on either
side). Chunks only one rank needs are read by that rank.
"""
from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..common import dtypes
from .comm import Comm
from ..format.metadata import Metadata, dtype_itemsize
from ..planning.planner import assign_readers
from ..storage import chunks

ChunkRef = Tuple[str, Tuple[int, ...]]


@dataclass
class SharedPlan:
    by_reader: Dict[int, List[ChunkRef]] = field(default_factory=dict)
    sizes: Dict[ChunkRef, int] = field(default_factory=dict)

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
        full = math.prod(chunks.chunk_extent(md.arrays[array], index))
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


# zero_redundancy="auto" shares chunks of at least this many bytes: each broadcast costs ~0.6 ms on
# gloo (measured: 219 AdamW step scalars took 130 ms of a 0.9 s FSDP2 resume from the object store,
# bench_s3), what ~600 KiB of ranged reads cost there; a smaller chunk is cheaper to read twice.
SHARE_MIN_BYTES = 256 << 10


def _nbytes(md: Metadata, q: ChunkRef) -> int:
    return chunks.chunk_nbytes(md.arrays[q[0]], dtype_itemsize(md.arrays[q[0]].dtype))


def plan_shared(comm: Comm, md: Metadata, needs: Dict[ChunkRef, Any], min_bytes: int = 0) -> SharedPlan:
    """Collective: agree on who reads each chunk that 2+ ranks need whole (see whole_chunks) and
    that holds at least `min_bytes` (smaller ones: every rank reads its own)."""
    plan = SharedPlan()
    if not comm.enabled or comm.world_size == 1:
        return plan
    requests = comm.all_gather([q for q in whole_chunks(md, needs) if not min_bytes or _nbytes(md, q) >= min_bytes])
    plan.sizes = {q: _nbytes(md, q) for qs in requests for q in qs}
    by_reader: Dict[int, List[ChunkRef]] = defaultdict(list)
    for q, (reader, _) in sorted(assign_readers(requests, plan.sizes).items(), key=lambda kv: (kv[1][0], kv[0])):
        by_reader[reader].append(q)
    plan.by_reader = dict(by_reader)
    return plan


def schedule(plan: SharedPlan) -> List[Tuple[int, ChunkRef]]:
    """The order every rank walks the shared chunks in: readers taken in turn, so each reader's
    storage reads overlap the broadcasts of the others' chunks."""
    lists = [[(r, q) for q in plan.by_reader[r]] for r in sorted(plan.by_reader)]
    return [item for group in itertools.zip_longest(*lists) for item in group if item is not None]


class _Incoming:
    """A chunk this rank receives: straight into its target when it lands there whole."""

    def __init__(self, meta, parts, size: int):
        self.meta, self.parts = meta, parts
        self.direct = parts is not None and chunks.lands_whole(meta, parts)
        if self.direct:
            self.buf = chunks.as_uint8_view(parts[0][1])
        else:
            self.buf = torch.empty(size, dtype=torch.uint8)

    def land(self, index, dtype) -> None:
        if not self.direct and self.parts:
            chunks.copy_parts(chunks.chunk_tensor(self.buf, self.meta, dtype), index, self.meta, self.parts)


def exchange(comm: Comm, store, workers, md: Metadata, plan: SharedPlan, needs: Dict[ChunkRef, Any], stats,
             window: int = 4) -> None:
    """Collective: each shared chunk is read whole (and checked) by its reader, which may or may
    not need it itself, and broadcast to every rank, chunk by chunk, up to `window` broadcasts in flight. The reader's reads all start at
    once and run on the worker pool while broadcasts go out. A rank whose read fails still takes
    part in every broadcast (sending filler), then every rank raises the error (comm.agree)."""
    order = schedule(plan)
    if not order:
        return
    device = comm.tensor_device()
    mine = [q for r, q in order if r == comm.rank]
    reads = [chunks.ChunkRead(store, md.arrays[q[0]], q[1], needs.get(q, []), keep=True) for q in mine]
    finished = workers.map(lambda q, rd: rd.finish(f"loading {q[0]!r}", dtypes.to_torch(md.arrays[q[0]].dtype)),
                           list(zip(mine, reads)))
    error: Optional[BaseException] = None
    inflight: List[Tuple[Any, Any, ChunkRef, Optional[_Incoming], torch.Tensor, torch.Tensor]] = []

    def complete(entry) -> None:
        work, _, q, incoming, wire, buf = entry
        if work is not None:
            work.wait()
        if incoming is not None:
            if wire is not buf:
                buf.copy_(wire)
            if error is None:
                incoming.land(q[1], dtypes.to_torch(md.arrays[q[0]].dtype))
            stats.bytes_received += plan.sizes[q]

    own = iter(reads)
    for reader, q in order:
        meta = md.arrays[q[0]]
        incoming = None
        if reader == comm.rank:
            read = next(own)
            try:
                nbytes = next(finished)
                buf = read.raw
                stats.bytes_read += nbytes
                stats.reads += 1
            except Exception as exc:  # noqa: BLE001 - keep the broadcasts matched, raise after
                error = error or exc
                buf = torch.empty(plan.sizes[q], dtype=torch.uint8)
        else:
            incoming = _Incoming(meta, needs.get(q), plan.sizes[q])
            buf = incoming.buf
        wire = buf if device.type == "cpu" else buf.to(device)
        inflight.append((comm.broadcast_tensor_async(wire, reader), reader, q, incoming, wire, buf))
        while len(inflight) >= window:
            complete(inflight.pop(0))
    for entry in inflight:
        complete(entry)
    comm.agree(error, "zero-redundancy load (shared chunks)")
