"""Reusable staging buffers for async save (ping-pong pool).

Save N copies the bytes it will write into slot N % slots and returns; the background writer
releases the slot when its writes are done. Buffers are kept per (key, box) and reused by the
next save with the same layout, so steady-state saves allocate nothing. With CUDA, buffers are
pinned and device->host copies run non-blocking on a side stream.
"""
from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Tuple

import torch

BufferKey = Tuple[str, Tuple[int, ...], Tuple[int, ...], torch.dtype]


class Slot:
    def __init__(self, index: int):
        self.index = index
        self.buffers: Dict[BufferKey, torch.Tensor] = {}
        self.busy = False


class StagingPool:
    def __init__(self, slots: int = 2):
        self._slots = [Slot(i) for i in range(max(1, slots))]
        self._next = 0
        self._cond = threading.Condition()
        self._stream = None

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

    def stage(self, slot: Slot, items: Iterable[Tuple[BufferKey, torch.Tensor]]) -> List[torch.Tensor]:
        """Copy each source into the slot's buffer for its key; returns the CPU buffers, in order."""
        out: List[torch.Tensor] = []
        live = set()
        cuda_sources = False
        for key, src in items:
            buf = slot.buffers.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = _new_buffer(src)
                slot.buffers[key] = buf
            live.add(key)
            if src.is_cuda:
                cuda_sources = True
                with torch.cuda.stream(self._side_stream()):
                    buf.copy_(src, non_blocking=True)
            else:
                buf.copy_(src)
            out.append(buf)
        if cuda_sources:
            # The copies must land before training mutates the sources again.
            self._side_stream().synchronize()
        for key in [k for k in slot.buffers if k not in live]:  # layout changed: drop stale buffers
            del slot.buffers[key]
        return out

    def warm(self, like: Slot) -> None:
        """Give every idle slot buffers shaped like `like`'s (called in the background after a
        write), so the next save's copy lands in pre-faulted memory instead of fresh pages. The
        buffers are allocated and faulted without holding the slot: a save that wants it meanwhile
        takes it at once (and stages into buffers of its own), instead of waiting for the warm-up."""
        for slot in self._slots:
            if slot is like:
                continue
            fresh: Dict[BufferKey, torch.Tensor] = {}
            for key, buf in list(like.buffers.items()):
                have = slot.buffers.get(key)
                if have is None or have.shape != buf.shape or have.dtype != buf.dtype:
                    fresh[key] = _new_buffer(buf)
            if not fresh:
                continue
            with self._cond:
                if not slot.busy:  # else a save took the slot meanwhile: its own buffers win
                    slot.buffers.update(fresh)

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
        return self._stream

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for s in self._slots for b in s.buffers.values())

    def free(self) -> None:
        """Drop every buffer (pinned memory included); the pool stays usable and refills on use."""
        with self._cond:
            while any(slot.busy for slot in self._slots):
                self._cond.wait()
            for slot in self._slots:
                slot.buffers.clear()
            self._stream = None


def _new_buffer(like: torch.Tensor) -> torch.Tensor:
    pin = (like.is_cuda or like.is_pinned()) and torch.cuda.is_available()
    buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
    if buf.numel():
        buf.zero_()  # pre-fault the pages now, not inside the first timed copy
    return buf
