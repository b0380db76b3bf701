"""Rank programs for tests/dist/test_plain_values.py: plain values that differ between ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

import bytecheckpoint as bcp


def save(path: str) -> None:
    r = dist.get_rank()
    bcp.save(path, {"w": torch.arange(8.0), "extra": {f"only_rank{r}": r + 10, "common": 5}, "seen": r, "step": 7})


def load(path: str, saved_world: int) -> None:
    """Loaded on fewer ranks: dicts hold every saved rank's keys; `seen` is the first saved rank
    this rank stands for (r * k); a template key the checkpoint lacks fails before any tensor."""
    r, w = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    k = saved_world // w
    state = {"w": torch.zeros(8), "extra": {f"only_rank{i}": -1 for i in range(saved_world)} | {"common": 0},
             "seen": -1, "step": 0}
    bcp.load(path, state)
    assert state["extra"] == {**{f"only_rank{i}": i + 10 for i in range(saved_world)}, "common": 5}, state["extra"]
    assert state["seen"] == r * k and state["step"] == 7 and torch.equal(state["w"], torch.arange(8.0)), state
    bad = {"w": torch.zeros(8), "extra": {"common": 0, "not_saved": 1}, "seen": -1, "step": 0}
    try:
        bcp.load(path, bad)
    except bcp.CheckpointError as exc:  # StateMismatchError, or RemoteRankError naming it when every rank fails
        assert "StateMismatchError" in f"{type(exc).__name__}: {exc}" and "'extra/not_saved'" in str(exc), exc
    else:
        raise AssertionError("a template key the checkpoint lacks must fail a strict load")
    assert torch.equal(bad["w"], torch.zeros(8)) and bad["extra"] == {"common": 0, "not_saved": 1}  # untouched
    print(f"rank {r}: PLAIN VALUES OK", flush=True)
