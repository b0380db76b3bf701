"""How a synchronous save writes its big files on one file system, chosen by measurement (issue 40).

Two ways: buffered (writev into the page cache, then fdatasync) or O_DIRECT (straight from the
tensors' memory to the device). Which is faster depends on the machine: on this project's VM
O_DIRECT saves took 0.20-0.41 s against 0.22-0.32 s buffered for the same 405 MiB, on the machine
of issue 40 O_DIRECT wrote at twice the buffered rate. A sync save is also often followed by a load
(a resume, an evaluation) that finds buffered files in the page cache and O_DIRECT ones only on the
device. So the cost of a way is its write time plus the time to read the bytes back: ~0 for
buffered; for O_DIRECT the measured time of the first read of files written that way. A sync save
writes O_DIRECT only where both are measured and that sum is clearly smaller (direct_for_sync).

Each file system (st_dev) keeps the seconds per byte of its last big writes each way and of the
first reads of O_DIRECT-written files. O_DIRECT samples come from async saves (their packs are
written that way anyway) or direct_io=True; a process that only saves synchronously, buffered,
never tries O_DIRECT on its own (what a probe costs, a cold load, is what this module avoids).
"""
from __future__ import annotations

import os
import statistics
import threading
from collections import OrderedDict, deque
from typing import Deque, Dict, Optional

SAMPLES = 5                 # per way: the median of the last few writes
MIN_SAMPLES = 3             # of each (buffered, O_DIRECT write, O_DIRECT read-back) before choosing O_DIRECT
MARGIN = 1.25               # O_DIRECT's sum must beat the buffered write by this factor
COLD_FILES = 256            # O_DIRECT-written files whose first read is still to be measured


class WritePaths:
    """One file system's measured ways (thread-safe: pack files are written on worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: Dict[str, Deque[float]] = {k: deque(maxlen=SAMPLES) for k in ("buffered", "direct", "read_back")}
        self._cold: "OrderedDict[str, int]" = OrderedDict()  # O_DIRECT file -> bytes not read back yet

    def record(self, direct: bool, nbytes: int, seconds: float, path: Optional[str] = None) -> None:
        """A big file written; `path` (O_DIRECT): its first read is measured too (is_cold/read_back)."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._samples["direct" if direct else "buffered"].append(seconds / nbytes)
            if direct and path is not None:
                self._cold[path] = nbytes
                while len(self._cold) > COLD_FILES:
                    self._cold.popitem(last=False)

    def is_cold(self, path: str) -> bool:
        return path in self._cold  # a racy read is fine: a missed or extra sample

    def read_back(self, path: str, nbytes: int, seconds: float) -> None:
        """A read of an O_DIRECT-written file before all of it was read once (from the device)."""
        with self._lock:
            left = self._cold.get(path)
            if left is None or nbytes <= 0 or seconds <= 0:
                return
            self._samples["read_back"].append(seconds / nbytes)
            if left - nbytes <= 0:
                del self._cold[path]
            else:
                self._cold[path] = left - nbytes

    def direct_for_sync(self) -> bool:
        """Whether a sync save's big file goes O_DIRECT: its write + read-back measured (MIN_SAMPLES
        each, the read-back too: an assumed one chose O_DIRECT for bench_checkpoint, whose load went
        0.10 -> 0.44 s) and smaller than the buffered write by MARGIN (per-file samples swing 2-8x
        between saves on this project's VM)."""
        with self._lock:
            buffered, direct, back = (self._samples[k] for k in ("buffered", "direct", "read_back"))
            if min(len(buffered), len(direct), len(back)) < MIN_SAMPLES:
                return False
            return MARGIN * (statistics.median(direct) + statistics.median(back)) < statistics.median(buffered)

    def rates(self) -> Dict[str, Optional[float]]:
        """MB/s each way and of the read-back (median of the samples), for reports and tests."""
        with self._lock:
            return {k: (1e-6 / statistics.median(v) if v else None) for k, v in self._samples.items()}


_by_device: Dict[int, WritePaths] = {}
_registry_lock = threading.Lock()


def for_root(root: str) -> WritePaths:
    """The measurements of the file system holding `root` (or its nearest existing parent)."""
    path = os.path.abspath(root)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        device = os.stat(path).st_dev
    except OSError:
        device = -1
    with _registry_lock:
        return _by_device.setdefault(device, WritePaths())
