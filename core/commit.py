"""The commit step: collect every rank's write result, write metadata.json last (atomically).

Two ways to collect, same decision:
- `collect_by_collective`: sync saves, on the caller's thread, with a gather + broadcast.
- `MarkerBoard`: async saves, in the background, through small marker objects in the
  checkpoint's data directory. No collective ever runs in a background thread, so an async save
  still commits when training tears down its process group right after save() returns.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Tuple

import torch

from .comm import Comm
from .config import TUNABLES
from .errors import CheckpointError, CheckpointExistsError
from .metadata import FORMAT_VERSION, METADATA_FILE, ArrayMeta, Metadata, ObjectFileMeta, RegionMeta, TensorMeta
from .planner import SavePlan
from .storage import Store

# (object file entry, {array path: {chunk name: crc32}}) or None, and an error message or None
RankResult = Tuple[Optional[Tuple[ObjectFileMeta, Dict[str, Dict[str, int]]]], Optional[str]]


def write_metadata(store: Store, full: SavePlan, save_id: str, data_dir: str, world_size: int, structure: Any,
                   overwrite: bool, old_data: Optional[str], results: List[RankResult]) -> None:
    """Coordinator: commit if every rank succeeded, else raise naming the failed ranks."""
    failed = [(r, err) for r, (_, err) in enumerate(results) if err is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:8])
        raise CheckpointError(f"save to {store.url!r} failed on {len(failed)} rank(s), nothing was committed "
                              f"(a previous checkpoint there is intact): {detail}")
    checksums: Dict[str, Dict[str, int]] = {}
    for res, _ in results:
        for path, sums in res[1].items():
            checksums.setdefault(path, {}).update(sums)
    md = Metadata(
        version=FORMAT_VERSION, save_id=save_id, world_size=world_size,
        tensors={k: TensorMeta(t.key, t.dtype, t.shape, t.layout, t.holders,
                               tuple(RegionMeta(r.offsets, r.lengths, f"{data_dir}/{r.array}", r.array_offsets,
                                                r.writer) for r in t.regions))
                 for k, t in full.tensors.items()},
        arrays={f"{data_dir}/{p}": rooted(a, data_dir, checksums.get(p)) for p, a in full.arrays.items()},
        objects=tuple(res[0] for res, _ in results),
        structure=structure,
        info={"data_dir": data_dir, "created_unix": time.time(), "torch": torch.__version__,
              "bytes_per_rank": list(full.bytes_per_rank)},
    )
    if not store.write_bytes(METADATA_FILE, md.to_json(), only_if_absent=not overwrite, durable=True):
        store.delete_prefix(data_dir + "/")  # the losing job leaves nothing behind
        raise CheckpointExistsError(f"another job committed a checkpoint to {store.url!r} while this save was "
                                    f"running; this save was discarded and theirs is intact")
    if old_data and old_data != data_dir:
        store.delete_prefix(old_data + "/")


def rooted(a: ArrayMeta, data_dir: str, checksums: Optional[Dict[str, int]] = None) -> ArrayMeta:
    return ArrayMeta(f"{data_dir}/{a.path}", a.shape, a.chunks, a.dtype, dict(checksums or a.checksums))


def collect_by_collective(comm: Comm, local: RankResult, decide) -> None:
    results = comm.gather(local)
    comm.run_on_coordinator(lambda: decide(results), "committing the checkpoint")


class MarkerBoard:
    """Rank results and the commit outcome as small JSON objects under `<data_dir>/commit/`."""

    def __init__(self, store: Store, data_dir: str, world_size: int, rank: int):
        self.store, self.prefix, self.world, self.rank = store, f"{data_dir}/commit/", world_size, rank

    def publish(self, result: RankResult) -> None:
        res, err = result
        body = {"error": err}
        if res is not None:
            body.update(object=asdict(res[0]), checksums=res[1])
        self.store.write_bytes(f"{self.prefix}rank_{self.rank}.json", json.dumps(body).encode())

    def collect(self) -> List[RankResult]:
        names = [f"{self.prefix}rank_{r}.json" for r in range(self.world)]
        present = self._wait(lambda: set(self.store.list(self.prefix)) >= set(names),
                             lambda: sorted(set(range(self.world)) - {int(k.rsplit("_", 1)[1].split(".")[0])
                                                                      for k in self.store.list(self.prefix)
                                                                      if k.startswith(self.prefix + "rank_")}))
        del present
        out: List[RankResult] = []
        for name in names:
            body = json.loads(self.store.read_bytes(name) or b"{}")
            if body.get("error") is not None or "object" not in body:
                out.append((None, body.get("error") or "no result"))
            else:
                out.append(((ObjectFileMeta(**body["object"]), body["checksums"]), None))
        return out

    def announce(self, error: Optional[BaseException]) -> None:
        body = {"ok": error is None, "error": None if error is None else f"{type(error).__name__}: {error}"}
        self.store.write_bytes(f"{self.prefix}outcome.json", json.dumps(body).encode())

    def outcome(self) -> None:
        key = f"{self.prefix}outcome.json"
        self._wait(lambda: self.store.read_bytes(key) is not None, lambda: ["the coordinator (rank 0)"])
        body = json.loads(self.store.read_bytes(key))
        if not body.get("ok"):
            raise CheckpointError(f"async save to {self.store.url!r} was not committed: {body.get('error')}")

    def _wait(self, ready, missing) -> bool:
        deadline = time.monotonic() + TUNABLES.collective_timeout_s
        delay = 0.002
        while not ready():
            if time.monotonic() > deadline:
                raise CheckpointError(f"async save to {self.store.url!r}: gave up after "
                                      f"{TUNABLES.collective_timeout_s}s waiting for {missing()} (a rank died or "
                                      f"is stuck); nothing was committed (BCP_COLLECTIVE_TIMEOUT_S sets the limit)")
            time.sleep(delay)
            delay = min(0.05, delay * 2)
        return True
