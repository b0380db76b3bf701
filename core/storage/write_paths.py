"""How a synchronous save writes its big files on one file system, chosen by measurement (issue 40).

Two ways: buffered (writev into the page cache, then fdatasync) or O_DIRECT (straight from the
tensors' memory to the device). Which is faster depends on the machine: on this project's VM
O_DIRECT saves were 0.20-0.41 s against 0.22-0.32 s buffered for the same 405 MiB, elsewhere
O_DIRECT wrote at twice the buffered rate. A sync save is also often followed by a load (a resume,
an evaluation) that finds buffered files in the page cache and O_DIRECT ones only on the device.
So the cost of a way is its write time plus the time to read the bytes back: ~0 for buffered,
for O_DIRECT taken to be its own write time (a device reads about as fast as it writes directly).
The sync save takes O_DIRECT only when that sum is smaller: when it writes more than twice as fast.

Each file system (st_dev) keeps the seconds per byte of its last big writes each way: async
saves' O_DIRECT files and sync saves' buffered ones are measured anyway. A process that only ever
saves synchronously probes once: after two buffered samples, one big file of a save goes O_DIRECT.
"""
from __future__ import annotations

import os
import statistics
import threading
from collections import deque
from typing import Deque, Dict, Optional

SAMPLES = 5                 # per way: the median of the last few writes
PROBE_AFTER = 2             # buffered samples before the one O_DIRECT probe
READ_BACK = 2.0             # O_DIRECT's cost factor: its write, then the read from the device


class WritePaths:
    """One file system's measured ways (thread-safe: pack files are written on worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: Dict[str, Deque[float]] = {"buffered": deque(maxlen=SAMPLES), "direct": deque(maxlen=SAMPLES)}
        self._probing = False

    def record(self, direct: bool, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._samples["direct" if direct else "buffered"].append(seconds / nbytes)
            if direct:
                self._probing = False

    def direct_for_sync(self) -> bool:
        """Whether the next big file of a sync save goes O_DIRECT (the probe, or it is the faster sum)."""
        with self._lock:
            buffered, direct = self._samples["buffered"], self._samples["direct"]
            if not direct:
                if len(buffered) >= PROBE_AFTER and not self._probing:
                    self._probing = True  # one file only, until its sample is in
                    return True
                return False
            if not buffered:
                return False
            return READ_BACK * statistics.median(direct) < statistics.median(buffered)

    def rates(self) -> Dict[str, Optional[float]]:
        """MB/s each way (median of the samples), for reports and tests."""
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
