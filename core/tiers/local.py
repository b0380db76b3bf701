"""The local tier: frequent checkpoints in node-local storage, each rank's part copied to ranks on
other nodes, restorable by the survivors of a lost node on fewer ranks (resharded) without any
read of the persistent storage.

Layout, on every node: `<dir>/bcp-local/<job>/<name>/` holds `part-<save id>/...` (chunks in the
same zarr v3 layout as a persistent checkpoint, for the parts this node holds: its ranks' own and
the replicas it received), every rank's plain-value file, one `held/rank_<r>` marker per part held,
and `local-metadata.json` (the global metadata, written on each node after every rank reported its
part and its replicas written: the node's commit point). Nothing there is named `metadata.json` or
`data-*`, so no local checkpoint can be taken for a persistent one.

Transfers and the commit run on a gloo process group of the tier's own (created once, collectively),
so a background save never shares a communicator with training. See docs/local_tier.md.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..common import dtypes, torch_compat
from ..common.errors import CheckpointError, PeerTimeoutError
from ..collectives.comm import LOCAL, Comm
from ..collectives.liveness import PeerWatch
from ..collectives.zero_redundancy import SharedPlan
from ..format.metadata import Metadata, dtype_itemsize, order_key
from ..pipeline import commit
from ..pipeline.save_plan import new_save_id
from ..pipeline.workers import Workers
from ..pipeline.write import Written, write_local
from ..planning.planner import LocalPlan
from ..storage import chunks
from ..storage.posix import PosixStorage

log = logging.getLogger("bytecheckpoint")

ROOT = "bcp-local"
LOCAL_METADATA = "local-metadata.json"
PART_PREFIX = "part-"


@dataclass(frozen=True)
class LocalTier:
    """Where and how a Checkpointer keeps local checkpoints.

    dir: node-local directory (e.g. "/dev/shm/bcp" or a local NVMe path); "{node}" in it is
        replaced by the node id (several simulated nodes on one machine).
    replicas: copies of each rank's part kept on ranks of *other* nodes (1 survives any one node).
    keep: local checkpoints kept per node (older ones are pruned after each commit).
    node: rank (in the process group) -> node id; default: the host name (ranks sharing a host
        share a node).
    job: a namespace under dir, so that several jobs can share it.
    """
    dir: str
    replicas: int = 1
    keep: int = 2
    node: Optional[Callable[[int], Hashable]] = None
    job: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir:
            raise CheckpointError(f"LocalTier: dir must be a local directory path, got {self.dir!r}")
        if "://" in self.dir and not self.dir.startswith("file://"):
            raise CheckpointError(f"LocalTier: dir must be node-local storage, not {self.dir!r}")
        if not isinstance(self.replicas, int) or self.replicas < 0:
            raise CheckpointError(f"LocalTier: replicas must be an integer >= 0, got {self.replicas!r}")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise CheckpointError(f"LocalTier: keep must be an integer >= 1, got {self.keep!r}")
        if not isinstance(self.job, str) or not self.job or "/" in self.job:
            raise CheckpointError(f"LocalTier: job must be a name without '/', got {self.job!r}")

    def node_dir(self, node: Hashable) -> str:
        path = self.dir[len("file://"):] if self.dir.startswith("file://") else self.dir
        return os.path.abspath(path.format(node=node) if "{node}" in path else path)

    def root(self, node: Hashable) -> str:
        return os.path.join(self.node_dir(node), ROOT, self.job)


@dataclass(frozen=True)
class Restored:
    """What restore() loaded: source is "local", "persistent" or None (nothing to restore);
    `state` is the state loaded into (the whole saved state when restore() got no template)."""
    source: Optional[str]
    name: Optional[str]
    save_id: Optional[str] = None
    reason: str = ""
    state: Any = None


# ---------------------------------------------------------------------- placement (pure)

def replica_targets(nodes: Sequence[Hashable], replicas: int) -> List[List[int]]:
    """For each rank, the ranks on other nodes that keep a copy of its part.

    Rank r, the i-th rank of node n (nodes in order of first appearance), is copied to the
    (i mod size)-th rank of nodes n+1 .. n+replicas (cyclically); never to its own node, never
    more copies than there are other nodes."""
    order: List[Hashable] = list(dict.fromkeys(nodes))
    members: Dict[Hashable, List[int]] = defaultdict(list)
    for r, n in enumerate(nodes):
        members[n].append(r)
    out: List[List[int]] = []
    for r, n in enumerate(nodes):
        i, k = members[n].index(r), order.index(n)
        targets = []
        for step in range(1, min(replicas, len(order) - 1) + 1):
            other = members[order[(k + step) % len(order)]]
            targets.append(other[i % len(other)])
        out.append(targets)
    return out


def choose(candidates: Sequence[Sequence[Tuple[str, str, float, int, Sequence[int]]]]) -> Optional[Tuple[str, str]]:
    """The newest local checkpoint whose every part is held by some current rank.

    candidates[r] lists (name, save_id, order key (format/metadata.order_key), world size at save, parts held
    on r's node)."""
    held: Dict[Tuple[str, str], set] = defaultdict(set)
    info: Dict[Tuple[str, str], Tuple[float, int]] = {}
    for per_rank in candidates:
        for name, save_id, created, world, parts in per_rank:
            held[(name, save_id)].update(parts)
            info[(name, save_id)] = (created, world)
    complete = [(info[k][0], k) for k, parts in held.items() if parts >= set(range(info[k][1]))]
    return max(complete)[1] if complete else None


# ---------------------------------------------------------------------- per-Checkpointer state

class TierState:
    """The tier of one Checkpointer: its config, node ids, and per process group a gloo group
    for the tier's background transfers with a heartbeat watch that bounds every wait on it."""

    def __init__(self, tier: LocalTier, timeout_s: float, dead_peer_s: float):
        self.tier, self.timeout_s, self.dead_peer_s = tier, timeout_s, dead_peer_s
        self._comms: Dict[Any, Comm] = {}
        self._broken: Dict[Any, str] = {}
        self._nodes: Dict[Any, List[Hashable]] = {}

    def nodes(self, comm: Comm) -> List[Hashable]:
        """Collective on first use per group: the node id of every rank."""
        if comm.key not in self._nodes:
            if self.tier.node is not None:
                self._nodes[comm.key] = [self.tier.node(r) for r in range(comm.world_size)]
            else:
                self._nodes[comm.key] = comm.hosts()
        return self._nodes[comm.key]

    def comm(self, comm: Comm) -> Comm:
        """Collective on first use per group: the tier's own gloo group, its collectives bounded by
        every rank's heartbeat (liveness.PeerWatch in the c10d store) and by timeout_s."""
        if not comm.enabled:
            return Comm(LOCAL)
        if comm.key in self._broken:
            raise CheckpointError(f"the local tier's process group failed in an earlier save "
                                  f"({self._broken[comm.key]}); restart the job to use the local tier again")
        if comm.key not in self._comms:
            ranks = dist.get_process_group_ranks(comm.group) if comm.group is not None else list(
                range(comm.world_size))
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
            name = getattr(group, "group_name", None) or str(len(self._comms))
            watch = PeerWatch(torch_compat.default_store(), f"bytecheckpoint/tier/{self.tier.job}/{name}", comm.rank,
                              ranks, self.dead_peer_s)
            self._comms[comm.key] = Comm(group, watch=watch, timeout_s=self.timeout_s)
        return self._comms[comm.key]

    def mark_broken(self, comm: Comm, why: str) -> None:
        """A tier collective failed (a dead peer): its gloo group may hold a stuck operation."""
        self._broken[comm.key] = why

    def storage(self, comm: Comm, name: str) -> PosixStorage:
        node = self.nodes(comm)[comm.rank]
        root = os.path.join(self.tier.root(node), name)
        return PosixStorage(f"local tier {root}", root + "/")

    def close(self) -> None:
        for c in self._comms.values():
            if c.group is None:
                continue
            try:
                dist.destroy_process_group(c.group)
            except (RuntimeError, ValueError):  # the default group may already be gone
                pass
        self._comms.clear()


def check_name(name: str) -> str:
    name = os.fspath(name)
    if not name or "/" in name or name in (".", "..") or name.startswith("."):
        raise CheckpointError(f"local checkpoint name {name!r} must be a plain name such as 'step_1200'")
    return name


# ---------------------------------------------------------------------- saving

@dataclass
class LocalJob:
    """Write this rank's part to its node, copy parts to/from replica ranks, commit on every node."""
    tier: TierState
    comm: Comm                 # the training group (ranks, node ids)
    tier_comm: Comm            # the tier's gloo group (transfers, commit), bounded by heartbeats
    name: str
    local: LocalPlan
    full: Any                  # SavePlan on the coordinator
    save_id: str
    structure: Any
    objects_blob: bytes
    info: Optional[Dict[str, Any]] = None   # extra metadata info (training step, capture time)

    @property
    def data_dir(self) -> str:
        return PART_PREFIX + self.save_id

    def run(self, workers: Workers, data: Sequence[torch.Tensor]) -> None:
        """Every rank of the group runs it (on a background thread for an async save). Each wait
        on a peer is bounded: a dead rank is named within the checkpointer's dead_peer_s."""
        watch = self.tier_comm.watch
        if watch is not None:
            watch.hold()  # usually held since save() already (heartbeat()); nested holds are counted
        try:
            self._run(workers, data)
        except PeerTimeoutError as exc:
            self.tier.mark_broken(self.comm, str(exc))
            raise
        finally:
            if watch is not None:
                watch.release()

    def heartbeat(self) -> Optional["_Holding"]:
        """Start this rank's heartbeat now (save() calls it before the job waits for its turn);
        the returned object's stop() ends it."""
        return _Holding(self.tier_comm.watch) if self.tier_comm.watch is not None else None

    def _run(self, workers: Workers, data: Sequence[torch.Tensor]) -> None:
        comm, tc, rank, world = self.comm, self.tier_comm, self.comm.rank, self.comm.world_size
        store = self.tier.storage(comm, self.name)
        nodes = self.tier.nodes(comm)
        targets = replica_targets(nodes, self.tier.tier.replicas)
        own = _attempt(lambda: write_local(store, workers, self.data_dir, self.local, data,
                                                  self.objects_blob, rank))
        # 1. every rank's plan and values (small), and whether its own part was written
        infos = tc.all_gather((self.local, self.objects_blob, own[1]))
        _raise_failures(f"local save {self.name!r}", [i[2] for i in infos])
        # 2. parts to the ranks on other nodes that keep a copy (one transfer per tensor)
        sources = [s for s in range(world) if rank in targets[s]]
        received = {s: [torch.empty(w.lengths, dtype=dtypes.to_torch(infos[s][0].arrays[w.array].dtype))
                        for w in infos[s][0].writes] for s in sources}
        tc.exchange([(dst, _bytes_of(t)) for dst in targets[rank] for t in data],
                    [(src, _bytes_of(b)) for src in sources for b in received[src]])
        copied = _attempt(lambda: [write_local(store, workers, self.data_dir, infos[s][0], received[s],
                                                     infos[s][1], s) for s in sources])
        # 3. commit: the coordinator builds the metadata from every rank's result; each node writes it
        status = None if copied[1] is None else f"writing replicas: {copied[1]}"
        results = tc.all_gather((own[0], status))
        payload = None
        if rank == 0:
            payload = _attempt(lambda: self._metadata([(r, None) for r, _ in results], [s for _, s in results],
                                                      nodes, targets))
        payload = tc.broadcast(payload, src=0)
        if payload[1] is not None:
            raise CheckpointError(payload[1])
        self._commit_on_node(store, nodes, targets, [i[1] for i in infos], payload[0], sources)
        tc.barrier()
        if _node_leader(nodes, rank):
            prune(self.tier.tier.root(nodes[rank]), keep=self.tier.tier.keep, current=self.name)

    def _metadata(self, results, statuses, nodes, targets) -> bytes:
        failed = [f"rank {r}: {s}" for r, s in enumerate(statuses) if s]
        if failed:
            raise CheckpointError(f"local save {self.name!r} failed: {'; '.join(failed[:8])}; nothing was committed")
        md = commit.build_metadata(f"local tier {self.name}", self.full, self.save_id, self.data_dir,
                                   self.comm.world_size, self.structure, results, self.info)
        holders = {r: [r] + list(targets[r]) for r in range(self.comm.world_size)}
        md = dataclasses.replace(md, info={**md.info, "local": {
            "name": self.name, "holders": {str(r): h for r, h in holders.items()},
            "nodes": [str(n) for n in nodes]}})
        return md.to_json()

    def _commit_on_node(self, store: PosixStorage, nodes, targets, blobs: List[bytes], metadata: bytes,
                        sources: List[int]) -> None:
        rank = self.comm.rank
        for part in [rank] + sources:
            store.put(f"{self.data_dir}/held/rank_{part}", b"")
        if _node_leader(nodes, rank):
            for r, blob in enumerate(blobs):  # every rank's plain values on every node (they are small)
                key = f"{self.data_dir}/objects/rank_{r}.json"
                if store.get(key) is None:
                    store.put(key, blob)
            store.sync()
            store.put(LOCAL_METADATA, metadata, durable=True)


class LocalTarget:
    """A save into the local tier under `name` (pipeline/save.py drives it)."""

    def __init__(self, tier: TierState, name: str, timeout_s: float) -> None:
        self.tier, self.name, self.timeout_s = tier, check_name(name), timeout_s
        self.tier_comm: Optional[Comm] = None

    def open(self, comm: Comm) -> None:
        comm.arrive(self.timeout_s, f"local save {self.name!r}")
        self.tier_comm = self.tier.comm(comm)  # collective on first use, so in the foreground
        self.tier.nodes(comm)

    def begin(self) -> Tuple[str, Optional[str]]:
        return new_save_id(), None

    def writer(self, comm: Comm, local: LocalPlan, full: Any, save_id: str, old_data: Optional[str], structure: Any,
               objects_blob: bytes, info: Dict[str, Any]) -> Written:
        job = LocalJob(self.tier, comm, self.tier_comm, self.name, local, full, save_id, structure, objects_blob, info)
        return Written(job.run, lambda: (job.run, job.heartbeat))


class _Holding:
    """A hold on a PeerWatch's heartbeat, released by stop() (the shape the async runner expects)."""

    def __init__(self, watch: PeerWatch):
        self.watch = watch
        watch.hold()

    def stop(self) -> None:
        self.watch.release()


def _node_leader(nodes: Sequence[Hashable], rank: int) -> bool:
    return list(nodes).index(nodes[rank]) == rank


def _attempt(fn) -> Tuple[Any, Optional[str]]:
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - reported to every rank through the tier's collectives
        return None, f"{type(exc).__name__}: {exc}"


def _raise_failures(what: str, errors: Sequence[Optional[str]]) -> None:
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"{what} failed: {'; '.join(failed[:8])}; nothing was committed")


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def prune(root: str, keep: int, current: Optional[str] = None) -> List[str]:
    """Delete all but the newest `keep` committed local checkpoints under `root` (never `current`),
    and uncommitted leftovers of failed saves. Returns the names removed."""
    if not os.path.isdir(root):
        return []
    committed, leftovers = [], []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or name == current:
            continue
        meta = os.path.join(path, LOCAL_METADATA)
        if os.path.isfile(meta):
            committed.append((_order(meta), name))
        else:
            leftovers.append(name)
    committed.sort(reverse=True)
    keep_others = max(0, keep - (1 if current else 0))
    removed = [n for _, n in committed[keep_others:]] + leftovers
    for name in removed:
        path = os.path.join(root, name)
        meta = os.path.join(path, LOCAL_METADATA)
        if os.path.exists(meta):
            os.unlink(meta)  # the commit point first: a half-deleted one is never taken for complete
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _order(meta_path: str) -> Tuple[int, float]:
    try:
        with open(meta_path, "rb") as f:
            return order_key(json.loads(f.read()).get("info", {}))
    except (OSError, ValueError, TypeError, AttributeError):
        return (-1, 0.0)


# ---------------------------------------------------------------------- restoring

def held_here(tier: LocalTier, node: Hashable) -> List[Tuple[str, str, float, int, List[int]]]:
    """The committed local checkpoints in this node's directory and the parts each holds."""
    root = tier.root(node)
    out = []
    if not os.path.isdir(root):
        return out
    for name in sorted(os.listdir(root)):
        meta = os.path.join(root, name, LOCAL_METADATA)
        if not os.path.isfile(meta):
            continue
        try:
            with open(meta, "rb") as f:
                md = Metadata.from_json(f.read(), meta)
        except CheckpointError as exc:
            log.warning("bytecheckpoint: ignoring unreadable local checkpoint %s: %s", meta, exc)
            continue
        held_dir = os.path.join(root, name, md.info.get("data_dir", ""), "held")
        parts = sorted(int(p.split("_")[1]) for p in os.listdir(held_dir)) if os.path.isdir(held_dir) else []
        out.append((name, md.save_id, order_key(md.info), md.world_size, parts))
    return out


def read_local_metadata(store: PosixStorage) -> Metadata:
    raw = store.get(LOCAL_METADATA)
    if raw is None:
        raise CheckpointError(f"{store.url}: no committed local checkpoint here")
    return Metadata.from_json(raw, f"{store.url}/{LOCAL_METADATA}")


def part_of(md: Metadata) -> Callable[[Tuple[str, Tuple[int, ...]]], int]:
    """(array, chunk index) -> the rank whose part holds it (the region's writer)."""
    by_array: Dict[str, List[Tuple[Tuple[int, ...], Tuple[int, ...], int]]] = defaultdict(list)
    for t in md.tensors.values():
        for r in t.regions:
            by_array[r.array].append((r.array_offsets, r.lengths, r.writer))

    def find(ref: Tuple[str, Tuple[int, ...]]) -> int:
        array, index = ref
        meta = md.arrays[array]
        origin = tuple(i * c for i, c in zip(index, meta.chunks))
        for offs, lens, writer in by_array[array]:
            if all(o <= x < o + n for o, n, x in zip(offs, lens, origin)):
                return writer
        if not origin and by_array[array]:  # 0-d arrays
            return by_array[array][0][2]
        raise CheckpointError(f"local checkpoint: no saved region holds chunk {index} of {array!r}")
    return find


def holder_planner(held: Sequence[Sequence[int]]):
    """A shared-read planner for loader.load: chunks of parts this rank's node does not hold are
    read by a rank that holds them (balanced) and broadcast; everything else is read locally."""
    def plan(comm: Comm, md: Metadata, needs: Dict[Any, Any]) -> SharedPlan:
        owner = part_of(md)
        mine = set(held[comm.rank])
        missing = [ref for ref in needs if owner(ref) not in mine]
        requests = comm.all_gather(missing)
        sizes = {q: chunks.chunk_nbytes(md.arrays[q[0]], dtype_itemsize(md.arrays[q[0]].dtype))
                 for qs in requests for q in qs}
        load = [0] * comm.world_size
        by_reader: Dict[int, List[Any]] = defaultdict(list)
        for q in sorted(sizes, key=lambda q: (-sizes[q], q)):
            part = owner(q)
            readers = [r for r in range(comm.world_size) if part in held[r]]
            if not readers:
                raise CheckpointError(f"internal: no current rank holds part {part}")
            reader = min(readers, key=lambda r: (load[r], r))
            load[reader] += sizes[q]
            by_reader[reader].append(q)
        return SharedPlan(by_reader=dict(by_reader), sizes=sizes)
    return plan
