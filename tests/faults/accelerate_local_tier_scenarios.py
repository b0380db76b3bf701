"""Rank programs for the Accelerate version of the local-tier failure story
(tests/faults/test_local_tier.py): `attach` with a local tier, `save_local` every step,
`save_state` every few steps; a node is lost; the survivor resumes with `attachment.restore()`.

Each rank is its own node (2 nodes x 1 rank; node dirs `<run>/local/node<k>`). Rank 0 writes the
reference state of every step to `<run>/ref/` (the test's oracle, never read by the library)."""
from __future__ import annotations

import json
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import bytecheckpoint as bcp
from accelerate_bytecheckpoint import attach


class Counter:
    """A registered custom object (register_for_checkpointing): restored with the rest."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = int(state["seen"])


def _setup(run: str, replicas: int, seed: int):
    torch.manual_seed(seed)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=run, automatic_checkpoint_naming=True, total_limit=3))
    model = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.7)
    model, optim, sched = acc.prepare(model, optim, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    tier = bcp.LocalTier(dir=os.path.join(run, "local", "node{node}"), replicas=replicas, keep=3, node=lambda r: r)
    att = attach(acc, bcp.Checkpointer.from_env(local_tier=tier, dead_peer_s=10, timeout_s=60))
    return acc, model, optim, sched, counter, att


def _reference(model, optim, sched, counter) -> dict:
    unwrapped = getattr(model, "module", model)
    return {"model": {k: v.clone() for k, v in unwrapped.state_dict().items()},
            "optim": optim.optimizer.state_dict()["state"], "sched": sched.scheduler.state_dict(),
            "seen": counter.seen}


def _step(acc, model, optim, sched, counter, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + acc.process_index)
    loss = model(torch.randn(4, 13, generator=g)).pow(2).mean()
    optim.zero_grad()
    acc.backward(loss)
    optim.step()
    sched.step()
    counter.seen += 4


def train(run: str, steps: int, replicas: int, persist_every: int) -> None:
    acc, model, optim, sched, counter, att = _setup(run, replicas, seed=3)
    os.makedirs(os.path.join(run, "ref"), exist_ok=True)
    os.makedirs(os.path.join(run, "markers"), exist_ok=True)
    for step in range(1, steps + 1):
        _step(acc, model, optim, sched, counter, step)
        if acc.is_main_process:
            torch.save(_reference(model, optim, sched, counter), os.path.join(run, "ref", f"step_{step}.pt"))
        att.save_local(step)
        if step % persist_every == 0:
            acc.save_state()
        with open(os.path.join(run, "markers", f"step_{step}.{acc.process_index}"), "w") as f:
            f.write(str(time.time()))
        time.sleep(0.3)  # room for the test to kill a node between steps
    att.wait()
    print(f"rank {acc.process_index}: TRAINED {steps}", flush=True)


def resume(run: str, replicas: int, more_steps: int = 2) -> None:
    acc, model, optim, sched, counter, att = _setup(run, replicas, seed=99)
    restored = att.restore()
    assert restored.source is not None, restored
    step = counter.seen // 4   # the registered object counts 4 samples per step
    assert restored.source != "local" or restored.name == f"step_{step}", (restored, step)
    ref = torch.load(os.path.join(run, "ref", f"step_{step}.pt"), weights_only=False)
    got = _reference(model, optim, sched, counter)
    _assert_same(got, ref, f"step {step}")
    print(f"rank {acc.process_index}: RESTORED " + json.dumps(
        {"source": restored.source, "name": restored.name, "step": step, "reason": restored.reason}), flush=True)
    for s in range(step + 1, step + 1 + more_steps):
        _step(acc, model, optim, sched, counter, s)
        att.save_local(s)
    att.wait()
    print(f"rank {acc.process_index}: TRAINED ON to step {step + more_steps}", flush=True)


def _assert_same(got, ref, where: str) -> None:
    if isinstance(ref, torch.Tensor):
        assert torch.equal(got, ref), f"{where}: tensor differs"
    elif isinstance(ref, dict):
        assert set(got) == set(ref), f"{where}: keys {sorted(map(str, got))} != {sorted(map(str, ref))}"
        for k in ref:
            _assert_same(got[k], ref[k], f"{where}[{k!r}]")
    else:
        assert got == ref, f"{where}: {got!r} != {ref!r}"
