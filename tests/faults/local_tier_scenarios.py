"""Rank programs for tests/faults/test_local_tier.py: FSDP2 training with a local checkpoint every
step (each rank's part copied to a rank on the other node) and a persistent one every few steps;
a node is lost; its survivors restore on fewer ranks.

Nodes are simulated on one machine: rank r of the first run is on node r // ranks_per_node, and
each node has its own local directory (`<run>/local/node<k>`). Reference full states of every step
are written by rank 0 to `<run>/ref/` (the test's oracle, never read by the library)."""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from scenarios_fsdp2 import full_state, model_and_optim


def _tier(run: str, replicas: int, ranks_per_node: int, node_map=None) -> bcp.LocalTier:
    node = (lambda r: node_map[r]) if node_map is not None else (lambda r: r // ranks_per_node)
    return bcp.LocalTier(dir=os.path.join(run, "local", "node{node}"), replicas=replicas, keep=2, node=node)


def _step(model, optim, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    loss = model(torch.randn(4, 13, generator=g)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def train(run: str, steps: int, replicas: int, persist_every: int, ranks_per_node: int = 2) -> None:
    """Train `steps` steps; local save every step (async), persistent save every `persist_every`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = bcp.Checkpointer.from_env(local_tier=_tier(run, replicas, ranks_per_node), dead_peer_s=10, timeout_s=60)
    model, optim = model_and_optim(world)
    state = {"model": model, "optim": optim, "step": 0}
    os.makedirs(os.path.join(run, "ref"), exist_ok=True)
    os.makedirs(os.path.join(run, "markers"), exist_ok=True)
    for step in range(1, steps + 1):
        _step(model, optim, step, rank)
        state["step"] = step
        ref = full_state(model, optim)
        if rank == 0:
            torch.save(ref, os.path.join(run, "ref", f"step_{step}.pt"))
        ckpt.save(f"step_{step}", state, tier="local", async_save=True, step=step)
        if step % persist_every == 0:
            ckpt.save(os.path.join(run, "persistent", f"step_{step}"), state, async_save=True, step=step)
        with open(os.path.join(run, "markers", f"step_{step}.{rank}"), "w") as f:
            f.write(str(time.time()))
        time.sleep(0.3)  # room for the test to kill a node between steps
    ckpt.close()
    print(f"rank {rank}: TRAINED {steps}", flush=True)


def resume(run: str, replicas: int, more_steps: int = 2, ranks_per_node: int = 2) -> None:
    """A restart on the surviving ranks: restore the newest checkpoint they can, check it bit for
    bit against the reference of its step, then train on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = bcp.Checkpointer.from_env(local_tier=_tier(run, replicas, ranks_per_node), dead_peer_s=10, timeout_s=60)
    model, optim = model_and_optim(world)
    state = {"model": model, "optim": optim, "step": 0}
    t0 = time.monotonic()
    restored = ckpt.restore(state, persistent=os.path.join(run, "persistent"))
    took = time.monotonic() - t0
    ref = torch.load(os.path.join(run, "ref", f"step_{state['step']}.pt"))
    got = full_state(model, optim)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref), "restored state differs"
    print(f"rank {rank}: RESTORED {json.dumps({'source': restored.source, 'name': restored.name, 'step': state['step'], 'reason': restored.reason, 'seconds': took})}",
          flush=True)
    for step in range(state["step"] + 1, state["step"] + 1 + more_steps):
        _step(model, optim, step, rank)
        state["step"] = step
        ckpt.save(f"step_{step}", state, tier="local", step=step)
    ckpt.close()
    print(f"rank {rank}: TRAINED ON to step {state['step']}", flush=True)


def save_then_restore_swapped(run: str) -> None:
    """Two nodes of one rank each, no replicas: each node holds only its rank's part. Restarting with
    the ranks on swapped nodes, every rank needs a part only the other rank holds: the restore
    moves those bytes between the ranks (no storage holds both)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = model_and_optim(world)
    state = {"model": model, "optim": optim, "step": 0}
    with bcp.Checkpointer(local_tier=_tier(run, 0, 1)) as ckpt:
        _step(model, optim, 1, rank)
        state["step"] = 1
        ckpt.save("step_1", state, tier="local")
        ref = full_state(model, optim)
    dist.barrier()
    model2, optim2 = model_and_optim(world)
    state2 = {"model": model2, "optim": optim2, "step": 0}
    with bcp.Checkpointer(local_tier=_tier(run, 0, 1, node_map={0: 1, 1: 0})) as ckpt:
        restored = ckpt.restore(state2)
        stats = ckpt.last_load_stats
    got = full_state(model2, optim2)
    assert restored.source == "local" and state2["step"] == 1, restored
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert stats.bytes_received > 0, stats
    print(f"rank {rank}: SWAPPED OK received {stats.bytes_received}", flush=True)


def torn_save(run: str, victim: int, dead_peer_s: float) -> None:
    """4 ranks as 2 nodes, one async local save of a few MiB; `victim` kills itself (-9) right
    after save() returns, in the middle of the tier's transfers. Every survivor's wait() must raise
    PeerTimeoutError naming the victim within dead_peer_s (plus a margin): prints the outcome."""
    import signal

    rank = dist.get_rank()
    ckpt = bcp.Checkpointer.from_env(local_tier=_tier(run, 1, 2), dead_peer_s=dead_peer_s, timeout_s=120)
    state = {"w": torch.full((4 << 20,), float(rank)), "step": 1}  # 16 MiB: the transfer outlives the kill
    handle = ckpt.save("step_1", state, tier="local", async_save=True, step=1)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        handle.wait()
        outcome = "COMMITTED"
    except bcp.PeerTimeoutError as exc:
        outcome = f"PEER_TIMEOUT {exc}"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = f"OTHER {type(exc).__name__}: {exc}"
    print(f"rank {rank}: WAITED {time.monotonic() - t0:.2f} {outcome}", flush=True)
    # rank 0 hosts the rendezvous store here (a launcher does under torchrun): stay until every
    # survivor has its answer, then leave without waiting for the tier group's stuck operation
    open(os.path.join(run, f"done.{rank}"), "w").close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(run, f"done.{r}")) for r in range(dist.get_world_size()) if r != victim):
        time.sleep(0.05)
    os._exit(0)
