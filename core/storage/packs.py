"""Pack files (format 5): a rank's chunks written into a few files, not one file per chunk.

A rank's chunks are dealt into K pack files (K grows with its bytes, at most MAX_PACKS), largest
first to the lightest pack (balanced), then laid out in each pack in the order the rank wrote
them, each at a 64-byte aligned offset. The layout is a pure function of the chunk sizes, so a
local-tier replica of a rank's part, written from the same plan by another rank, has the same
bytes at the same offsets. Each pack is written on one worker: its chunks' block crc32s, then one
`Storage.write_parts` (writev + fdatasync on local files; one object on object stores). The
metadata records, per chunk, (pack index, offset); the pack names are listed once.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..common.errors import CheckpointError

ALIGN = 64
MAX_PACKS = 4                      # per rank: files (objects) written in parallel
PACK_TARGET_BYTES = 64 << 20       # a rank with less than this writes one pack
_ZEROS = memoryview(bytes(ALIGN))


@dataclass(frozen=True)
class Slot:
    pack: int                      # index into the rank's pack keys
    offset: int                    # byte offset inside that pack


def pack_key(data_dir: str, rank: int, k: int) -> str:
    return f"{data_dir}/pack/{rank}-{k}.bin"


def layout(sizes: Sequence[int]) -> Tuple[int, List[Slot]]:
    """(number of packs, where each chunk goes), from the chunk sizes alone (deterministic)."""
    total = sum(sizes)
    n = max(1, min(MAX_PACKS, len(sizes), math.ceil(total / PACK_TARGET_BYTES)))
    load = [0] * n
    chosen = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(n), key=lambda k: (load[k], k))
        chosen[i] = k
        load[k] += -(-sizes[i] // ALIGN) * ALIGN
    ends = [0] * n
    slots = []
    for i, size in enumerate(sizes):
        k = chosen[i]
        slots.append(Slot(k, ends[k]))
        ends[k] += -(-size // ALIGN) * ALIGN
    return n, slots


Item = Tuple[str, str, np.ndarray]  # (array path, chunk name, payload)


def write(storage, workers, data_dir: str, rank: int, items: Sequence[Item], block_checksums, block_bytes: int,
          rec=None) -> Tuple[Dict[str, Dict[str, Tuple[int, ...]]], Dict[str, Dict[str, Tuple[str, int]]]]:
    """Write `items` into this rank's packs; returns ({array: {chunk: block crc32s}},
    {array: {chunk: (pack key, offset)}}). `rec` (a monitor Recorder) gets a "write.pack" span
    per pack."""
    views = [memoryview(np.ascontiguousarray(p)).cast("B") for _, _, p in items]
    n, slots = layout([len(v) for v in views])
    keys = [pack_key(data_dir, rank, k) for k in range(n)]
    members: List[List[int]] = [[] for _ in range(n)]
    for i, s in enumerate(slots):
        members[s.pack].append(i)
    storage.prepare(keys)

    def write_pack(k: int) -> Dict[int, Tuple[int, ...]]:
        t0 = time.perf_counter()
        parts: List[memoryview] = []
        sums: Dict[int, Tuple[int, ...]] = {}
        pos = 0
        for i in members[k]:
            if slots[i].offset > pos:
                parts.append(_ZEROS[:slots[i].offset - pos])
            sums[i] = block_checksums(views[i], block_bytes)
            parts.append(views[i])
            pos = slots[i].offset + len(views[i])
        try:
            storage.write_parts(keys[k], parts).result()
        except CheckpointError:  # storage errors name the object and the store already (and keep their type)
            raise
        except Exception as exc:  # noqa: BLE001 - name the file and what it holds
            first = items[members[k][0]] if members[k] else ("", "", None)
            raise CheckpointError(f"writing pack file {keys[k]} ({len(members[k])} chunks, e.g. {first[0]!r}) "
                                  f"failed: {exc}") from exc
        if rec is not None:
            rec.add("write.pack", t0, time.perf_counter(), pos, len(members[k]))
        return sums

    checksums: Dict[str, Dict[str, Tuple[int, ...]]] = {}
    locations: Dict[str, Dict[str, Tuple[str, int]]] = {}
    for per_pack in workers.map(write_pack, list(range(n))):
        for i, crcs in per_pack.items():
            array, name, _ = items[i]
            checksums.setdefault(array, {})[name] = crcs
            locations.setdefault(array, {})[name] = (keys[slots[i].pack], slots[i].offset)
    return checksums, locations


# ---------------------------------------------------------------------- reading

RUN_GAP_BYTES = 64 << 10          # chunks closer than this in one pack are read by one request
RUN_MAX_BYTES = 16 << 20          # ... up to this much: the runs spread over the workers (and, on an
                                  # object store, are GETs of the size that reach its floor, bench_s3)


@dataclass
class Run:
    """Whole chunks of one pack file, near each other, read by one scatter request straight into
    their destinations (gaps into scratch), then each checked against its checksums."""
    key: str
    start: int
    members: List[Tuple[int, object]]   # (offset, payload the caller attaches: chunk ref, view, ...)
    stop: int = 0


def plan_runs(located: Sequence[Tuple[str, int, int, object]], max_bytes: int = RUN_MAX_BYTES) -> List[Run]:
    """(pack key, offset, nbytes, payload) of whole-chunk reads -> runs of at most max_bytes
    (a single larger read stays one run) (pure)."""
    runs: List[Run] = []
    by_key: Dict[str, List[Tuple[int, int, object]]] = {}
    for key, offset, nbytes, payload in located:
        by_key.setdefault(key, []).append((offset, nbytes, payload))
    for key in sorted(by_key):
        current = None
        for offset, nbytes, payload in sorted(by_key[key], key=lambda x: x[0]):
            if (current is None or offset - current.stop > RUN_GAP_BYTES or offset < current.stop
                    or offset + nbytes - current.start > max_bytes):
                current = Run(key, offset, [], offset)
                runs.append(current)
            current.members.append((offset, payload))
            current.stop = offset + nbytes
    return runs


def scatter_list(run: Run, views: Sequence[memoryview]) -> List[memoryview]:
    """The buffers of one run's request: each member's view, scratch for the gaps between them."""
    bufs: List[memoryview] = []
    pos = run.start
    for (offset, _), view in zip(run.members, views):
        if offset > pos:
            bufs.append(memoryview(bytearray(offset - pos)))
        bufs.append(view)
        pos = offset + len(view)
    return bufs
