"""metadata.json of a repeated save, without serializing its layout again (issue 40).

A save whose layout did not change since the previous one (the plan cache's hit) writes the same
tensor and array entries as before; only the data directory in their paths and each array's
packed tables (block crc32s, pack locations) differ. `LayoutJSON` serializes the layout once, with
markers where those go, and `render` fills them in: per save, one pass over the chunks' checksums
and locations and a join, instead of ~30 us per tensor of records and JSON encoding (876 tensors:
26 -> ~3 ms). The bytes are exactly Metadata.to_files' (tests/unit/test_layout_json.py compares
them); a layout this cannot serialize exactly (a marker character inside a key) gets None from
`build` and takes the general path.
"""
from __future__ import annotations

import itertools
import json
import re
import zlib
from collections import deque
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import checksums as crc
from .chunk_tables import grid_size
from . import metadata
from .metadata import (
    PACKED_VERSION,
    SAFETENSORS_VERSION,
    _array_head,
    _tensor_to_json,
    assemble,
    blocks_per_chunk,
)
from .records import ArrayMeta, TensorMeta

# Markers: characters no key of a layout build() accepts holds; JSON escapes them as \u0001 ...
_DIR, _CRC, _AT = "\x01", "\x02", "\x03"
_MARKERS = re.compile("[\x01-\x03]")
_SLOTS = re.compile(r"\\u000([123])")
Dumps = Dict[str, str]


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class LayoutJSON:
    """The serialized layout of one save plan (tensors, arrays, meshes, structure) with slots for
    the data directory and the per-save tables."""

    def __init__(self, fixed: Dumps, pieces: Dict[str, List[str]], slots: Dict[str, List[Tuple[int, int]]],
                 arrays: Sequence[str], counts: Sequence[Tuple[int, ...]], blocks: Sequence[int],
                 located: Sequence[bool], to_file: bool):
        self.fixed, self.pieces, self.slots = fixed, pieces, slots
        self.arrays, self.counts, self.located, self.to_file = arrays, counts, located, to_file
        n_chunks = np.array([grid_size(c) for c in counts], dtype=np.int64)
        self.blocks = np.repeat(np.asarray(blocks, dtype=np.int64), n_chunks)  # block crc32s of each chunk
        crc_ends = np.cumsum(n_chunks * np.asarray(blocks, dtype=np.int64)).tolist()
        at_ends = np.cumsum(3 * n_chunks * np.asarray(located, dtype=np.int64)).tolist()
        self.crc_spans = list(zip([0] + crc_ends[:-1], crc_ends))  # each array's values in the tables
        self.at_spans = list(zip([0] + at_ends[:-1], at_ends))

    @staticmethod
    def build(tensors: Mapping[str, TensorMeta], arrays: Mapping[str, ArrayMeta], block_bytes: int, structure: Any,
              object_owners: Mapping[str, int]) -> Optional["LayoutJSON"]:
        """From the plan's tensors and arrays (paths relative to the data directory), for a save with
        checksums of `block_bytes` blocks and every chunk in a pack (format 5/6), tables beside
        the data when large (to_files' table_key given). None: not serializable this way."""
        if any(_MARKERS.search(s) for s in itertools.chain(tensors, arrays, _strings(tensors.values()))):
            return None
        order = list(arrays)
        counts = [crc.grid_counts(arrays[p].shape, arrays[p].chunks) for p in order]
        sizes = [grid_size(c) for c in counts]
        blocks = [blocks_per_chunk(arrays[p].chunks, arrays[p].dtype, block_bytes) for p in order]
        located = [bool(n) for n in sizes]
        table_bytes = 4 * sum(n * (b + (3 if at else 0)) for n, b, at in zip(sizes, blocks, located))
        to_file = table_bytes > metadata.TABLE_FILE_MIN_BYTES  # read here: tests lower it
        tables: Dict[Any, int] = {}
        rooted = {k: t.rooted(_DIR) for k, t in tensors.items()}
        entries: Dict[str, Any] = {}
        start = 0
        for p, n, b, at in zip(order, sizes, blocks, located):
            a = arrays[p]
            head = _array_head(ArrayMeta(f"{_DIR}/{p}", a.shape, a.chunks, a.dtype, {}, block_bytes))
            if to_file:
                head["crc32_at"] = start
                start += n * b
                if at:
                    head["at_at"] = start
                    start += 3 * n
            else:
                head["crc32"] = _CRC
                if at:
                    head["at"] = _AT
            entries[f"{_DIR}/{p}"] = head
        fixed = {"tensors": _dumps({k: _tensor_to_json(t, tables) for k, t in rooted.items()}),
                 "arrays": _dumps(entries), "meshes": _dumps([t.tolist() for t in tables]),
                 "structure": _dumps(structure)}
        if object_owners:
            fixed["object_owners"] = _dumps(dict(object_owners))
        index = {p: i for i, p in enumerate(order)}
        in_json = sorted(order)  # the order json.dumps writes them (one shared prefix: the data directory)
        queues = {"1": deque(), "2": deque(), "3": deque()} if to_file else {  # to_file: table offsets, no slots
            "1": deque(), "2": deque(index[p] for p in in_json),
            "3": deque(index[p] for p in in_json if located[index[p]])}
        pieces: Dict[str, List[str]] = {}
        slots: Dict[str, List[Tuple[int, int]]] = {}
        for part in ("tensors", "arrays"):
            split = _SLOTS.split(fixed.pop(part))
            pieces[part], slots[part] = split[0::2], []
            for kind in split[1::2]:
                if kind != "1" and not queues[kind]:
                    return None  # a slot the layout did not place: not serializable this way
                slots[part].append((int(kind), queues[kind].popleft() if kind != "1" else -1))
        if any(queues.values()):
            return None
        return LayoutJSON(fixed, pieces, slots, order, counts, blocks, located, to_file)

    def names(self) -> List[List[str]]:
        """Every array's chunk names, row-major: built on demand (6M strings at 16,384 ranks x 1000
        tensors would be most of a cached layout's memory; render_tables needs none)."""
        return [crc.chunk_names(c) if grid_size(c) else [] for c in self.counts]

    def render(self, version: int, data_dir: str, sums: Mapping[str, Mapping[str, Sequence[int]]],
               locations: Mapping[str, Mapping[str, Tuple[str, int]]], pack_index: Mapping[str, int],
               rest: Dict[str, Any], table_key: str) -> Tuple[bytes, Optional[bytes]]:
        """(metadata.json, checksum table file or None), as Metadata.to_files(table_key) writes
        them. `sums`/`locations`: every rank's, by array path relative to the data directory;
        `rest`: the other top-level entries (objects, info, packs, safetensors). KeyError or
        ValueError: a chunk without its checksums or location (the general path names it)."""
        if version < PACKED_VERSION:
            raise ValueError(f"LayoutJSON writes formats {PACKED_VERSION}+ only, not {version}")
        if version == SAFETENSORS_VERSION and not rest.get("safetensors"):
            version = PACKED_VERSION
        chunk_names = self.names()
        values = [sums[p][n] for p, names in zip(self.arrays, chunk_names) for n in names]
        if len(values) and not np.array_equal(np.fromiter(map(len, values), np.int64, len(values)), self.blocks):
            raise ValueError("a chunk has another number of block checksums than its size gives")
        crcs = np.fromiter(itertools.chain.from_iterable(values), dtype="<u4", count=int(self.blocks.sum()))
        at = [locations[p][n] for p, names, on in zip(self.arrays, chunk_names, self.located) if on for n in names]
        offsets = np.fromiter((o for _, o in at), dtype=np.int64, count=len(at))
        packs = np.fromiter((pack_index[k] for k, _ in at), dtype=np.int64, count=len(at))
        where = np.stack([packs, offsets & 0xFFFFFFFF, offsets >> 32], axis=1).astype("<u4").reshape(-1)
        return self.render_tables(version, data_dir, crcs, where, rest, table_key)

    def render_tables(self, version: int, data_dir: str, crcs: np.ndarray, where: np.ndarray, rest: Dict[str, Any],
                      table_key: str) -> Tuple[bytes, Optional[bytes]]:
        """render's second half, from the tables in the layout's chunk order (chunk_tables.merge):
        every block crc32 (uint32) and every chunk's [pack, offset low, offset high] (uint32)."""
        if version < PACKED_VERSION:
            raise ValueError(f"LayoutJSON writes formats {PACKED_VERSION}+ only, not {version}")
        if version == SAFETENSORS_VERSION and not rest.get("safetensors"):
            version = PACKED_VERSION
        crc_spans, at_spans = self.crc_spans, self.at_spans
        dumped = dict(self.fixed)
        table = None
        if self.to_file:
            table = b"".join(crcs[a:b].tobytes() + where[c:d].tobytes() for (a, b), (c, d) in zip(crc_spans, at_spans))
            rest = {**rest, "checksum_table": {"path": table_key, "nbytes": len(table), "crc32": zlib.crc32(table)}}
        fill = {1: lambda i: data_dir,
                2: lambda i: crc.encode(crcs[crc_spans[i][0]:crc_spans[i][1]]),
                3: lambda i: crc.encode(where[at_spans[i][0]:at_spans[i][1]])}
        for part in ("tensors", "arrays"):
            out = [self.pieces[part][0]]
            for (kind, i), piece in zip(self.slots[part], self.pieces[part][1:]):
                out.append(fill[kind](i))
                out.append(piece)
            dumped[part] = "".join(out)
        dumped["version"] = str(version)
        for k, v in rest.items():
            dumped[k] = _dumps(v)
        if version < SAFETENSORS_VERSION:
            dumped.pop("safetensors", None)
        return assemble(dumped), table


def _strings(tensors) -> List[str]:
    """Every string of the tensors' entries that ends up in the JSON besides their keys."""
    out: List[str] = []
    for t in tensors:
        out += (t.dtype, t.layout, t.grid.array if t.grid is not None else "")
        if t.grid is None:
            out += [r.array for r in t.regions]
    return out
