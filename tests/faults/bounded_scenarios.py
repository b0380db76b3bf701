"""Rank programs for tests/faults/test_bounded_waits.py: saves that some rank never joins or dies in.

Each prints one line per outcome ("rank R: ...") and ends with os._exit so that no teardown
collective can hang (the test judges the printed lines and the exit codes)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.storage import faults


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _say(msg: str) -> None:
    print(f"rank {_rank()}: {msg}", flush=True)


def subset_save(path: str, timeout_s: float, sharded: bool) -> None:
    """The diffusers pattern gone wrong: only rank 0 calls a collective save; rank 1 goes on to
    `wait_for_everyone()`. Rank 0 must raise within the bound; rank 1 must error, not hang."""
    rank = _rank()
    ckpt = bcp.Checkpointer(timeout_s=timeout_s)
    if rank == 0:
        state = {"w": bcp.Shard(torch.ones(4, 4), (8, 4), (0, 0))} if sharded else {"w": torch.ones(8, 4)}
        t0 = time.monotonic()
        try:
            ckpt.save(path, state)
            _say("SAVED (unexpected)")
        except bcp.PeerTimeoutError as exc:
            _say(f"RAISED PeerTimeoutError after {time.monotonic() - t0:.2f} s: {exc}")
        os._exit(0)
    t0 = time.monotonic()
    try:
        dist.barrier()
        _say("BARRIER PASSED (unexpected)")
    except Exception as exc:  # noqa: BLE001 - the peer left: any error is the expected outcome
        _say(f"BARRIER ERROR after {time.monotonic() - t0:.2f} s: {type(exc).__name__}")
    os._exit(0)


def local_save_on_main(path: str) -> None:
    """The same pattern done right: rank 0 saves replicated state alone (process_group=LOCAL); every
    rank then loads it by itself."""
    rank = _rank()
    state = {"w": torch.arange(32.0).view(8, 4), "step": 7}
    if rank == 0:
        bcp.save(path, state, process_group=bcp.LOCAL)
    dist.barrier()
    out = {"w": torch.zeros(8, 4), "step": 0}
    bcp.load(path, out, process_group=bcp.LOCAL)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 7
    _say("LOCAL OK")


def dead_peer_async(path: str, dead_peer_s: float) -> None:
    """Rank 1 is killed (SIGKILL from inside its storage layer) while writing an async save; rank
    0's wait() must fail within about dead_peer_s, naming the rank."""
    rank = _rank()
    ckpt = bcp.Checkpointer(dead_peer_s=dead_peer_s, timeout_s=600)
    state = {"w": bcp.Shard(torch.ones(1024, 256) * rank, (2048, 256), (1024 * rank, 0))}
    with faults.inject({"op": "write", "kind": "kill", "key": "/pack/", "rank": 1}, checkpointer=ckpt):
        h = ckpt.save(path, state, async_save=True)
        t0 = time.monotonic()
        try:
            h.wait()
            _say("COMMITTED (unexpected)")
        except bcp.PeerTimeoutError as exc:
            _say(f"DEAD PEER DETECTED after {time.monotonic() - t0:.2f} s: {exc}")
    os._exit(0)
