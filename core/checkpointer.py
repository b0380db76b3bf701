"""The engine as an object: `Checkpointer` owns every resource a save or load uses.

    with bcp.Checkpointer(async_save=True, storage_options=opts) as ckpt:
        h = ckpt.save("s3://bucket/run/step_100", state)
        ...
        ckpt.load("s3://bucket/run/step_100", state)

It owns the staging pool, the background runner and per-operation worker threads, the pending
saves, the plan cache, a metadata cache, the host list per process group, the tensorstore
Context and the opened storages. Two instances with different options work side by side;
`close()` waits for pending saves and frees all of it. `bcp.save` / `bcp.load` are thin calls on
a default instance built from the environment (see common/options.py).
"""
from __future__ import annotations

import functools
import logging
import os
import pickle
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import foreign
from .catalog import inspect as inspection
from .common import collector
from .common.errors import CheckpointerClosedError, CheckpointError
from .common.options import Options
from .collectives import zero_redundancy
from .collectives.comm import LOCAL, Comm
from .catalog.metadata_cache import MetadataCache
from .format.metadata import Metadata
from .monitor import OFF, AsideWrites, Recorder, SaveStats, StatsReport, new_op_id, recorder
from .pipeline import device_reads, gate
from .pipeline import load as loader
from .pipeline import save as saving
from .pipeline.handles import PendingSaves, SaveHandle
from .pipeline.save_plan import PlanCache
from .pipeline.staging import StagingPool
from .pipeline.workers import BackgroundRunner, Workers
from .pipeline.write import PersistentTarget
from .state.flatten import TypeRegistry, top_level_placeholders
from .state.registry import REGISTRY
from .storage import Storage, faults
from .storage.cache import StorageCache
from .tiers import local as local_tier_mod
from .tiers import restoring
from .tiers.local import LocalTier, Restored

log = logging.getLogger("bytecheckpoint")
_UNSET: Any = object()  # "the instance's own setting" for per-call overrides
_METADATA_CACHE_SIZE = 8


class Checkpointer:
    """Saves and loads checkpoints; see the module docstring and README for the options.

    Args:
        storage_options: endpoint, region, credentials, retries, request_timeout (remote stores).
        async_save: save() returns once the state is copied out; writing and commit run in the
            background (wait with the handle, `wait()`, or the next save).
        process_group: the ranks that take part (default: the default group, if initialised).
            `bytecheckpoint.LOCAL` makes every call this process's alone.
        staging_slots: staging buffer sets for async saves (2 = ping-pong).
        io_threads: worker threads per operation (checksums, encoding, file I/O).
        zero_redundancy: "auto" | True | False: read bytes several ranks need once and share them.
        timeout_s: longest wait for peers (arrival at a save/load, an async commit).
        dead_peer_s: an async save gives up on a peer whose heartbeat stopped this long ago.
        (These and the other bcp.Options fields may also come as one `options=bcp.Options(...)`.)
        local_tier: a bcp.LocalTier for frequent node-local checkpoints.
        registry: the value types it can save (default bcp.REGISTRY; registry.builtin_registry()
            makes a private one to extend).
    """

    def __init__(self, *, options: Optional[Options] = None, storage_options: Optional[Mapping[str, Any]] = None,
                 process_group: Any = None, local_tier: Optional[LocalTier] = None,
                 registry: Optional[TypeRegistry] = None, fault_rules: Sequence[faults.Fault] = (),
                 **overrides: Any):
        """`options` (default: Options()) with `overrides` by name, e.g. Checkpointer(async_save=True);
        `registry`: the value types it knows (default: bcp.REGISTRY, the built-ins)."""
        if options is not None and not isinstance(options, Options):
            raise CheckpointError(f"Checkpointer: options must be a bytecheckpoint.Options, got {options!r}")
        self.options = (options or Options()).replaced(**overrides)
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise CheckpointError(f"Checkpointer: storage_options must be a dict, got {type(storage_options).__name__}")
        self.storage_options = dict(storage_options) if storage_options else None
        self.process_group = process_group
        self.registry = REGISTRY if registry is None else registry
        if local_tier is not None and not isinstance(local_tier, LocalTier):
            raise CheckpointError(f"Checkpointer: local_tier must be a bytecheckpoint.LocalTier, got {local_tier!r}")
        self._tier = (local_tier_mod.TierState(local_tier, self.options.timeout_s, self.options.dead_peer_s)
                      if local_tier else None)
        self.last_load_stats = loader.LoadStats()
        self.last_save_stats = SaveStats()  # the newest save()'s (its handle's .stats; complete once done)
        self._aside = AsideWrites()  # stats records still being put (object stores); settled by wait()
        self.fault_rules = faults.Rules(fault_rules)  # test-only storage faults (storage/faults.py)
        self._pending = PendingSaves()
        self._fence = gate.StepFence(self.options.timeout_s)  # async staging: steps held for pending copies
        self._runner = BackgroundRunner()
        self._plans = PlanCache()
        self._pool: Optional[StagingPool] = None
        self._slabs: Optional[device_reads.PinnedSlabs] = None
        self._metadata = MetadataCache(_METADATA_CACHE_SIZE)
        self._stores = StorageCache(self.options)
        self._hosts: Dict[Any, List[str]] = {}
        self._lock = threading.RLock()
        self._closed = False

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None, *, storage_options: Optional[Mapping[str, Any]] = None,
                 process_group: Any = None, local_tier: Optional[LocalTier] = None, **overrides: Any) -> "Checkpointer":
        """Options from BCP_* environment variables, then `overrides`; fault rules from BCP_FAULTS."""
        return cls(options=Options.from_env(env, **overrides), storage_options=storage_options,
                   process_group=process_group, local_tier=local_tier, fault_rules=faults.rules_from_env(env))

    def __reduce__(self):
        """Pickling (ddp_spawn, Fabric launchers, a pickled Accelerator) makes a new, idle engine
        with every setting: options, storage options, local tier, process group (None or
        bytecheckpoint.LOCAL; a live group belongs to one process and cannot travel)."""
        if self.process_group is not None and self.process_group is not LOCAL:
            raise pickle.PicklingError(
                f"a Checkpointer with process_group={self.process_group!r} cannot be pickled: a process group "
                f"belongs to the process that made it. Pickle one with process_group=None (the default group) or "
                f"bytecheckpoint.LOCAL, or build the Checkpointer in the new process")
        registry = None if self.registry is REGISTRY else self.registry  # the built-ins: the new process's own
        return (_rebuild, (self.options, self.storage_options, self.process_group, self.local_tier,
                           tuple(self.fault_rules.rules()), registry))

    # ------------------------------------------------------------------ save / load
    def save(self, path, state: Dict[str, Any], *, overwrite: bool = False, async_save: Optional[bool] = None,
             process_group: Any = _UNSET, storage_options: Any = _UNSET, tier: str = "persistent",
             step: Optional[int] = None, safetensors: Sequence[str] = (),
             before_commit: Optional[Callable[[Metadata], None]] = None, optimizers: Sequence[Any] = (),
             async_staging: Optional[bool] = None) -> SaveHandle:
        """Save `state` to `path` from every rank of the process group (collective); see README.
        tier="local": `path` is a name (e.g. "step_1200") in the local tier (see LocalTier).
        step: the training step, recorded in the metadata; restore() orders checkpoints by it
        (then by when save() was called), and prefers the local tier for the same step.
        safetensors: key paths (e.g. ["model"]) whose tensors, each held whole by a rank, are written as
        safetensors files inside the checkpoint (format 6; `bytecheckpoint.tools.safetensors.link_views`
        presents them to Hugging Face loaders without a copy). before_commit(metadata): called on the
        coordinator after every rank's data is written, before the commit point (an error fails the save).
        async_staging (None: the option): an async save copies the optimizers' tensors behind the next
        forward/backward, their step() waits for them (docs/async_staging.md); optimizers: those whose
        tensors `state` holds without holding them (e.g. their state_dict()s)."""
        self._check_open()
        t0 = time.perf_counter()
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise CheckpointError(f"save: step must be an int (the training step) or None, got {step!r}")
        info = {"captured_unix": time.time(), **({} if step is None else {"step": step})}
        self._pending.raise_finished_failures()
        background = self.options.async_save if async_save is None else bool(async_save)
        comm = self._comm(process_group)
        rec = OFF
        groups = _groups(safetensors)
        if tier == "local":
            if groups or before_commit is not None:
                raise CheckpointError("save: safetensors= and before_commit= are for tier='persistent' saves")
            target = local_tier_mod.LocalTarget(self._local_tier(), path, self.options.timeout_s)
        elif tier == "persistent":
            rec = self._recorder("save", comm, path, t0)
            target = PersistentTarget(lambda: self.storage(path, storage_options), overwrite, self._read_metadata,
                                      self.options.timeout_s, self.options.dead_peer_s, rec, before_commit)
        else:
            raise CheckpointError(f"save: tier must be 'persistent' or 'local', got {tier!r}")
        with collector.paused():
            handle = saving.save(self._save_resources(), target, comm, state, background=background, path=str(path),
                                 info=info, t0=t0, rec=rec, safetensors=groups, optimizers=optimizers,
                                 async_staging=async_staging)
        self.last_save_stats = handle.stats
        return handle

    def warm_up(self, state: Dict[str, Any], *, process_group: Any = _UNSET, background: bool = False):
        """Prepare async saves of `state` ahead of the first one (collective, like save): plan it
        and allocate every staging slot's buffers (page-locked for GPU tensors), so the first
        async save stalls only for its copy, not for the allocation. Call it after the state
        exists in full (e.g. after the first optimizer step, which creates Adam's moments).
        Nothing is copied or written; returns the bytes of staging memory allocated. background=True:
        plans here, allocates on a background thread; returns a Future of the bytes (the adapters')."""
        self._check_open()
        return saving.warm_up(self._save_resources(), self._comm(process_group), state, self.options.timeout_s,
                              background)

    def _save_resources(self) -> saving.SaveResources:
        return saving.SaveResources(self.registry, self.options.fsdp1_route, self.options.threads, self._plans,
                                    self._staging, self._runner, self._pending, lambda: self._closed, self._fence,
                                    self.options.async_staging)

    def load(self, path, state: Dict[str, Any], *, strict: bool = True, allow_pickle: bool = False,
             process_group: Any = _UNSET, storage_options: Any = _UNSET, tier: str = "persistent") -> Dict[str, Any]:
        """Load a checkpoint into `state` in place (collective); returns `state`. tier="local":
        the local checkpoint named `path`, from the parts the current ranks hold."""
        self._check_open()
        comm = self._comm(process_group)
        if tier == "local":
            choice = restoring.local_choice(self._local_tier(), comm, only=local_tier_mod.check_name(path))
            restored = self._restore_local(comm, state, strict, allow_pickle, choice)
            if restored.source is None:
                raise CheckpointError(f"local checkpoint {path!r}: {restored.reason}")
            return state
        if tier != "persistent":
            raise CheckpointError(f"load: tier must be 'persistent' or 'local', got {tier!r}")
        store = self.storage(path, storage_options)
        gate.drain_every(self.options.timeout_s)  # every engine's pending copies land before the live tensors change
        with collector.paused():
            md, stats = self._open_load(comm, store, path, arrive=True)
            md = foreign.fit(md, state)  # another format seen in the form the template asks for
            shared = self._sharing(comm, store)
            with stats.finishing(store, md, self.options.record_stats == "all"), Workers(self.options.threads) as workers:
                loader.load(comm, store, workers, md, state, strict=strict, allow_pickle=allow_pickle, shared=shared,
                            stats=stats, registry=self.registry, fsdp1_route=self.options.fsdp1_route,
                            slabs=self._load_slabs())
        self.last_load_stats = stats
        return state

    def load_full(self, path, *, keys: Optional[Sequence[str]] = None, allow_pickle: bool = False,
                  process_group: Any = _UNSET, storage_options: Any = _UNSET, per_rank: bool = False) -> Any:
        """The saved state without a template (full CPU tensors); `keys`: some top-level keys;
        `per_rank`: a list, each saved rank's state with its own plain values."""
        self._check_open()
        comm = self._comm(process_group)
        store = self.storage(path, storage_options)
        md, stats = self._open_load(comm, store, path, arrive=False)
        with stats.finishing(store, md, self.options.record_stats == "all"), Workers(self.options.threads) as workers:
            state = loader.load_full(comm, store, workers, md, keys=keys, allow_pickle=allow_pickle, stats=stats,
                                     per_rank=per_rank)
        self.last_load_stats = stats
        return state

    # ------------------------------------------------------------------ resuming after a failure
    def restore(self, state: Optional[Dict[str, Any]] = None, *, persistent=None, strict: bool = True,
                allow_pickle: bool = False, process_group: Any = _UNSET, storage_options: Any = _UNSET) -> Restored:
        """Load the newest checkpoint these ranks can restore (collective): the newest local one
        whose every part some current rank holds (own or replica; resharded to this world, no
        read of persistent storage), unless the newest complete checkpoint under (or at)
        `persistent` is newer. Returns what was loaded; source None when there was nothing.
        With no `state` template the whole saved state is returned (`Restored.state`), every
        rank receiving all of it (what framework adapters hand to their own restore code)."""
        self._check_open()
        comm = self._comm(process_group)
        comm.arrive(self.options.timeout_s, "restore")
        local = restoring.local_choice(self._local_tier(), comm) if self._tier is not None else None
        newest = None
        if persistent is not None:
            from .catalog.retention import newest_complete
            newest = comm.run_on_coordinator(
                lambda: newest_complete(self, os.fspath(persistent), storage_options), "finding the newest checkpoint")
        if local is not None and local.name is not None and (newest is None or
                                                             restoring.not_older(local.created, newest[0])):
            return self._restore_local(comm, state, strict, allow_pickle, local)
        why = "no local tier" if local is None else local.why
        if newest is None:
            return Restored(None, None, reason=f"{why}; no complete checkpoint under {persistent!r}")
        if local is not None and local.name is not None:
            why = f"the persistent checkpoint {newest[1]!r} is newer than local {local[0]!r}"
        log.warning("bytecheckpoint: restoring from the persistent checkpoint %s (%s)", newest[1], why)
        if state is None:
            state = top_level_placeholders(self.metadata(newest[1], storage_options=storage_options).structure)
        self.load(newest[1], state, strict=strict, allow_pickle=allow_pickle, process_group=process_group,
                  storage_options=storage_options)
        return Restored("persistent", newest[1], reason=why, state=state)

    def _recorder(self, op: str, comm: Comm, path, t0: Optional[float] = None) -> Recorder:
        return recorder(self.options.record_stats != "off", op, rank=comm.rank, world_size=comm.world_size,
                        path=str(path), t0=t0, sink=self._aside)

    def _open_load(self, comm: Comm, store: Storage, path, arrive: bool):
        """A load's start: every rank's arrival, the metadata (with the load's id: no extra collective)."""
        rec = self._recorder("load", comm, path)
        if arrive:
            with rec.span("arrive"):
                comm.arrive(self.options.timeout_s, f"load of {store.url!r}")
        with rec.span("metadata"):
            md, rec.op_id = comm.run_on_coordinator(lambda: (self._read_metadata(store), new_op_id()),
                                                    "reading checkpoint metadata")
        return md, loader.LoadStats(rec)

    def _restore_local(self, comm: Comm, state: Optional[Dict[str, Any]], strict: bool, allow_pickle: bool,
                       choice: "restoring.LocalChoice") -> Restored:
        gate.drain_every(self.options.timeout_s)
        restored, stats = restoring.restore_local(self._local_tier(), comm, state, choice, strict=strict,
                                                  allow_pickle=allow_pickle, threads=self.options.threads,
                                                  registry=self.registry, fsdp1_route=self.options.fsdp1_route,
                                                  slabs=self._load_slabs())
        if stats is not None:
            self.last_load_stats = stats
        return restored

    def _local_tier(self) -> "local_tier_mod.TierState":
        if self._tier is None:
            raise CheckpointError("this Checkpointer has no local tier; pass Checkpointer(local_tier="
                                  "bcp.LocalTier(dir=...))")
        return self._tier

    # ------------------------------------------------------------------ looking at checkpoints
    def metadata(self, path, *, storage_options: Any = _UNSET) -> Metadata:
        """The checkpoint's global metadata (this process only; cached while unchanged)."""
        self._check_open()
        return self._read_metadata(self.storage(path, storage_options))

    def is_checkpoint(self, path, *, storage_options: Any = _UNSET) -> bool:
        """True only for a committed checkpoint (its metadata file exists and parses)."""
        try:
            self.metadata(path, storage_options=storage_options)
            return True
        except CheckpointError:
            return False

    def inspect(self, path, *, storage_options: Any = _UNSET) -> "inspection.CheckpointInfo":
        self._check_open()
        return inspection.info(self.storage(path, storage_options), self._read_metadata, str(path))

    def stats(self, path, *, load: bool = False, storage_options: Any = _UNSET) -> StatsReport:
        """Every rank's record of the save of `path` (load=True: of its last load): per-phase
        times and the stragglers (this process only; `bytecheckpoint stats`, docs/monitoring.md)."""
        from .catalog.stats import read_stats
        self._check_open()
        self._aside.settle()  # this process's own records still in flight (object stores)
        return read_stats(self.storage(path, storage_options), self._read_metadata, str(path), load=load)

    def verify(self, path, *, storage_options: Any = _UNSET, progress=None) -> "inspection.VerifyReport":
        self._check_open()
        with Workers(self.options.threads) as workers:
            return inspection.verify_store(self.storage(path, storage_options), workers, self._read_metadata,
                                           str(path), progress)

    def delete(self, path, *, storage_options: Any = _UNSET) -> None:
        """Remove a checkpoint: the commit point first, so a half-deleted one never looks valid."""
        self._check_open()
        store = self.storage(path, storage_options)
        for h in self._pending.handles():
            if _same_target(h.path, store.url):
                h.wait()
        inspection.delete_store(store)
        self._metadata.forget(store.url)

    def keep_last(self, directory, k: int, *, storage_options: Any = _UNSET, process_group: Any = _UNSET,
                  dry_run: bool = False, remove_incomplete_older_than_s: Optional[float] = None):
        """Delete all but the newest `k` complete checkpoints under `directory` (see catalog/retention.py)."""
        from .catalog.retention import apply_retention
        self._check_open()
        return apply_retention(self, directory, k, storage_options=storage_options, comm=self._comm(process_group),
                         dry_run=dry_run, remove_incomplete_older_than_s=remove_incomplete_older_than_s)

    def latest(self, directory, *, storage_options: Any = _UNSET) -> Optional[str]:
        """The newest committed checkpoint under `directory`, or None (see bcp.latest)."""
        from .catalog.retention import latest
        self._check_open()
        return latest(self, directory, storage_options)

    def pending_paths(self) -> List[str]:
        """Targets of this instance's async saves that are still running."""
        return self._pending.paths()

    # ------------------------------------------------------------------ lifetime
    def wait(self) -> None:
        """Wait for every pending save of this instance; re-raise the first failure."""
        try:
            self._pending.wait_all()
        finally:
            self._runner.join()
            self._aside.settle()

    def close(self) -> None:
        """Wait for pending saves, then free the staging pool, threads, caches and storages. A
        closed Checkpointer refuses work."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.wait()
        finally:
            self._fence.close()
            self._pending.close()
            if self._pool is not None:
                self._pool.free()
            self._pool = None
            if self._slabs is not None:
                self._slabs.free()
            self._slabs = None
            self._plans.clear()
            self._metadata.clear()
            self._stores.close()
            self._hosts.clear()
            if self._tier is not None:
                self._tier.close()

    @property
    def local_tier(self) -> Optional[LocalTier]:
        """The LocalTier this checkpointer saves `tier="local"` to (None: no local tier)."""
        return self._tier.tier if self._tier is not None else None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._pending.paths())} pending"
        return f"Checkpointer({self.options}, {state})"

    # ------------------------------------------------------------------ resources
    def storage(self, path, storage_options: Any = _UNSET) -> Storage:
        """The storage of a checkpoint root (opened once, reused), with fault rules if any."""
        opts = self.storage_options if storage_options is _UNSET else storage_options
        store = self._stores.get(os.fspath(path), opts)
        return faults.FaultyStorage(store, self.fault_rules) if self.fault_rules else store

    def _staging(self) -> StagingPool:
        with self._lock:
            if self._pool is None:
                self._pool = StagingPool(self.options.staging_slots)
            return self._pool

    def _load_slabs(self) -> Optional[device_reads.PinnedSlabs]:
        """The pinned slabs of loads into device tensors (their memory is taken on first use)."""
        budget = self.options.pinned_load_bytes
        if not budget:
            return None
        with self._lock:
            if self._slabs is None:
                self._slabs = device_reads.PinnedSlabs.for_budget(budget)
            return self._slabs

    def _comm(self, process_group: Any) -> Comm:
        return Comm(self.process_group if process_group is _UNSET else process_group)

    def _read_metadata(self, store: Storage) -> Metadata:
        """The checkpoint's metadata (ours, or a foreign format's read as ours), cached per version."""
        return self._metadata.read(store)

    def _sharing(self, comm: Comm, store: Storage):
        """The zero-redundancy planner of a load, by policy: shared reads where they pay (remote or
        shared storage, several hosts, NCCL), not for ranks of one host re-reading a local page
        cache. True shares every chunk 2+ ranks need whole, "auto" those big enough to pay for their
        broadcast (zero_redundancy.SHARE_MIN_BYTES)."""
        mode = self.options.zero_redundancy
        if not comm.enabled or comm.world_size == 1 or mode is False:
            return zero_redundancy.no_sharing
        if mode is not True and store.scheme == "file" and comm.backend != "nccl":
            if comm.key not in self._hosts:
                self._hosts[comm.key] = comm.hosts()
            if len(set(self._hosts[comm.key])) == 1:
                return zero_redundancy.no_sharing
        return functools.partial(zero_redundancy.plan_shared,
                                 min_bytes=0 if mode is True else zero_redundancy.SHARE_MIN_BYTES)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointerClosedError("this Checkpointer was closed; create a new one (or use bcp.save/load)")


def _same_target(a: str, b: str) -> bool:
    from .storage.specs import split_url
    try:
        return split_url(a) == split_url(b)
    except CheckpointError:
        return a == b


# ---------------------------------------------------------------------- the default instance

_DEFAULT: Optional[Checkpointer] = None
_DEFAULT_LOCK = threading.Lock()


def _groups(paths: Any) -> Tuple[str, ...]:
    """save(safetensors=...): distinct non-empty key paths ("model", "adapter/default")."""
    if isinstance(paths, str) or not all(isinstance(p, str) and p.strip("/") for p in paths):
        raise CheckpointError(f"save: safetensors must be a list of key paths such as ['model'], got {paths!r}")
    return tuple(dict.fromkeys(p.strip("/") for p in paths))


def _rebuild(options: Options, storage_options, process_group, local_tier, fault_rules, registry) -> Checkpointer:
    return Checkpointer(options=options, storage_options=storage_options, process_group=process_group,
                        local_tier=local_tier, fault_rules=fault_rules, registry=registry)


def default_checkpointer() -> Checkpointer:
    """The instance behind bcp.save/load/...: built from the environment on first use."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT.closed:
            _DEFAULT = Checkpointer.from_env()
        return _DEFAULT
