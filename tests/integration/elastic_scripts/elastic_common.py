"""What the elastic worker scripts share (tests/integration/test_elastic.py,
benchmarks/bench_elastic.py; their agents are started by elastic_harness.py).

Each script is started by torchrun's elastic agent on every "node" and restarted by it after a
membership change. It resumes by itself from the newest committed checkpoint, the way a user's
script does, and reports what happened as JSON lines in $ELASTIC_DIR/events.jsonl:

    start     the process started (its first line ran)
    resumed   a checkpoint was loaded: path, step, load_s, digest of the loaded state
    fresh     nothing committed to resume from
    step      a training step finished: step, world
    saving    a save of `step` was started (async: still in flight): digest of the saved state
    gate      waiting before `step` for the test to act
    done      the last step finished and its save is committed: digest of the final state
    error     a traceback (the test fails on it at once)

Training is deterministic and the same on every rank at every world size: each rank computes the
gradient of the same batch (a function of the step alone), so DDP's average of identical gradients
is exact and a world of 2 and a world of 1 follow the same trajectory bit for bit. A resume is
therefore checked against the state recorded when that step was saved, and the end against an
uninterrupted run (reference_digest: plain torch, one process; the frameworks' own optimizer
steps give the same bits).

Test-only controls (environment, set by the test or benchmark):
    ELASTIC_STEPS=N          train steps 1..N
    ELASTIC_SLOW=S:R         first incarnation only: from step S on, rank R's writes take
                             ELASTIC_SLOW_DELAY_S (default 30) each, so its save of S is still in
                             flight when the test kills that node
    ELASTIC_GATES=S:W:name,...  before step S, a rank of a world of W waits until the file
                             $ELASTIC_DIR/gates/<name> exists (or the agent restarts it)
    ELASTIC_START_WORLD=W    the first incarnation waits to be restarted until W ranks joined
    ELASTIC_HIDDEN=H         the hidden width (default 64): parameters + AdamW state = 240 H bytes
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, Optional, Tuple

T_START = time.time()

DIR = os.environ.get("ELASTIC_DIR", ".")
NODE = os.environ.get("ELASTIC_NODE", "?")
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
STEPS = int(os.environ.get("ELASTIC_STEPS", "12"))
GATE_LIMIT_S = 300.0
LEFT_FOR_RESTART_S = 120.0


def emit(event: str, **fields: Any) -> None:
    record = {"t": time.time(), "event": event, "node": NODE, "pid": os.getpid(), "rank": RANK, "world": WORLD,
              "restart": RESTART, **fields}
    line = json.dumps(record) + "\n"
    fd = os.open(os.path.join(DIR, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write per line: lines of several processes never interleave
    finally:
        os.close(fd)


def run(main: Callable[[], None]) -> None:
    """Run the script's main; report a failure as an `error` event and a non-zero exit."""
    emit("start", t_start=T_START)
    try:
        main()
    except BaseException as exc:  # noqa: BLE001 - reported, then re-raised as the exit code
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        emit("error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def hold_until_full() -> None:
    """First incarnation: wait (to be restarted by the agent) until the starting world has joined,
    so that the scenario starts on the world the test set up."""
    want = int(os.environ.get("ELASTIC_START_WORLD", "1"))
    if RESTART == 0 and WORLD < want:
        emit("waiting", want=want)
        time.sleep(LEFT_FOR_RESTART_S)
        raise RuntimeError(f"the agent did not restart this worker within {LEFT_FOR_RESTART_S:.0f} s to start "
                           f"a world of {want}")


def gate(step: int, aborted: Callable[[], bool] = lambda: False) -> None:
    for spec in filter(None, os.environ.get("ELASTIC_GATES", "").split(",")):
        s, w, name = spec.split(":")
        if int(s) != step or int(w) != WORLD:
            continue
        path = os.path.join(DIR, "gates", name)
        emit("gate", step=step, name=name)
        deadline = time.monotonic() + GATE_LIMIT_S
        while not os.path.exists(path):
            if aborted():
                raise SystemExit(0)  # the framework was told to stop (SIGTERM): leave as it asks
            if time.monotonic() > deadline:
                raise RuntimeError(f"gate {name!r} before step {step} was not opened within {GATE_LIMIT_S:.0f} s")
            time.sleep(0.02)


def slow_from(step: int) -> bool:
    """Whether this rank's writes are slowed from `step` on (first incarnation only)."""
    spec = os.environ.get("ELASTIC_SLOW", "")
    if not spec or RESTART != 0:
        return False
    s, r = spec.split(":")
    return step == int(s) and RANK == int(r)


def slow_writes(checkpointer: Any) -> None:
    """Every later write of this checkpointer takes ELASTIC_SLOW_DELAY_S (test-only fault rule)."""
    from bytecheckpoint.storage import faults
    delay = float(os.environ.get("ELASTIC_SLOW_DELAY_S", "30"))
    checkpointer.fault_rules.add([faults.Fault(op="write", kind="slow", delay_s=delay)])


# ---------------------------------------------------------------------- the training problem
D_IN, D_OUT, BATCH = 16, 4, 8
D_HIDDEN = int(os.environ.get("ELASTIC_HIDDEN", "64"))  # the benchmark sizes the state with it


def model():
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT))


def batch(step: int) -> Tuple[Any, Any]:
    """The batch of `step`: the same on every rank and in every incarnation."""
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, torch.randn(BATCH, D_OUT, generator=g)


def loss_of(net, step: int):
    x, y = batch(step)
    return (net(x) - y).pow(2).mean()


def digest(model_state: Dict[str, Any], optimizer_state: Optional[Dict[str, Any]] = None) -> str:
    """sha256 of a model state dict's values, in order (not its names: Lightning's module prefixes
    them with `net.`), and of an optimizer's state (torch.optim's state_dict()['state']). The three
    scripts train the same network with the same optimizer, so they reach the same digest."""
    import torch
    h = hashlib.sha256()

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                add(value[k])
        else:
            h.update(repr(value).encode())

    for value in model_state.values():
        add(value)
    if optimizer_state is not None:
        add(optimizer_state)
    return h.hexdigest()


def reference_digest(steps: int) -> str:
    """The state after `steps` uninterrupted steps on one process (plain torch)."""
    import torch
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss_of(net, step).backward()
        opt.step()
    return digest(net.state_dict(), opt.state_dict()["state"])


def init_gloo() -> None:
    """The process group of this incarnation (torchrun's env), bounded by a short timeout."""
    import datetime

    import torch.distributed as dist
    if WORLD > 1 or "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
