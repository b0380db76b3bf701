"""The save pipeline, top to bottom: flatten -> plan -> stage -> write -> commit.

The one place that orders a save; sync and async saves share it and part only at the stage step
(an async save copies into a staging slot and writes on a background thread; a sync save writes
from the tensors on the caller's thread). Where the save goes is a target: PersistentTarget
(pipeline/write.py) for a checkpoint directory, the local tier's (tiers/local.py) for a node-local
one; each opens (arrival of every rank), begins (the save id) and writes + commits its own way.
The Checkpointer hands in its resources (SaveResources) and owns them.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Tuple, Union

from ..collectives.comm import Comm
from ..monitor import OFF, Recorder
from ..planning.planner import LocalPlan, SavePlan
from ..state.flatten import TypeRegistry
from . import gate, guards, save_plan, stage, write
from .handles import PendingSaves, SaveHandle
from .staging import StagingPool
from .workers import BackgroundRunner, Workers


@dataclass(frozen=True)
class SaveResources:
    """What a save uses of its Checkpointer."""
    registry: TypeRegistry
    fsdp1_route: str
    threads: int
    plans: save_plan.PlanCache
    staging: Callable[[], StagingPool]      # made on first use
    runner: BackgroundRunner
    pending: PendingSaves
    closed: Callable[[], bool]
    fence: Optional[gate.StepFence] = None  # async staging's (None: never deferred)
    async_staging: Any = "auto"             # Options.async_staging


class Target(Protocol):
    def open(self, comm: Comm) -> None: ...          # foreground: storage, every rank's arrival
    def begin(self) -> Tuple[str, Optional[str]]: ...  # coordinator: (save id, data dir it replaces)
    def writer(self, comm: Comm, local: LocalPlan, full: Optional[SavePlan], save_id: str, old_data: Optional[str],
               structure: Any, objects_blob: bytes, info: Dict[str, Any]) -> write.Written: ...


def save(res: SaveResources, target: Target, comm: Comm, state: Dict[str, Any], *, background: bool, path: str,
         info: Dict[str, Any], t0: float, rec: Recorder = OFF, safetensors: Tuple[str, ...] = (),
         optimizers: Sequence[Any] = (), async_staging: Any = None) -> SaveHandle:
    """Collective: save `state` to `target`; returns once the state may change again (a sync save:
    committed; an async save: copied out, the write and commit running in the background; with async
    staging, the optimizers' tensors still being copied and their next step() held until they are).
    `rec`: this rank's record of the save (monitor/; the target's job finishes and writes it).
    `safetensors`: key paths whose tensors are written as safetensors packs (format 6).
    `optimizers`: optimizers whose tensors are in `state` without them (Lightning's state dicts)."""
    deferral = _deferral(res, state, optimizers, async_staging) if background else None
    # 1. flatten: walk the state (an async save of an unchanged layout starts its copies meanwhile)
    early = stage.early_copies(res.staging(), res.plans, comm.key, deferral) if background else None
    t_walk = time.perf_counter()
    try:
        with rec.span("walk"):
            prepared = save_plan.prepare(state, res.registry, res.fsdp1_route, early.on_tensor if early else None)
        t_plan = time.perf_counter()
        # 2. plan: every rank arrives, then the cached plan is confirmed or a new one made
        with rec.span("arrive"):
            target.open(comm)
        with rec.span("plan"):
            local, full, save_id, old_data, structure = save_plan.plan(
                comm, prepared.manifest, res.plans, target.begin, prepared.error, safetensors=safetensors,
                structure=prepared.structure)
        rec.op_id = save_id
        data = write.sources(prepared.flat, local.writes)
    except BaseException as exc:
        stage.release(early)
        rec.finish(exc)
        raise
    handle = SaveHandle(path, pending=res.pending)
    handle.stats.attach(rec)
    handle.stats.update(walk_s=t_plan - t_walk, plan_s=time.perf_counter() - t_plan)
    written = target.writer(comm, local, full, save_id, old_data, structure, prepared.objects_blob, info)
    if not background:
        # 3. stage (device tensors only), 4. write, 5. commit, all on the caller's thread
        with stage.on_host(res.staging(), local, data) as host, Workers(res.threads) as workers:
            written.run_sync(workers, host)
        handle.stats["total_s"] = time.perf_counter() - t0
        return handle
    # 3. stage into a slot (the caller waits for this only), then 4. write and 5. commit in the background
    stage.start(res.staging(), res.runner, res.threads, early, local, data, written, handle, res.closed, t0,
                deferral, rec)
    _record_stall(rec, handle.stats, data)
    res.pending.add(handle)
    return handle


def _record_stall(rec: Recorder, stats: Dict[str, Any], data) -> None:
    """An async save's caller-side copy, from the times stage.start measured."""
    if not rec.enabled or "stall_s" not in stats:
        return
    done = rec.perf0 + stats["stall_s"]
    wait = done - stats.get("copy_wait_s", 0.0)
    rec.add("copy", wait - stats.get("copy_s", 0.0), wait, sum(t.numel() * t.element_size() for t in data), len(data))
    rec.add("copy_wait", wait, done)
    rec.set(stall_us=int(stats["stall_s"] * 1e6), async_save=True)


def _deferral(res: SaveResources, state: Dict[str, Any], optimizers: Sequence[Any], mode: Any
              ) -> Optional[stage.Deferral]:
    """Async staging for this save, or None: off, no optimizer guards anything, a CUDA graph is being
    captured (its replays run no hooks), or "auto" with no optimizer on a GPU."""
    mode = res.async_staging if mode is None else mode
    if res.fence is None or mode is False or gate.cuda_capturing():
        return None
    found = guards.optimizers_in(state, optimizers)
    if mode == "auto":  # CUDA tensors only: measured on CPU in docs/async_staging.md
        found = [(o, ids) for o, ids in found if any(p.is_cuda for g in o.param_groups for p in g["params"][:1])]
    held = guards.Guards(found, guards.written_in_forward(state)) if found else guards.NO_GUARDS
    return stage.Deferral(held, res.fence, cpu=mode is True) if held else None


def warm_up(res: SaveResources, comm: Comm, state: Dict[str, Any], timeout_s: float,
            background: bool = False) -> Union[int, "Future[int]"]:
    """Collective: plan `state` as a save would and allocate every staging slot's buffers for it;
    nothing is copied or written. Returns the bytes of staging memory allocated, or (background)
    a Future of them: the plan is made on the caller, the allocation on a background thread (a save
    meanwhile waits for the slot being filled instead of allocating it again)."""
    prepared = save_plan.prepare(state, res.registry, res.fsdp1_route)
    target = write.WarmUpTarget(timeout_s)
    target.open(comm)
    local, _, _, _, _ = save_plan.plan(comm, prepared.manifest, res.plans, target.begin, prepared.error,
                                       structure=prepared.structure)
    data = write.sources(prepared.flat, local.writes)
    items = stage.staging_items(local, data)
    if not background:
        return res.staging().prepare(items)
    # outside the saves' order: a save never waits for it, only for its slot
    return res.runner.spawn(lambda: res.staging().prepare(items, background=True))
