"""Rank functions for tests/launcher.run_ranks (Lightning adapter tests)."""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist


def missing_peer(path: str, timeout_s: float) -> None:
    """Rank 0 starts a collective (sharded) save through the plugin; rank 1 never joins (it is
    alive but busy). Rank 0 must get a PeerTimeoutError within the bound, not hang."""
    import bytecheckpoint as bcp

    from lightning_bytecheckpoint import ByteCheckpointIO

    io = ByteCheckpointIO(bcp.Checkpointer(timeout_s=timeout_s))
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(timeout_s * 2 + 2)
        os._exit(0)  # the group is broken after rank 0's timeout: no clean teardown possible
    state = {"w": bcp.Shard(torch.zeros(2), (4,), (0,))}
    t0 = time.perf_counter()
    try:
        io.save(state, path, process_group=None)
    except bcp.PeerTimeoutError as exc:
        print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "message": str(exc)}))
    else:
        raise AssertionError("the save did not notice the missing peer")
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    import sys

    sys.stdout.flush()
    os._exit(0)  # skip the launcher's final barrier: gloo closed the pair after the timeout
