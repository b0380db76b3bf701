"""Reading every rank's record of a checkpoint's save (or of its last load) from storage, for
`bytecheckpoint stats` and `Checkpointer.stats` (the analysis is monitor/report.py's).

Records live beside the data, never part of the commit (docs/format.md "stats/"):
    <root>/data-<save id>/stats/save/rank_<r>.json    rank r's record of the save
    <root>/data-<save id>/stats/load/rank_<r>.json    rank r's record of the last load
A missing or damaged record is reported, never an error of the checkpoint.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from ..common.errors import CheckpointError, IncompleteCheckpointError
from ..format.metadata import Metadata
from ..monitor import StatsReport, analyze, parse_record, record_key
from ..pipeline.workers import Workers
from ..pipeline.write import DATA_PREFIX
from ..storage import Storage

READERS = 16


def read_stats(store: Storage, read_metadata: Callable[[Storage], Metadata], path: str, *, load: bool = False
               ) -> StatsReport:
    """The report of the save at `path` (load=True: of the last load of it). A root without
    metadata.json (a failed or running save) is reported from the newest data directory's
    records, marked not committed. Raises CheckpointError when there is nothing to report."""
    op = "load" if load else "save"
    committed, world, save_id = True, 0, ""
    try:
        md = read_metadata(store)
        data_dir, world, save_id = md.info.get("data_dir"), md.world_size, md.save_id
    except IncompleteCheckpointError:
        if load:
            raise
        data_dir, committed = _newest_data_dir(store), False
        save_id = data_dir[len(DATA_PREFIX):] if data_dir else ""
    if not isinstance(data_dir, str) or not data_dir:
        raise CheckpointError(f"{store.url!r}: no {op} records (saved by a bytecheckpoint without them)")
    records, damaged = _read(store, data_dir, op, world)
    if not records and not damaged:
        why = ("not loaded since with record_stats='all' (the default), or loaded from a read-only store" if load
               else "saved with record_stats='off', by a bytecheckpoint without records, or the store refused them")
        raise CheckpointError(f"{store.url!r}: no {op} records ({why})")
    stale: List[Tuple[str, List[int]]] = []
    op_id = save_id
    if load:
        records, stale, op_id = _newest_load(records)
        world = max((rec["world_size"] for rec in records.values()), default=world)
    elif not committed:
        world = max((rec["world_size"] for rec in records.values()), default=1)
    return analyze(records, world, path=path, op=op, op_id=op_id, damaged=damaged, stale=stale,
                   committed=committed)


def _newest_data_dir(store: Storage) -> Optional[str]:
    """The newest data directory holding save records (save ids start with their UTC time)."""
    dirs = {k.split("/", 1)[0] for k in store.list(DATA_PREFIX) if "/stats/save/" in k}
    return max(dirs) if dirs else None


def _read(store: Storage, data_dir: str, op: str, world: int) -> Tuple[Dict[int, dict], Dict[int, str]]:
    prefix = f"{data_dir}/stats/{op}/"
    keys = [k for k in store.list(prefix) if k.endswith(".json")]
    if not keys and store.read_only:  # a web server has no listing: ask for each rank's record
        keys = [record_key(data_dir, op, r) for r in range(world)]
    ranks = {}
    for k in keys:
        name = k[len(prefix):]
        if name.startswith("rank_") and name[5:-5].isdigit():
            ranks[int(name[5:-5])] = k
    records: Dict[int, dict] = {}
    damaged: Dict[int, str] = {}

    def fetch(rank: int, key: str):
        try:
            raw = store.get(key)
        except CheckpointError as exc:
            return rank, None, f"unreadable ({exc})"
        if raw is None:
            return rank, None, None
        try:
            rec = parse_record(raw)
        except ValueError as exc:
            return rank, None, str(exc)
        if rec["rank"] != rank:
            return rank, None, f"names rank {rec['rank']}"
        return rank, rec, None
    with Workers(min(READERS, len(ranks)), "bytecheckpoint-stats") as workers:
        for rank, rec, problem in workers.map(fetch, sorted(ranks.items())):
            if rec is not None:
                records[rank] = rec
            elif problem is not None:
                damaged[rank] = problem
    return records, damaged


def _newest_load(records: Dict[int, dict]) -> Tuple[Dict[int, dict], List[Tuple[str, List[int]]], str]:
    """Load records of several loads (each rank's file is replaced by its next load; a smaller
    world leaves the higher ranks' older ones): the newest load's, and the others as stale."""
    by_id: Dict[str, Dict[int, dict]] = {}
    for r, rec in records.items():
        by_id.setdefault(rec["op_id"], {})[r] = rec
    newest = max(by_id, key=lambda i: (max(rec["start_unix"] for rec in by_id[i].values()), i)) if by_id else ""
    stale = [(i, sorted(rs)) for i, rs in sorted(by_id.items()) if i != newest]
    return by_id.get(newest, {}), stale, newest
