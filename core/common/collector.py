"""Python's cyclic garbage collector paused while a save or load runs in the caller's thread.

A save or load makes tens of thousands of short-lived containers (entries, plans, checksum
tables). Left on, the collector runs generation-0/1 passes over them while they are alive,
promotes them, and every few saves that promotion triggers a full collection of the whole
process: 150-200 ms with torch, a model and an optimizer loaded (~300k objects; measured by
benchmarks/bench_real_model.py: the 1-process save's median 0.34 -> 0.24 s, the resume's
0.28 -> 0.18 s, issue 40). Paused, they die by reference counting before any pass sees them.
The collector's state is restored after; nothing the caller saves is touched. An async save's
background work runs with the collector as the caller set it (training runs meanwhile).
"""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0              # saves and loads running now (threads may overlap)
_resume = False         # whether the collector was on when the first of them started


@contextlib.contextmanager
def paused() -> Iterator[None]:
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
