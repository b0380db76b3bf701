"""Pack files (format 5): a rank's chunks written into a few files, not one file per chunk.

A rank's chunks are dealt into K pack files, largest first to the lightest pack (balanced), then
laid out in each pack in the order the rank wrote them, each at a 64-byte aligned offset. K grows
with the rank's bytes (Sizing: up to max_packs, then past it only as far as keeps every pack near
max_bytes); local files and object stores are sized apart (FILES, OBJECTS). The layout is a pure
function of the chunk sizes and the sizing, so a local-tier replica of a rank's part, written from
the same plan by another rank to the same kind of storage, has the same bytes at the same offsets.
Each pack is written by one thread: its chunks' block crc32s, then one `Storage.write_parts` (writev
+ fdatasync on local files, on the save's workers; one PUT on object stores, up to max_packs at once).
The metadata records, per chunk, (pack index, offset); the pack names are listed once.
"""
from __future__ import annotations

import heapq
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..common import dtypes
from ..common.errors import CheckpointError
from ..format.safetensors_header import STEntry, file_order, header_bytes

ALIGN = 64
_ZEROS = memoryview(bytes(ALIGN))


@dataclass(frozen=True)
class Sizing:
    target_bytes: int   # a rank with less than this writes one pack
    max_packs: int      # packs written at once; a rank writes more only when they would pass max_bytes
    max_bytes: int


# Local files: a few large files, each one writev + fdatasync on a worker; past 4 GiB one more per GiB.
FILES = Sizing(64 << 20, 4, 1 << 30)
# Object stores: one PUT per pack, so the packs are the parallel requests: 16 MiB and up, 16 in flight
# (bench_s3: the store's floor is 16 MiB PUTs all in flight; 4 packs of a rank's real-model shapes
# reached 0.84 of it, 13-16 packs 1.07); 256 MiB at most, since each PUT in flight holds its pack
# joined in memory (tensorstore's write takes one bytes object) and one S3 PUT takes at most 5 GiB.
# Not multipart: tensorstore's kvstore has none.
OBJECTS = Sizing(16 << 20, 16, 256 << 20)


def sizing_for(storage) -> Sizing:
    return OBJECTS if getattr(storage, "scheme", "file") in ("s3", "gs") else FILES


@dataclass(frozen=True)
class Slot:
    pack: int                      # index into the rank's pack keys
    offset: int                    # byte offset inside that pack


def pack_key(data_dir: str, rank: int, k: int) -> str:
    return f"{data_dir}/pack/{rank}-{k}.bin"


def layout(sizes: Sequence[int], sizing: Sizing = FILES) -> Tuple[int, List[Slot]]:
    """(number of packs, where each chunk goes), from the chunk sizes and the sizing (deterministic)."""
    n = pack_count(sum(sizes), len(sizes), sizing)
    lightest = [(0, k) for k in range(n)]  # (bytes so far, pack): a heap, ties to the lower index
    chosen = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, k = heapq.heappop(lightest)
        chosen[i] = k
        heapq.heappush(lightest, (load + -(-sizes[i] // ALIGN) * ALIGN, k))
    ends = [0] * n
    slots = []
    for i, size in enumerate(sizes):
        k = chosen[i]
        slots.append(Slot(k, ends[k]))
        ends[k] += -(-size // ALIGN) * ALIGN
    return n, slots


def pack_count(total: int, chunks: int, sizing: Sizing = FILES) -> int:
    """How many packs a rank with `chunks` chunks of `total` bytes writes."""
    wanted = max(min(sizing.max_packs, math.ceil(total / sizing.target_bytes)), math.ceil(total / sizing.max_bytes))
    return max(1, min(chunks, wanted))


Item = Tuple[str, str, np.ndarray]  # (array path, chunk name, payload)


def write(storage, workers, data_dir: str, rank: int, items: Sequence[Item], block_checksums, block_bytes: int,
          rec=None, safetensors: Optional[Mapping[str, STArray]] = None
          ) -> Tuple[List[Tuple[int, ...]], List[Optional[Tuple[str, int]]]]:
    """Write `items` into this rank's packs; returns each item's block crc32s and (pack key, offset)
    (None for an item not written: a second copy of a chunk in a safetensors pack). `rec` (a monitor Recorder) gets a "write.pack" span
    per pack. `safetensors` (st_arrays): arrays whose chunks go into safetensors packs (format 6)."""
    views = [memoryview(np.ascontiguousarray(p)).cast("B") for _, _, p in items]
    heads, groups, dropped = st_layout(items, views, safetensors or {})
    in_st = {i for g in groups for i in g} | dropped
    plain = [i for i in range(len(items)) if i not in in_st]
    sizing = sizing_for(storage)
    n, slots = layout([len(views[i]) for i in plain], sizing) if plain or not groups else (0, [])
    keys = [pack_key(data_dir, rank, k) for k in range(n)] + [st_pack_key(data_dir, rank, n + g)
                                                              for g in range(len(groups))]
    members: List[List[int]] = [[] for _ in range(n)] + groups
    where: Dict[int, Tuple[int, int]] = {}   # item -> (pack, offset)
    for i, s in zip(plain, slots):
        members[s.pack].append(i)
        where[i] = (s.pack, s.offset)
    heads = [b""] * n + heads
    for g, order in enumerate(groups):  # whole tensors back to back after the header, in file order
        pos = len(heads[n + g])
        for i in order:
            where[i] = (n + g, pos)
            pos += len(views[i])
    storage.prepare(keys)

    def write_pack(k: int) -> Dict[int, Tuple[int, ...]]:
        t0 = time.perf_counter()
        parts: List[memoryview] = [memoryview(heads[k])] if heads[k] else []
        sums: Dict[int, Tuple[int, ...]] = {}
        pos = len(heads[k])
        for i in members[k]:
            if where[i][1] > pos:
                parts.append(_ZEROS[:where[i][1] - pos])
            sums[i] = block_checksums(views[i], block_bytes)
            parts.append(views[i])
            pos = where[i][1] + len(views[i])
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

    sums: List[Tuple[int, ...]] = [()] * len(items)
    for per_pack in _each_pack(write_pack, len(keys), workers, sizing):
        for i, crcs in per_pack.items():
            sums[i] = crcs
    return sums, [(keys[where[i][0]], where[i][1]) if i in where else None for i in range(len(items))]


def _each_pack(write_pack, n: int, workers, sizing: Sizing) -> List[Dict[int, Tuple[int, ...]]]:
    """write_pack(k) for every pack: on the save's workers (local files: CPU and disk), or, for object
    stores, on threads of their own, max_packs PUTs in flight (they wait on the network, not a core)."""
    if sizing is FILES or n <= 1:
        return list(workers.map(write_pack, list(range(n))))
    pool = ThreadPoolExecutor(min(n, sizing.max_packs), thread_name_prefix="bytecheckpoint-put")
    try:
        futures = [pool.submit(write_pack, k) for k in range(n)]
        return [f.result() for f in futures]
    finally:  # after a failure the PUTs not started are dropped, those in flight finish
        pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------- safetensors packs (format 6)

ST_SUFFIX = ".safetensors"
ST_METADATA = {"format": "pt"}     # the __metadata__ transformers' save_pretrained writes


def st_pack_key(data_dir: str, rank: int, k: int) -> str:
    return f"{data_dir}/pack/{rank}-{k}{ST_SUFFIX}"


@dataclass(frozen=True)
class STArray:
    """A tensor of a safetensors pack: its group (the key path asked for), its name in the file
    (its key below the group), dtype and shape."""
    group: str
    name: str
    dtype: str
    shape: Tuple[int, ...]


def st_arrays(local) -> Dict[str, STArray]:
    """The arrays of `local` (a planning.LocalPlan) that go into safetensors packs: tensors under
    its `safetensors` key paths that this rank writes whole (the planner keeps such a tensor in one
    array of its shape), in row chunks that tile it (no padded edge chunk), of a safetensors dtype."""
    out: Dict[str, STArray] = {}
    for w in local.writes:
        group = next((g for g in local.safetensors if w.key.startswith(g + "/")), None)
        a = local.arrays[w.array]
        if group is None or a.dtype not in dtypes.SAFETENSORS:
            continue
        whole = tuple(w.lengths) == tuple(a.shape) and not any(w.array_offsets)
        tiled = not a.shape or (tuple(a.chunks[1:]) == tuple(a.shape[1:]) and a.shape[0] % a.chunks[0] == 0)
        if whole and tiled:
            out[w.array] = STArray(group, w.key[len(group) + 1:], a.dtype, tuple(a.shape))
    return out


def st_layout(items: Sequence[Item], views: Sequence[memoryview], arrays: Mapping[str, STArray]
              ) -> Tuple[List[bytes], List[List[int]], set]:
    """Per group: the safetensors header of its tensors and the items in file order (each tensor's
    chunks in row order, back to back): the file is what `safetensors.torch.save_file(tensors,
    metadata={"format": "pt"})` writes. Pure: a function of the arrays and the chunk sizes. Also the
    items not written at all: a second item of the same chunk (chunks.encode_box gives a 0-d tensor's
    one chunk twice; an ordinary pack holds both copies)."""
    by_array: Dict[str, List[int]] = {}
    seen: Dict[Tuple[str, str], int] = {}
    dropped = set()
    for i, (array, name, _) in enumerate(items):
        if array in arrays:
            if (array, name) in seen:
                dropped.add(i)
                continue
            seen[(array, name)] = i
            by_array.setdefault(array, []).append(i)
    heads: List[bytes] = []
    orders: List[List[int]] = []
    for group in sorted({a.group for a in arrays.values()}):
        mine = {st.name: (path, st) for path, st in arrays.items() if st.group == group}
        entries = file_order([STEntry(name, dtypes.SAFETENSORS[st.dtype], st.shape) for name, (_, st) in mine.items()])
        order = []
        for e in entries:
            got = by_array.get(mine[e.name][0], [])
            if sum(len(views[i]) for i in got) != e.nbytes:  # not tiled exactly: the planner promised otherwise
                raise CheckpointError(f"internal: tensor {group}/{e.name} has {sum(len(views[i]) for i in got)} "
                                      f"bytes of chunks for {e.nbytes} bytes of data")
            order += sorted(got, key=lambda i: tuple(int(x) for x in items[i][1].split(".") if x.isdigit()))
        heads.append(header_bytes(entries, ST_METADATA))
        orders.append(order)
    return heads, orders, dropped


def st_views(plan, where: Mapping[str, Mapping[str, Tuple[str, int]]]) -> Dict[str, List[str]]:
    """{key path: its safetensors packs} for each of `plan.safetensors` (a planning.SavePlan) whose every
    tensor was written into safetensors packs (`where`: array -> chunk -> (pack key, offset), of every
    rank). A key path with a tensor elsewhere (held in shards, a dtype safetensors lacks) is left out:
    its tensors are in ordinary packs, readable as always, but no Hugging Face loader can open them."""
    out: Dict[str, List[str]] = {}
    for group in plan.safetensors:
        tensors = [t for k, t in plan.tensors.items() if k.startswith(group + "/")]
        keys: Optional[set] = set() if tensors else None
        for t in tensors:
            arrays = {r.array for r in t.regions} if t.grid is None else {None}
            for array in arrays:
                locs = list(where.get(array, {}).values()) if array is not None else None
                if locs is None or len(locs) != _chunk_count(plan.arrays[array]) or \
                        not all(k.endswith(ST_SUFFIX) for k, _ in locs):
                    keys = None
                    break
                keys.update(k for k, _ in locs)
            if keys is None:
                break
        if keys:
            out[group] = sorted(keys)
    return out


def st_problems(md, read_range) -> List[str]:
    """What is wrong with the safetensors packs of metadata `md` (format 6) as safetensors files: each
    header (not covered by the chunk checksums) must be the one save_file writes for the tensors it
    lists, and each tensor of the key path must start where the metadata has its first chunk.
    `read_range(key, start, stop)` -> bytes."""
    problems: List[str] = []
    for group, indices in md.safetensors.items():
        named: Dict[str, Tuple[str, Tuple[int, int]]] = {}  # name in file -> (pack, absolute data start)
        for index in indices:
            key = md.packs[index]
            try:
                n = int.from_bytes(bytes(read_range(key, 0, 8)), "little")
                raw = bytes(read_range(key, 8, 8 + n)) if 0 < n <= (100 << 20) else b""
                header = json.loads(raw)
                meta = header.pop("__metadata__", None)
                entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"])
                listed = [STEntry(k, e["dtype"], tuple(e["shape"])) for k, e in entries]
                ok = (header_bytes(listed, meta) == n.to_bytes(8, "little") + raw
                      and [e["data_offsets"] for _, e in entries] == _offsets(listed))
            except (ValueError, KeyError, TypeError, AttributeError, CheckpointError) as exc:
                problems.append(f"{key}: the safetensors header of {group!r} cannot be read ({exc})")
                continue
            if not ok:
                problems.append(f"{key}: the safetensors header of {group!r} is not the one its tensors give")
            named.update({k: (index, 8 + n + e["data_offsets"][0]) for k, e in header.items()})
        for tkey, t in md.tensors.items():
            if not tkey.startswith(group + "/") or not t.nbytes:
                continue
            a = md.arrays[t.regions[0].array] if t.grid is None else None
            first = a.locations.get("c" if not t.shape else ".".join("0" * len(t.shape))) if a is not None else None
            where = None if first is None else (first[0], first[1] | (first[2] << 32))
            if named.get(tkey[len(group) + 1:]) != where:
                problems.append(f"tensor {tkey!r}: not where the safetensors header of {group!r} places it")
    return problems


def _offsets(entries: Sequence[STEntry]) -> List[List[int]]:
    out, pos = [], 0
    for e in entries:
        out.append([pos, pos + e.nbytes])
        pos += e.nbytes
    return out


def _chunk_count(meta) -> int:
    if not meta.shape:
        return 1
    return math.prod(-(-s // c) for s, c in zip(meta.shape, meta.chunks)) if math.prod(meta.shape) else 0


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
