"""Looking at and removing checkpoints: inspect (metadata only), verify (every byte), delete."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..common.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from ..format.metadata import METADATA_FILE, Metadata
from ..geometry.regions import find_layout_problem
from ..storage import Storage, chunks

ReadMetadata = Callable[[Storage], Metadata]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple
    layout: str          # replicated | sharded | flat (how it was held at save time)
    holders: int         # ranks that held part of it
    shards: int          # saved regions
    nbytes: int


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    complete: bool
    world_size: int = 0
    save_id: str = ""
    format_version: int = 0
    tensors: List[TensorInfo] = field(default_factory=list)
    objects: Dict[int, int] = field(default_factory=dict)   # rank -> bytes of plain values
    info: Mapping[str, Any] = field(default_factory=dict)
    problem: str = ""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> Dict[str, Any]:
        return {"path": self.path, "complete": self.complete, "world_size": self.world_size,
                "save_id": self.save_id, "format_version": self.format_version, "nbytes": self.nbytes,
                "tensors": [t.__dict__ | {"shape": list(t.shape)} for t in self.tensors],
                "objects": self.objects, "info": dict(self.info), "problem": self.problem}


def info(store: Storage, read_metadata: ReadMetadata, path: str) -> CheckpointInfo:
    """What a checkpoint holds, from its metadata alone. An incomplete one is reported, not raised."""
    try:
        md = read_metadata(store)
    except IncompleteCheckpointError as exc:
        return CheckpointInfo(path, complete=False, problem=str(exc))
    tensors = [TensorInfo(t.key, t.dtype, tuple(t.shape), t.layout, t.holders, len(t.regions), t.nbytes)
               for t in md.tensors.values()]
    return CheckpointInfo(path, True, md.world_size, md.save_id, md.version, tensors,
                          {o.rank: o.nbytes for o in md.objects}, md.info)


@dataclass
class VerifyReport:
    path: str
    ok: bool
    checked_bytes: int = 0
    problems: List[str] = field(default_factory=list)


def verify_store(store: Storage, workers, read_metadata: ReadMetadata, path: str,
                 progress: Optional[Callable[[int, int], None]] = None) -> VerifyReport:
    """Read every stored byte and check every checksum and the metadata's coverage."""
    report = VerifyReport(path, ok=True)
    try:
        md = read_metadata(store)
    except CheckpointError as exc:
        report.ok = False
        report.problems.append(str(exc))
        return report
    total = sum(t.nbytes for t in md.tensors.values())
    for t in md.tensors.values():
        problem = find_layout_problem(t.shape, [(r.offsets, r.lengths) for r in t.regions])
        if problem is not None:
            report.problems.append(f"tensor {t.key!r}: {problem[0]}")
    for meta in md.arrays.values():
        refs = [(meta, index) for index, _ in chunks.chunks_in_box(meta, ((0,) * len(meta.shape), meta.shape))]
        if not meta.shape:
            refs = [(meta, ())]

        def check(ref, fut):  # read + checksum on the worker pool
            try:
                return len(chunks.chunk_bytes(fut, ref[0], ref[1], f"array {ref[0].path!r}")), None
            except CheckpointError as err:
                return 0, str(err)
        for nbytes, problem in workers.map(check, list(zip(refs, chunks.start_chunk_reads(store, refs)))):
            report.checked_bytes += nbytes
            if problem:
                report.problems.append(problem)
            if progress:
                progress(report.checked_bytes, total)
    for o in md.objects:
        raw = store.get(o.path)
        if raw is None:
            report.problems.append(f"{o.path}: missing")
        elif zlib.crc32(raw) != o.crc32 or len(raw) != o.nbytes:
            report.problems.append(f"{o.path}: crc32 mismatch")
    report.ok = not report.problems
    return report


def delete_store(store: Storage) -> None:
    """Remove a checkpoint: the commit point first, so a half-deleted one never looks valid."""
    if store.get(METADATA_FILE) is None and not store.exists_any():
        raise CheckpointNotFoundError(f"{store.url!r}: nothing to delete")
    store.delete(METADATA_FILE)
    store.remove_root()
