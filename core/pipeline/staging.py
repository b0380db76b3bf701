"""Reusable staging buffers for async save (ping-pong pool).

Save N copies the bytes it will write into slot N % slots and returns; the background writer
releases the slot when its writes are done. Buffers are kept per (key, box) and reused by the
next save with the same layout, so steady-state saves allocate nothing. Buffers a save needs at
once are carved out of one allocation (one page-locked arena with CUDA sources: one
cudaHostAlloc instead of one per tensor, and no pre-faulting pass, since pinned pages are
resident). Device-to-host copies are queued non-blocking on each source's current stream (after
the work that produced the sources, as the caller sees them), and one `Fence` per save waits for
them all: the caller's thread does its remaining work while the copy engines run.

Buffers of BIG_ALIGN bytes or more start at 4 KiB-aligned addresses (the arena's base is aligned),
so pack files can be written from them with O_DIRECT without a bounce copy (storage/posix.py).
Async staging's background copies (copy_cpu) are single-threaded memmoves that release the GIL: no
OpenMP team of their own beside the training threads.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

BufferKey = Tuple[str, Tuple[int, ...], Tuple[int, ...], torch.dtype]
_ALIGN = 64
PAGE = 4096                 # O_DIRECT's alignment (covers 512-byte and 4 KiB logical blocks)
BIG_ALIGN = 64 << 10        # buffers this big start on a page
_PREFAULT_PIECE = 64 << 20  # memset per piece (the GIL is released between pieces)


class Slot:
    def __init__(self, index: int):
        self.index = index
        self.buffers: Dict[BufferKey, torch.Tensor] = {}
        self.busy = False


class Fence:
    """The staging copies of one save: wait() returns when they have landed (no-op without CUDA)."""

    def __init__(self, events: Sequence = ()):
        self._events = list(events)

    def wait(self) -> None:
        for e in self._events:
            e.synchronize()
        self._events = []


class Staging:
    """One save's copy-out into one slot. `copy` may be called while the state is still being
    walked (the plan of an unchanged layout is known in advance: checkpointer.py); `stage` copies
    a whole list; `fence` closes the copies; `finish` drops buffers of keys this save did not use."""

    def __init__(self, pool: "StagingPool", slot: Slot):
        self.pool, self.slot = pool, slot
        self.live: set = set()
        self._devices: set = set()

    def copy(self, key: BufferKey, src: torch.Tensor) -> torch.Tensor:
        buf = self.slot.buffers.get(key)
        if not _fits(buf, src):
            buf = allocate([src], pinned=_wants_pinned(src))[0]
            self.slot.buffers[key] = buf
        self.live.add(key)
        if src.is_cuda:
            self._devices.add(src.device)
            buf.copy_(src, non_blocking=True)
        else:
            buf.copy_(src)
        return buf

    def reserve(self, items: Sequence[Tuple[BufferKey, torch.Tensor]]) -> List[torch.Tensor]:
        """The slot's buffers for `items` (missing ones allocated together), nothing copied yet:
        async staging copies these later (copy_cpu on the job thread, or a side CUDA stream)."""
        self.pool.reserve(self.slot, list(items))
        self.live.update(k for k, _ in items)
        return [self.slot.buffers[k] for k, _ in items]

    def stage(self, items: Iterable[Tuple[BufferKey, torch.Tensor]]) -> List[torch.Tensor]:
        """Copy each source into the slot's buffer for its key (missing buffers allocated together
        first); returns the CPU buffers, in order."""
        items = list(items)
        self.pool.reserve(self.slot, [(k, s) for k, s in items])
        return [self.copy(k, s) for k, s in items]

    def fence(self) -> Fence:
        events = []
        for device in self._devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        self._devices = set()
        return Fence(events)

    def finish(self) -> None:
        for key in [k for k in self.slot.buffers if k not in self.live]:  # layout changed: drop stale buffers
            del self.slot.buffers[key]


class StagingPool:
    def __init__(self, slots: int = 2):
        self._slots = [Slot(i) for i in range(max(1, slots))]
        self._next = 0
        self._cond = threading.Condition()

    def acquire(self) -> Slot:
        """The next slot in turn; waits while an earlier save still writes from it."""
        with self._cond:
            slot = self._slots[self._next % len(self._slots)]
            self._next += 1
            while slot.busy:
                self._cond.wait()
            slot.busy = True
            return slot

    def release(self, slot: Slot) -> None:
        with self._cond:
            slot.busy = False
            self._cond.notify_all()

    def session(self, slot: Slot) -> Staging:
        return Staging(self, slot)

    def stage(self, slot: Slot, items: Iterable[Tuple[BufferKey, torch.Tensor]]) -> List[torch.Tensor]:
        """Copy each source into the slot's buffer and wait for the copies (one call, no overlap)."""
        staging = self.session(slot)
        out = staging.stage(items)
        staging.fence().wait()
        staging.finish()
        return out

    def reserve(self, slot: Slot, items: Sequence[Tuple[BufferKey, torch.Tensor]], background: bool = False) -> int:
        """Allocate the slot's missing buffers for `items` ((key, source-like tensor)) together;
        returns the bytes allocated. The caller holds the slot (or it is idle: `warm`).
        `background`: off the training thread (pre-faulted by that thread alone, see allocate)."""
        missing = [(k, like) for k, like in items if not _fits(slot.buffers.get(k), like)]
        if not missing:
            return 0
        total = 0
        for pinned in (True, False):
            group = [(k, like) for k, like in missing if _wants_pinned(like) == pinned]
            if group:
                for (k, _), buf in zip(group, allocate([like for _, like in group], pinned, background)):
                    slot.buffers[k] = buf
                    total += buf.numel() * buf.element_size()
        return total

    def warm(self, like: Slot) -> None:
        """Give every idle slot buffers shaped like `like`'s (called in the background after a
        write), so the next save's copy lands in allocated memory instead of fresh pages. The
        buffers are allocated without holding the slot: a save that wants it meanwhile takes it at
        once (and stages into buffers of its own), instead of waiting for the warm-up."""
        for slot in self._slots:
            if slot is like:
                continue
            shadow = Slot(slot.index)
            shadow.buffers = dict(slot.buffers)
            if not self.reserve(shadow, list(like.buffers.items()), background=True):
                continue
            with self._cond:
                if not slot.busy:  # else a save took the slot meanwhile: its own buffers win
                    slot.buffers.update({k: b for k, b in shadow.buffers.items() if k in like.buffers})

    def prepare(self, items: Sequence[Tuple[BufferKey, torch.Tensor]], background: bool = False) -> int:
        """Allocate every slot's buffers for a save of `items` ahead of it (Checkpointer.warm_up);
        returns the bytes allocated."""
        total = 0
        for slot in self._slots:
            with self._cond:
                while slot.busy:
                    self._cond.wait()
                slot.busy = True
            try:
                total += self.reserve(slot, items, background)
            finally:
                self.release(slot)
        return total

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for s in self._slots for b in s.buffers.values())

    def free(self) -> None:
        """Drop every buffer (pinned memory included); the pool stays usable and refills on use."""
        with self._cond:
            while any(slot.busy for slot in self._slots):
                self._cond.wait()
            for slot in self._slots:
                slot.buffers.clear()


def _fits(buf: Optional[torch.Tensor], like: torch.Tensor) -> bool:
    return buf is not None and buf.shape == like.shape and buf.dtype == like.dtype


def _wants_pinned(like: torch.Tensor) -> bool:
    return (like.is_cuda or like.is_pinned()) and torch.cuda.is_available()


def allocate(likes: Sequence[torch.Tensor], pinned: bool, background: bool = False) -> List[torch.Tensor]:
    """CPU buffers shaped like `likes`, carved out of one allocation (64-byte aligned views; those of
    BIG_ALIGN bytes or more page-aligned). Pinned: page-locked (resident already); else pre-faulted
    now, not inside the first timed copy: on the training thread with torch's threads (fastest: this is
    that save's stall), in the background by that thread alone (one memset: no thread team of its own
    beside the training's)."""
    offsets, total = [], 0
    for t in likes:
        nbytes = t.numel() * t.element_size()
        align = PAGE if nbytes >= BIG_ALIGN else _ALIGN
        total = -(-total // align) * align
        offsets.append(total)
        total += nbytes
    total = -(-total // _ALIGN) * _ALIGN
    raw = torch.empty(max(total, 1) + PAGE, dtype=torch.uint8, pin_memory=pinned)
    base = (-raw.data_ptr()) % PAGE
    arena = raw[base:base + max(total, 1)]
    if not pinned and total:
        if background:
            prefault(arena)
        else:
            arena.zero_()
    out = []
    for t, off in zip(likes, offsets):
        nbytes = t.numel() * t.element_size()
        out.append(arena[off:off + nbytes].view(t.dtype).view(t.shape))
    return out


def prefault(arena: torch.Tensor) -> None:
    """Touch every page of a fresh CPU buffer (zeros), single-threaded, GIL released per piece."""
    ptr, n = arena.data_ptr(), arena.numel()
    for start in range(0, n, _PREFAULT_PIECE):
        ctypes.memset(ptr + start, 0, min(_PREFAULT_PIECE, n - start))


_RAW = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_cpu(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src for CPU tensors on the calling thread alone (no intra-op thread team), the GIL
    released: one memmove when both are contiguous, numpy's strided copy otherwise (the bits as
    same-size integers, so every dtype copies exactly)."""
    n = src.numel() * src.element_size()
    if not n:
        return
    if src.is_contiguous() and dst.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    size = src.element_size()
    src = src.detach()
    if size in _RAW and dst.is_contiguous() and not src.is_conj() and not src.is_neg():
        try:
            np.copyto(dst.view(_TORCH_RAW[size]).numpy(), src.view(_TORCH_RAW[size]).numpy(), casting="no")
            return
        except (RuntimeError, TypeError, ValueError):
            pass
    with torch.no_grad():
        dst.copy_(src)  # complex128 and other odd layouts: torch's copy
