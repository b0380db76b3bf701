"""Loads into GPU tensors through pinned host buffers, overlapped (issue 26).

A chunk whose destination is a CUDA tensor is never read into pageable memory and copied with a
blocking H2D copy. Instead, the byte ranges the load needs are planned into *segments*: one read
request each, at most one slab long (big chunks split at checksum-block boundaries, small
neighbours in one pack file merged, as packs.plan_runs does for host reads). Worker threads read
segments straight into slabs of a bounded, reused pinned pool, check every block they read
against its crc32, and queue non-blocking copies of each piece into its destination on a side
stream (one per device); a slab is reused only once the copies out of it have finished (an event
per slab). A chunk that lands in its destination as one contiguous byte range goes there
directly; any other chunk (a resharding boundary, a strided destination) lands in device scratch
and is scattered into its destinations on the GPU, where copies run at device speed. Finally the
caller's current stream waits on one event per side stream: `load` returns with no per-chunk
synchronization, and work the caller queues afterwards sees the loaded values.

The pipeline's logic (segments, slab bounds, checks, errors) is independent of CUDA: a `Mover`
does the copies, `CudaMover` on GPUs and `HostMover` (synchronous copies) for CPU tests.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..common import dtypes
from ..common.errors import CheckpointError
from ..format.metadata import ArrayMeta
from ..storage import chunks, packs
from .staging import Fence

SLAB_BYTES = 4 << 20          # one read request at most (a multiple of the 1 MiB checksum block)


# ---------------------------------------------------------------------- planning (pure)

@dataclass
class Landing:
    """Where one stored chunk's needed bytes [start, stop) go: `uploads` are (chunk byte lo, hi,
    device byte view of hi - lo); `scatter` (scratch, parts) copies parts of a device-side chunk
    into their destinations once every upload of it is queued."""
    ref: Tuple[str, Tuple[int, ...]]
    meta: ArrayMeta
    start: int
    stop: int
    uploads: List[Tuple[int, int, torch.Tensor]]
    scatter: Optional[Tuple[torch.Tensor, List[Tuple[Any, torch.Tensor]]]] = None
    pending: int = 0              # segments not yet uploaded (guarded by the pipeline's lock)


def split_range(offset: int, nbytes: int, max_bytes: int, align: int) -> List[Tuple[int, int]]:
    """[offset, offset + nbytes) cut into pieces of at most max_bytes, each starting `align`-aligned
    relative to `offset` (a checksum block boundary of its chunk), so each piece checks alone."""
    step = max(align, max_bytes // align * align) if align else nbytes
    if nbytes <= max_bytes or not align:
        return [(offset, nbytes)]
    return [(offset + p, min(step, nbytes - p)) for p in range(0, nbytes, step)]


def plan_segments(pieces: Sequence[Tuple[str, int, int, Any]], slab_bytes: int) -> List[packs.Run]:
    """(file key, file offset, nbytes, payload) of byte ranges to read -> read requests of at most
    slab_bytes (neighbours merged as packs.plan_runs does). Pieces must be <= slab_bytes."""
    if any(n > slab_bytes for _, _, n, _ in pieces):
        raise CheckpointError("internal: a piece larger than a pinned slab was not split")
    return packs.plan_runs(pieces, max_bytes=slab_bytes)


def can_stage(meta: ArrayMeta, slab_bytes: int) -> bool:
    """Chunks of block-checked arrays split into slabs at block boundaries; chunks of format-1
    arrays carry one crc32 for the whole chunk, so they go through a slab only when they fit."""
    if meta.block_bytes:
        return meta.block_bytes <= slab_bytes
    return chunks.chunk_bytes_len(meta) <= slab_bytes


def split_needs(arrays: Dict[str, ArrayMeta], needs, slab_bytes: int, staged: Callable[[torch.Tensor], bool]):
    """(needs read through pinned slabs, needs read on the host path): a chunk goes through the
    slabs when a destination of it is on a device (`staged`) and it can (can_stage)."""
    through, host = {}, {}
    for ref, parts in needs.items():
        wanted = any(staged(d) for _, d in parts) and can_stage(arrays[ref[0]], slab_bytes)
        (through if wanted else host)[ref] = parts
    return through, host


def landing_of(ref, meta: ArrayMeta, parts, scratch: Callable[[int, torch.device], torch.Tensor]) -> Landing:
    """The landing of one chunk for its parts: straight into a contiguous destination when the
    needed bytes are one contiguous range of it, else into device scratch + a scatter."""
    index = ref[1]
    total = chunks.chunk_bytes_len(meta)
    if chunks.lands_whole(meta, parts, any_device=True):
        return Landing(ref, meta, 0, total, [(0, total, chunks.as_uint8_view(parts[0][1]))])
    spans = [chunks.part_span(meta, index, part) for part, _ in parts]
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    start, stop = chunks.block_range(meta, lo, hi)
    dest = parts[0][1]
    if len(parts) == 1 and spans[0][2] and dest.is_contiguous():
        return Landing(ref, meta, start, stop, [(lo, hi, chunks.as_uint8_view(dest))])
    device = next((d.device for _, d in parts if d.is_cuda), dest.device)
    buf = scratch(total, device)
    return Landing(ref, meta, start, stop, [(start, stop, buf[start:stop])], scatter=(buf, list(parts)))


# ---------------------------------------------------------------------- the pinned pool

class PinnedSlabs:
    """A bounded set of page-locked slabs, kept and reused by every load of the Checkpointer that
    owns it. Each slab is allocated when it is first handed out (on the worker that asks), so the
    first reads start after one slab is pinned, not after all of them: pinning costs time in
    proportion to its size (measured: a 256 MiB budget made a 2 GiB load ~0.1 s slower than
    64 MiB). A slab is handed out again only after the copies out of it have finished (the event
    its last user recorded)."""

    def __init__(self, slab_bytes: int, count: int, pin: bool = True):
        self.slab_bytes, self.count, self.pin = slab_bytes, max(2, count), pin
        self._slabs: List[Optional[torch.Tensor]] = [None] * self.count
        self._free: List[Tuple[int, Any]] = [(i, None) for i in range(self.count)]
        # the side stream per device of the loads through these slabs (kept: device scratch freed
        # on a stream is reused by later allocations on that stream only)
        self.streams: Dict[torch.device, Any] = {}
        self._cond = threading.Condition()
        self.in_use = 0
        self.peak_in_use = 0

    @classmethod
    def for_budget(cls, budget: int) -> "PinnedSlabs":
        """Slabs of SLAB_BYTES (smaller for a small budget, never under one checksum block), as
        many as fit; pinned where CUDA is present."""
        slab = min(SLAB_BYTES, max(chunks.BLOCK_BYTES, budget // 2))
        return cls(slab, budget // slab, pin=torch.cuda.is_available())

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._slabs if s is not None)

    def acquire(self) -> Tuple[int, torch.Tensor]:
        with self._cond:
            while not self._free:
                self._cond.wait()
            i, event = self._free.pop(0)
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            slab = self._slabs[i]
        if slab is None:  # first use: pinned here, outside the lock (others allocate or read meanwhile)
            slab = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin)
            self._slabs[i] = slab
        if event is not None:
            event.wait()  # the last copies out of this slab have finished
        return i, slab

    def release(self, i: int, event: Any = None) -> None:
        with self._cond:
            self._free.append((i, event))
            self.in_use -= 1
            self._cond.notify()

    def drain(self) -> None:
        """Wait for every slab's copies (before freeing the slabs)."""
        with self._cond:
            pending = [e for _, e in self._free if e is not None]
        for e in pending:
            e.wait()

    def free(self) -> None:
        self.drain()
        with self._cond:
            self._slabs = [None] * self.count
            self._free = [(i, None) for i in range(self.count)]
            self.streams.clear()


# ---------------------------------------------------------------------- copies

class HostMover:
    """Synchronous copies (CPU destinations in tests, or no CUDA): same pipeline, no streams."""

    def begin(self, devices) -> None:
        pass

    def scratch(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def scatter(self, scratch: torch.Tensor, fn: Callable[[], None]) -> None:
        fn()

    def record(self, devices) -> Any:
        return None

    def finish(self) -> None:
        pass


class CudaMover:
    """Non-blocking copies on one side stream per device, ordered after the caller's stream (the
    destinations may have been written there) and before it again at finish()."""

    def __init__(self, streams: Dict[torch.device, Any]) -> None:
        self._streams = streams

    def begin(self, devices) -> None:
        for d in devices:
            if d.type == "cuda":
                if d not in self._streams:
                    self._streams[d] = torch.cuda.Stream(device=d)
                self._streams[d].wait_stream(torch.cuda.current_stream(d))

    def scratch(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with torch.cuda.stream(self._streams[device]):  # owned by the side stream: freed in its order
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.is_cuda:
            with torch.cuda.stream(self._streams[dst.device]):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def scatter(self, scratch: torch.Tensor, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(self._streams[scratch.device]):
            fn()

    def record(self, devices) -> Any:
        """One event covering the copies queued so far out of a slab (on every stream it fed)."""
        events = []
        for d in devices:
            if d.type == "cuda":
                ev = torch.cuda.Event()
                ev.record(self._streams[d])
                events.append(ev)
        return Fence(events) if events else None

    def finish(self) -> None:
        for d, stream in self._streams.items():
            ev = torch.cuda.Event()
            ev.record(stream)
            torch.cuda.current_stream(d).wait_event(ev)


# ---------------------------------------------------------------------- the pipeline

def staged_destination(t: torch.Tensor) -> bool:
    """Destinations that the load reaches through pinned slabs: tensors on a device."""
    return t.device.type != "cpu"


def mover_for(needs, slabs: PinnedSlabs) -> Any:
    cuda = any(d.is_cuda for parts in needs.values() for _, d in parts)
    return CudaMover(slabs.streams) if cuda else HostMover()


def read_staged(store, workers, arrays: Dict[str, ArrayMeta], needs, slabs: PinnedSlabs, mover, what: str,
                stats) -> None:
    """Read every chunk of `needs` ({(array, index): [(part, destination view)]}) through `slabs`
    into its destinations (see the module docstring). `stats` gets bytes_read / reads added."""
    landings = []
    devices = {d.device for parts in needs.values() for _, d in parts}
    mover.begin(devices)
    for ref, parts in needs.items():
        landings.append(landing_of(ref, arrays[ref[0]], parts, mover.scratch))
    pieces = []
    for land in landings:
        key, base = chunks.chunk_location(land.meta, land.ref[1])
        for off, n in split_range(land.start, land.stop - land.start, slabs.slab_bytes, land.meta.block_bytes):
            pieces.append((key, (base or 0) + off, n, (land, off, n)))
            land.pending += 1
    segments = plan_segments(pieces, slabs.slab_bytes)
    lock = threading.Lock()
    failed: List[BaseException] = []

    def run(seg: packs.Run) -> int:
        """Bytes read; a failure is kept in `failed` (every segment is waited for, then it is raised)."""
        if failed:  # another segment failed: read no more, the load raises that error
            return 0
        i, slab = slabs.acquire()
        event = None
        try:
            size = seg.stop - seg.start
            chunks.wait_for(store.read_range_into(seg.key, seg.start, [chunks.uint8_view(slab[:size])]), seg.key, what)
            for offset, (land, off, n) in seg.members:
                got = slab[offset - seg.start:offset - seg.start + n]
                _check(got, land, off, what)
                for lo, hi, dev in land.uploads:
                    a, b = max(lo, off), min(hi, off + n)
                    if a < b:
                        mover.upload(dev[a - lo:b - lo], got[a - off:b - off])
            done = []
            with lock:
                for _, (land, _, _) in seg.members:
                    land.pending -= 1
                    if land.pending == 0 and land.scatter is not None:
                        done.append(land)
            for land in done:
                _scatter(land, mover)
            event = mover.record(devices)
            return size
        except BaseException as exc:  # noqa: BLE001 - every segment is accounted for, then raised
            failed.append(exc)
            return 0
        finally:
            slabs.release(i, event)

    try:
        for nbytes in workers.map(run, segments):  # waits for every segment, failed or not
            if nbytes:
                stats.bytes_read += nbytes
                stats.reads += 1
    finally:
        mover.finish()
    if failed:
        raise failed[0]


def _check(got: torch.Tensor, land: Landing, off: int, what: str) -> None:
    meta, index = land.meta, land.ref[1]
    view = chunks.uint8_view(got)
    if not meta.block_bytes:  # format 1: one crc32 of the whole chunk (it fits one slab: can_stage)
        chunks.check(view, meta, index, f"{what} {land.ref[0]!r}")
    else:
        chunks.check_range([view], off, meta, index, f"{what} {land.ref[0]!r}")


def _scatter(land: Landing, mover) -> None:
    buf, parts = land.scatter
    dtype = dtypes.to_torch(land.meta.dtype)
    mover.scatter(buf, lambda: chunks.copy_parts(chunks.chunk_tensor(buf, land.meta, dtype), land.ref[1], land.meta,
                                                 parts))
