"""The commit step: collect every rank's write result, write metadata.json last (atomically).

Two ways to collect, same decision:
- `collect_by_collective`: sync saves, on the caller's thread, with a gather + broadcast.
- `MarkerBoard`: async saves, in the background, through small marker objects in the
  checkpoint's data directory. No collective ever runs in a background thread, so an async save
  still commits when training tears down its process group right after save() returns.
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..common.errors import CheckpointError, CheckpointExistsError, PeerTimeoutError
from ..collectives.comm import Comm
from ..format import chunk_tables
from ..format.chunk_tables import ChunkTables
from ..format.layout_json import LayoutJSON
from ..format.metadata import (
    CHECKSUM_TABLE_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    ArrayMeta,
    Metadata,
    ObjectFileMeta,
)
from ..monitor import OFF, Recorder
from ..planning.planner import SavePlan
from ..storage import Storage
from ..storage.packs import st_views

# What one rank wrote: its object file and its ChunkTables (and None), or its object file,
# {array: {chunk: block crc32s}} and {array: {chunk: (pack, offset)}}
WriteResult = Tuple[ObjectFileMeta, Any, Optional[Dict[str, Dict[str, Tuple[str, int]]]]]
# (what it wrote, or None) and an error message, or None
RankResult = Tuple[Optional[WriteResult], Optional[str]]


def write_metadata(store: Storage, full: SavePlan, save_id: str, data_dir: str, world_size: int, structure: Any,
                   overwrite: bool, old_data: Optional[str], results: List[RankResult],
                   info: Optional[Dict[str, Any]] = None, before_commit: Optional[Callable[[Metadata], None]] = None
                   ) -> None:
    """Coordinator: commit if every rank succeeded, else raise naming the failed ranks.
    `before_commit(md)` runs once the data is written, before the commit point."""
    table_key = f"{data_dir}/{CHECKSUM_TABLE_FILE}"
    if before_commit is not None:
        before_commit(build_metadata(store.url, full, save_id, data_dir, world_size, structure, results, info))
    raw, table = metadata_files(store.url, full, save_id, data_dir, world_size, structure, results, info, table_key)
    if table is not None:  # large tables beside the data, durable before the commit point names them
        store.put(table_key, table, durable=True)
    if not store.put(METADATA_FILE, raw, if_absent=not overwrite, durable=True):
        store.delete_prefix(data_dir + "/")  # the losing job leaves nothing behind
        raise CheckpointExistsError(f"another job committed a checkpoint to {store.url!r} while this save was "
                                    f"running; this save was discarded and theirs is intact")
    if old_data and old_data != data_dir:
        store.delete_prefix(old_data + "/")


def metadata_files(url: str, full: SavePlan, save_id: str, data_dir: str, world_size: int, structure: Any,
                   results: List[RankResult], info: Optional[Dict[str, Any]], table_key: str
                   ) -> Tuple[bytes, Optional[bytes]]:
    """(metadata.json, checksum table file or None) of a save whose every rank succeeded, else
    raise naming the failed ranks. A plan saved before has its layout serialized already
    (LayoutJSON): only the data directory and the tables are filled in."""
    _raise_failed(url, results)
    layout = LAYOUTS.get(full, structure)
    if layout is not None and not full.safetensors and all(isinstance(res[1], ChunkTables) for res, _ in results):
        # every rank's tables as arrays, placed by index: no per-chunk work here (issue 48)
        try:
            crcs, packs, where = chunk_tables.merge([res[1] for res, _ in results], layout.blocks)
        except ValueError:  # a chunk missing or reported twice: named by the general path below
            pass
        else:
            return layout.render_tables(FORMAT_VERSION, data_dir, crcs, where,
                                        _rest(full, save_id, data_dir, world_size, results, info, packs, {}), table_key)
    checksums, where = _merged(url, results, full)
    if layout is not None:
        packs, index, st_packs = _packs(full, where)
        try:
            return layout.render(FORMAT_VERSION, data_dir, checksums, where, index,
                                 _rest(full, save_id, data_dir, world_size, results, info, packs, st_packs),
                                 table_key)
        except (KeyError, ValueError):  # a chunk without its checksums or location: named below
            pass
    md = build_metadata(url, full, save_id, data_dir, world_size, structure, results, info, (checksums, where))
    return md.to_files(table_key)


def _rest(full: SavePlan, save_id: str, data_dir: str, world_size: int, results: List[RankResult],
          info: Optional[Dict[str, Any]], packs: Tuple[str, ...], st_packs: Dict[str, Tuple[int, ...]]
          ) -> Dict[str, Any]:
    """metadata.json's entries besides the layout and the tables."""
    return {"format": FORMAT_NAME, "save_id": save_id, "world_size": world_size,
            "objects": [_object_entry(res[0]) for res, _ in results],
            "info": _info(full, data_dir, info), "packs": list(packs), "safetensors": st_packs}


def build_metadata(url: str, full: SavePlan, save_id: str, data_dir: str, world_size: int, structure: Any,
                   results: List[RankResult], info: Optional[Dict[str, Any]] = None, merged=None) -> Metadata:
    """The global metadata of a save whose every rank succeeded; else raise naming the failed ranks.
    `info`: more entries for its info object (e.g. the training step and capture time); `merged`:
    the results' tables merged already (_merged)."""
    checksums, where = merged if merged is not None else _merged(url, results, full)
    packs, index, st_packs = _packs(full, where)
    locations = {path: {name: (index[key], off & 0xFFFFFFFF, off >> 32) for name, (key, off) in locs.items()}
                 for path, locs in where.items()}
    md = Metadata(
        version=FORMAT_VERSION, save_id=save_id, world_size=world_size,
        tensors={k: t.rooted(data_dir) for k, t in full.tensors.items()},
        arrays={f"{data_dir}/{p}": rooted(a, data_dir, checksums.get(p, {}), locations.get(p, {}), packs)
                for p, a in full.arrays.items()},
        objects=tuple(res[0] for res, _ in results),
        structure=structure.tree,
        object_owners=dict(structure.object_owners),
        info=_info(full, data_dir, info),
        packs=packs,
        safetensors=st_packs,
    )
    return md


def _packs(full: SavePlan, where: Dict[str, Dict[str, Tuple[str, int]]]
           ) -> Tuple[Tuple[str, ...], Dict[str, int], Dict[str, Tuple[int, ...]]]:
    """The pack files every chunk is in (sorted), their indexes, and each safetensors key path's packs."""
    packs = tuple(sorted({key for locs in where.values() for key, _ in locs.values()}))
    index = {key: i for i, key in enumerate(packs)}
    return packs, index, {g: tuple(sorted(index[k] for k in keys)) for g, keys in st_views(full, where).items()}


def _raise_failed(url: str, results: List[RankResult]) -> None:
    failed = [(r, err) for r, (_, err) in enumerate(results) if err is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:8])
        raise CheckpointError(f"save to {url!r} failed on {len(failed)} rank(s), nothing was committed "
                              f"(a previous checkpoint there is intact): {detail}")


def _merged(url: str, results: List[RankResult], full: SavePlan
            ) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Dict[str, Tuple[str, int]]]]:
    """Every rank's ({array: {chunk: block crc32s}}, {array: {chunk: (pack, offset)}}); raises
    naming the ranks that failed. Ranks' ChunkTables are turned into that form (per-chunk work)."""
    _raise_failed(url, results)
    checksums: Dict[str, Dict[str, Any]] = {}
    where: Dict[str, Dict[str, Tuple[str, int]]] = {}
    for res, _ in results:
        sums, locs = (chunk_tables.as_dicts([res[1]], full.arrays) if isinstance(res[1], ChunkTables)
                      else (res[1], res[2]))
        if len(results) == 1:
            return sums, locs
        for path, s in sums.items():
            checksums.setdefault(path, {}).update(s)
        for path, l in locs.items():
            where.setdefault(path, {}).update(l)
    return checksums, where


def _info(full: SavePlan, data_dir: str, info: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    return {**(info or {}), "data_dir": data_dir, "created_unix": time.time(), "torch": torch.__version__,
            "bytes_per_rank": list(full.bytes_per_rank)}


def _object_entry(o: ObjectFileMeta) -> Dict[str, Any]:
    return {"rank": o.rank, "path": o.path, "nbytes": o.nbytes, "crc32": o.crc32}


class LayoutCache:
    """The serialized layout (LayoutJSON) of the last few save plans, by identity: the plan cache
    hands a repeated save of an unchanged layout the same SavePlan and structure objects. An entry
    goes with its plan (a closed Checkpointer's layouts are not kept: 16384 ranks' is ~0.5 GB)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._entries: List[Tuple[Any, Any, Optional[LayoutJSON]]] = []  # (weakref plan, weakref structure, layout)

    def get(self, full: SavePlan, structure: Any) -> Optional[LayoutJSON]:
        with self._lock:
            for plan_ref, structure_ref, layout in self._entries:
                if plan_ref() is full and structure_ref() is structure:
                    return layout
        from ..storage.chunks import BLOCK_BYTES
        layout = LayoutJSON.build(full.tensors, full.arrays, BLOCK_BYTES, structure.tree, structure.object_owners)
        with self._lock:
            live = [e for e in self._entries if e[0]() is not None and e[1]() is not None]
            self._entries = live[-(self.size - 1):] + [(weakref.ref(full, self._drop_dead),
                                                        weakref.ref(structure, self._drop_dead), layout)]
        return layout

    def _drop_dead(self, _ref: Any) -> None:
        # no lock: this runs wherever the plan happens to be freed (maybe inside get()); one atomic
        # rebinding, at worst racing an insert whose entry is then built again
        self._entries = [e for e in self._entries if e[0]() is not None and e[1]() is not None]


LAYOUTS = LayoutCache()


def rooted(a: ArrayMeta, data_dir: str, checksums: Optional[Dict[str, Any]] = None,
           locations: Optional[Dict[str, Tuple[int, int, int]]] = None, packs: Tuple[str, ...] = ()) -> ArrayMeta:
    """The array under the save's data directory; with the writers' checksums (per-block tuples,
    chunks.BLOCK_BYTES long blocks) and pack locations when given."""
    if checksums is None:
        return ArrayMeta(f"{data_dir}/{a.path}", a.shape, a.chunks, a.dtype, dict(a.checksums), a.block_bytes)
    from ..storage.chunks import BLOCK_BYTES
    return ArrayMeta(f"{data_dir}/{a.path}", a.shape, a.chunks, a.dtype,
                     {k: tuple(v) for k, v in checksums.items()}, BLOCK_BYTES, dict(locations or {}), packs)


def collect_by_collective(comm: Comm, local: RankResult, decide, rec: Recorder = OFF) -> None:
    t0 = time.perf_counter()
    results = comm.gather(local)
    t1 = time.perf_counter()
    rec.add("commit.wait", t0, t1)
    decided: List[float] = []

    def run() -> None:
        try:
            decide(results)
        finally:
            decided.append(time.perf_counter())
    try:
        comm.run_on_coordinator(run, "committing the checkpoint")
    finally:  # the coordinator's commit.metadata is its own phase: the outcome starts after it
        rec.add("commit.outcome", decided[0] if decided else t1, time.perf_counter())


class MarkerBoard:
    """Rank results and the commit outcome as small JSON objects under `<data_dir>/commit/`.

    While its background job runs, each rank also beats a heartbeat object there. A rank waiting
    for a peer's marker gives up when that peer's heartbeat has not changed for `dead_peer_s`
    (it died: detected in about that time, not after the whole timeout) or after `timeout_s`."""

    def __init__(self, store: Storage, data_dir: str, world_size: int, rank: int, timeout_s: float,
                 dead_peer_s: float):
        self.store, self.prefix, self.world, self.rank = store, f"{data_dir}/commit/", world_size, rank
        self.timeout_s, self.dead_peer_s = timeout_s, dead_peer_s

    # ------------------------------------------------------------ liveness
    def heartbeat(self) -> "Heartbeat":
        return Heartbeat(self.store, f"{self.prefix}alive_{self.rank}", max(0.5, self.dead_peer_s / 6))

    # ------------------------------------------------------------ results
    def publish(self, result: RankResult) -> None:
        res, err = result
        body = {"error": err}
        if res is not None and isinstance(res[1], ChunkTables):
            body.update(object=asdict(res[0]), tables=res[1].to_json())
        elif res is not None:
            body.update(object=asdict(res[0]), checksums=res[1], locations=res[2])
        self.store.put(f"{self.prefix}rank_{self.rank}.json", json.dumps(body).encode())

    def collect(self) -> List[RankResult]:
        names = [f"{self.prefix}rank_{r}.json" for r in range(self.world)]

        def missing() -> List[int]:
            have = set(self.store.list(self.prefix))
            return [r for r, n in enumerate(names) if n not in have]
        self._wait(missing)
        out: List[RankResult] = []
        for name in names:
            body = json.loads(self.store.get(name) or b"{}")
            if body.get("error") is not None or "object" not in body:
                out.append((None, body.get("error") or "no result"))
            elif "tables" in body:
                out.append(((ObjectFileMeta(**body["object"]), ChunkTables.from_json(body["tables"]), None), None))
            else:
                locations = {p: {n: (k, int(o)) for n, (k, o) in locs.items()}
                             for p, locs in body.get("locations", {}).items()}
                out.append(((ObjectFileMeta(**body["object"]), body["checksums"], locations), None))
        return out

    def announce(self, error: Optional[BaseException]) -> None:
        body = {"ok": error is None, "error": None if error is None else f"{type(error).__name__}: {error}"}
        self.store.put(f"{self.prefix}outcome.json", json.dumps(body).encode())

    def outcome(self) -> None:
        key = f"{self.prefix}outcome.json"
        self._wait(lambda: [] if self.store.get(key) is not None else [0])
        body = json.loads(self.store.get(key))
        if not body.get("ok"):
            raise CheckpointError(f"async save to {self.store.url!r} was not committed: {body.get('error')}")

    def _wait(self, missing: Callable[[], List[int]]) -> None:
        """Poll until `missing()` is empty; fail on a dead peer or at the overall timeout."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        seen: Dict[int, Tuple[Optional[bytes], float]] = {}  # rank -> (last beat, when it changed)
        delay, next_beat_check = 0.002, start + 1.0
        while True:
            waiting = missing()
            if not waiting:
                return
            now = time.monotonic()
            if now > deadline:
                raise PeerTimeoutError(
                    f"async save to {self.store.url!r}: gave up after {self.timeout_s:g} s waiting for "
                    f"{_who(waiting)} (stuck); nothing was committed (Checkpointer(timeout_s=...) sets the limit)")
            if now >= next_beat_check:
                next_beat_check = now + 1.0
                for r in waiting:
                    beat = self.store.get(f"{self.prefix}alive_{r}")
                    last, since = seen.get(r, (None, start))
                    if beat != last or r not in seen:
                        seen[r] = (beat, now if beat != last else since)
                    elif now - since > self.dead_peer_s:
                        raise PeerTimeoutError(
                            f"async save to {self.store.url!r}: {_who([r])} stopped responding (no heartbeat for "
                            f"{now - since:.0f} s): it died or hangs; nothing was committed and the previous "
                            f"checkpoint is intact")
            time.sleep(delay)
            delay = min(0.05, delay * 2)


def _who(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks[:16])) + (
        " ..." if len(ranks) > 16 else "")


class Heartbeat:
    """A thread that rewrites one small object every `interval` seconds while a job runs."""

    def __init__(self, store: Storage, key: str, interval: float):
        self.store, self.key, self.interval = store, key, interval
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Heartbeat":
        """The first beat is written by the thread (not the caller: it is on an async save's stall;
        peers look at beats only after waiting a second for a marker)."""
        self._thread = threading.Thread(target=self._run, name="bytecheckpoint-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        self._beat(0)
        n = 1
        while not self._stop.wait(self.interval):
            self._beat(n)
            n += 1

    def _beat(self, n: int) -> None:
        try:
            self.store.put(self.key, str(n).encode())
        except Exception:  # noqa: BLE001 - a missed beat only makes peers wait longer; the job reports storage errors
            pass
