"""Looking at and removing checkpoints: inspect (metadata only), verify (every byte), delete.
Also the pure helpers of inspect's summary: groups of tensors, natural order, folded names."""
from __future__ import annotations

import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ..common.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from ..foreign import COMMIT_FILES
from ..format.metadata import METADATA_FILE, Metadata
from ..geometry.regions import find_layout_problem
from ..state.flatten import structure_leaves
from ..storage import Storage, chunks, packs

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
    values: List[str] = field(default_factory=list)         # keys of plain values (epoch, step, ...)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> Dict[str, Any]:
        return {"path": self.path, "complete": self.complete, "world_size": self.world_size,
                "save_id": self.save_id, "format_version": self.format_version, "nbytes": self.nbytes,
                "tensors": [t.__dict__ | {"shape": list(t.shape)} for t in self.tensors],
                "objects": self.objects, "info": dict(self.info), "problem": self.problem,
                "values": self.values,
                "groups": [g.to_dict() for g in summarize(self.tensors, self.values)]}


def info(store: Storage, read_metadata: ReadMetadata, path: str) -> CheckpointInfo:
    """What a checkpoint holds, from its metadata alone. An incomplete one is reported, not raised."""
    try:
        md = read_metadata(store)
    except IncompleteCheckpointError as exc:
        return CheckpointInfo(path, complete=False, problem=str(exc))
    tensors = [TensorInfo(t.key, t.dtype, tuple(t.shape), t.layout, t.holders, len(t.regions), t.nbytes)
               for t in md.tensors.values()]
    values = sorted((k for k, kind in structure_leaves(md.structure).items() if kind == "object"), key=natural_key)
    return CheckpointInfo(path, True, md.world_size, md.save_id, md.version, tensors,
                          {o.rank: o.nbytes for o in md.objects}, md.info, values=values)


# ---------------------------------------------------------------------- inspect's summary (pure)

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """Sort key with numbers compared as numbers: state/2 < state/10 (mixed parts never fail)."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in _DIGITS.split(name) if t)


@dataclass
class GroupInfo:
    """Tensors and plain values under one key prefix (the first `depth` parts of their names)."""
    name: str
    tensors: int = 0
    nbytes: int = 0
    values: int = 0
    dtypes: Counter = field(default_factory=Counter)
    layouts: Counter = field(default_factory=Counter)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "tensors": self.tensors, "nbytes": self.nbytes, "values": self.values,
                "dtypes": dict(self.dtypes), "layouts": dict(self.layouts)}


def group_of(name: str, depth: int) -> str:
    return "/".join(name.split("/")[:depth])


def summarize(tensors: Sequence[TensorInfo], values: Sequence[str] = (), depth: int = 1) -> List[GroupInfo]:
    """Per group of the first `depth` key parts: tensors, bytes, dtypes, layouts, plain values;
    in natural order."""
    groups: Dict[str, GroupInfo] = {}
    for t in tensors:
        g = groups.setdefault(group_of(t.name, depth), GroupInfo(group_of(t.name, depth)))
        g.tensors += 1
        g.nbytes += t.nbytes
        g.dtypes[t.dtype] += 1
        g.layouts[t.layout] += 1
    for k in values:
        groups.setdefault(group_of(k, depth), GroupInfo(group_of(k, depth))).values += 1
    return sorted(groups.values(), key=lambda g: natural_key(g.name))


def fold(name: str, width: int) -> List[str]:
    """`name` in lines of at most `width` characters, cut after a '/' or '.' where one is near the
    end of the line; continuation lines are indented by two spaces. Every character is kept."""
    if len(name) <= width or width < 12:
        return [name]
    lines: List[str] = []
    rest, first = name, True
    while len(rest) > (width if first else width - 2):
        room = width if first else width - 2
        cut = max(rest.rfind("/", 0, room), rest.rfind(".", 0, room)) + 1
        if cut <= room // 3:
            cut = room
        lines.append(("" if first else "  ") + rest[:cut])
        rest, first = rest[cut:], False
    lines.append(("" if first else "  ") + rest)
    return lines


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
    if md.safetensors:  # format 6: the safetensors headers (the chunk checksums do not cover them)
        report.problems += packs.st_problems(md, lambda key, a, b: store.read_range(key, a, b).result())
    if md.foreign is not None:  # another format's plain values (core/foreign/)
        report.problems += md.foreign.problems(store)
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
    for commit in (METADATA_FILE,) + COMMIT_FILES:  # ours, or another format's (a DCP .metadata)
        store.delete(commit)
    store.remove_root()
