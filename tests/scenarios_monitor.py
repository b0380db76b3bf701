"""Rank functions for the monitoring tests (run in fresh gloo processes by tests/launcher.py).

`straggler_trials`: every rank saves the fault-test state synchronously and asynchronously, then
loads it back; the storage of one rank is slowed by the BCP_FAULTS rules the test sets (pack
writes of one rank, pack reads of another), so `bytecheckpoint stats` must name those ranks."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults"))

import torch.distributed as dist  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402
from fault_scenarios import build_state, check_state  # noqa: E402


def straggler_trials(root: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = build_state(1, rank, world)
    bcp.save(f"{root}/sync", state)
    bcp.save(f"{root}/async", state, async_save=True).wait()
    into = build_state(1, rank, world, zero=True)
    bcp.load(f"{root}/sync", into)
    check_state(into, 1, rank, world)
    print(f"rank {rank}: TRIALS_OK", flush=True)
