"""O_DIRECT writes of one file (storage/posix.py's async-save packs, and a sync save's where measured
faster): whole, page-aligned requests at page-aligned offsets; page-aligned parts go straight from
their buffer, the rest through a small aligned bounce buffer (a few kept for reuse); the last page
is padded and the file cut to its size, so the bytes are exactly a buffered write's."""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from typing import List

import numpy as np

# O_DIRECT: request unit (covers 512-byte and 4 KiB logical blocks), request size, bounce buffer.
PAGE = 4096
DIRECT_REQUEST_BYTES = 32 << 20
BOUNCE_BYTES = 8 << 20
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


class _Refused(Exception):
    """The file system does not take O_DIRECT (here, or for these requests)."""


_BOUNCES: List[np.ndarray] = []
_BOUNCE_LOCK = threading.Lock()


def _address(v: memoryview) -> int:
    return np.frombuffer(v, dtype=np.uint8).ctypes.data


class _DirectWriter:
    """Writes one file with O_DIRECT: whole, page-aligned requests at page-aligned offsets."""

    def __init__(self, fd: int):
        self.fd, self.pos, self.size, self.fill = fd, 0, 0, 0
        with _BOUNCE_LOCK:
            raw = _BOUNCES.pop() if _BOUNCES else None
        if raw is None:
            raw = np.empty(BOUNCE_BYTES + PAGE, dtype=np.uint8)
        self._raw = raw
        start = (-raw.ctypes.data) % PAGE
        self.bounce = raw[start:start + BOUNCE_BYTES]
        self._bounce_at = self.bounce.ctypes.data
        self._bounce_mv = memoryview(self.bounce)

    def add(self, v: memoryview) -> None:
        n, off = len(v), 0
        self.size += n
        addr = _address(v)
        while off < n:
            if self.fill == 0 and (addr + off) % PAGE == 0 and n - off >= PAGE:  # straight from the buffer
                k = (n - off) // PAGE * PAGE
                self._write(v[off:off + k])
                off += k
                continue
            take = min(n - off, BOUNCE_BYTES - self.fill)
            ctypes.memmove(self._bounce_at + self.fill, addr + off, take)
            self.fill += take
            off += take
            if self.fill == BOUNCE_BYTES:
                self._flush()

    def finish(self) -> None:
        if self.fill:
            pad = -self.fill % PAGE
            ctypes.memset(self._bounce_at + self.fill, 0, pad)
            self.fill += pad
            self._flush()
        os.ftruncate(self.fd, self.size)  # the padding of the last page goes
        os.fdatasync(self.fd)

    def _flush(self) -> None:
        self._write(self._bounce_mv[:self.fill])
        self.fill = 0

    def _write(self, mv: memoryview) -> None:
        done = 0
        while done < len(mv):
            n = os.pwrite(self.fd, mv[done:done + DIRECT_REQUEST_BYTES], self.pos)
            if n <= 0 or n % PAGE:
                raise OSError(errno.EIO, f"short O_DIRECT write ({n} bytes)")
            done += n
            self.pos += n

    def release(self) -> None:
        self._bounce_mv.release()
        with _BOUNCE_LOCK:
            if len(_BOUNCES) < 8:
                _BOUNCES.append(self._raw)
