"""The on-disk contract: frozen dataclasses for the global metadata file, JSON with a version.

Parsing validates everything it reads (types, ranges, relative paths) so that a damaged or
hostile metadata file gives a MetadataError instead of reading outside the checkpoint or
allocating without bound.
"""
from __future__ import annotations

import base64
import json
import math
import re
import struct
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from ..common import dtypes
from ..common.errors import FormatVersionError, MetadataError
from . import checksums as crc
from .grid_json import grid_to_json, parse_grid_tensor, parse_tables
from .records import (
    MAX_ELEMENTS,
    ArrayMeta,
    ObjectFileMeta,
    RegionMeta,
    TensorMeta,
    check_int,
    check_ints,
    expect,
    fail,
    safe_relative_path,
)

FORMAT_NAME = "bytecheckpoint"
FORMAT_VERSION = 6  # 6: safetensors packs (`safetensors`: key path -> its packs, each a safetensors file);
                   #    checkpoints without them are still written as 5;
                   # 5: chunks packed into a few pack files per rank (ArrayMeta.locations, `packs`);
                   # 4: the packed checksum tables in a binary file beside the data when they are
                   #    large (TABLE_FILE_MIN_BYTES); small checkpoints are still written as 3;
                   # 3: regular (DTensor) layouts as one "grid" per tensor, packed checksum tables;
                   # 2: per-block chunk checksums (ArrayMeta.block_bytes); 1 to 4 still load
INLINE_TABLES_VERSION = 3
PACKED_VERSION = 5
SAFETENSORS_VERSION = 6
# Checksum tables larger than this (packed bytes) go to their own file, so that metadata.json stays
# the layout: 4096 FSDP ranks x 1000 tensors have ~12 MiB of crc32s (16 MiB as base64 in JSON).
TABLE_FILE_MIN_BYTES = 1 << 20
METADATA_FILE = "metadata.json"
CHECKSUM_TABLE_FILE = "checksums.bin"  # version 4, inside the save's data directory

# torch dtype name <-> zarr v3 / tensorstore data_type name (common/dtypes.py).
DTYPES = dtypes.ZARR

@dataclass(frozen=True)
class Metadata:
    version: int
    save_id: str
    world_size: int
    tensors: Mapping[str, TensorMeta]
    arrays: Mapping[str, ArrayMeta]
    objects: Tuple[ObjectFileMeta, ...]
    structure: Any                      # nesting of the saved state (see state/flatten.py)
    info: Mapping[str, Any] = field(default_factory=dict)  # library version, time, layout notes
    packs: Tuple[str, ...] = ()         # format 5: the pack files holding every chunk (relative paths)
    safetensors: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)  # format 6: key path -> packs
    # plain values rank 0 did not save (other pipeline stages' / experts' keys): which rank's object
    # file holds each; written only when some rank saved keys rank 0 did not
    object_owners: Mapping[str, int] = field(default_factory=dict)
    # another format's checkpoint read as ours (core/foreign/): its reader of plain values
    # (`read(store, keys, allow_pickle)`, `problems(store)`); never written, None for ours
    foreign: Any = field(default=None, compare=False, repr=False)

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces) with a crc32 of everything else as `checksum`.
        Written in the form of `version` (grid tensors are spelled out as regions before version 3;
        version 4 is written as 3: tables inline, see to_files)."""
        return self._to_json(None)[0]

    def to_files(self, table_key: str) -> Tuple[bytes, Optional[bytes]]:
        """(metadata.json, checksum table file or None). With tables over TABLE_FILE_MIN_BYTES
        (version 4) they are one little-endian uint32 file at `table_key`, and metadata.json names
        it with its length and crc32; else (None) the tables are inline, written as version 3."""
        return self._to_json(table_key)

    def _to_json(self, table_key: Optional[str]) -> Tuple[bytes, Optional[bytes]]:
        version = self.version
        if version == SAFETENSORS_VERSION and not self.safetensors:
            version = PACKED_VERSION  # nothing of format 6 in it: readable by format-5 readers
        packed = {k: _packed_table(a) for k, a in self.arrays.items()} if version >= 3 else {}
        # an array without locations keeps one file per chunk (as before format 5)
        where = {k: _location_table(a) for k, a in self.arrays.items()
                 if a.locations} if version >= PACKED_VERSION else {}
        table_bytes = 4 * (sum(len(t) for t in packed.values()) + sum(len(t) for t in where.values()))
        to_file = version >= 4 and table_key is not None and table_bytes > TABLE_FILE_MIN_BYTES
        if version == 4 and not to_file:
            version = INLINE_TABLES_VERSION
        tables: Optional[Dict[Any, int]] = {} if version >= 3 else None
        arrays: Dict[str, Any] = {}
        start = 0
        for k, a in self.arrays.items():
            if version < 3:
                arrays[k] = _array_to_json_v2(a)
            elif to_file:
                arrays[k] = {**_array_head(a), "crc32_at": start}
                start += len(packed[k])
                if k in where:
                    arrays[k]["at_at"] = start
                    start += len(where[k])
            else:
                arrays[k] = {**_array_head(a), "crc32": crc.encode(packed[k])}
                if k in where:
                    arrays[k]["at"] = crc.encode(where[k])
        parts = {
            "format": FORMAT_NAME,
            "version": version,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "tensors": {k: _tensor_to_json(t, tables) for k, t in self.tensors.items()},
            "arrays": arrays,
            "objects": [asdict(o) for o in self.objects],
            "structure": self.structure,
            "info": dict(self.info),
        }
        if tables is not None:
            parts["meshes"] = [t.tolist() for t in tables]
        if version >= PACKED_VERSION:
            parts["packs"] = list(self.packs)
        if version >= SAFETENSORS_VERSION:
            parts["safetensors"] = {k: list(v) for k, v in self.safetensors.items()}
        if self.object_owners:
            parts["object_owners"] = dict(self.object_owners)
        table = None
        if to_file:
            table = b"".join(np.asarray(packed[k], dtype="<u4").tobytes() + (
                np.asarray(where[k], dtype="<u4").tobytes() if k in where else b"") for k in self.arrays)
            parts["checksum_table"] = {"path": table_key, "nbytes": len(table), "crc32": zlib.crc32(table)}
        return assemble({k: json.dumps(v, sort_keys=True, separators=(",", ":")) for k, v in parts.items()}), table

    @staticmethod
    def from_json(raw: bytes, where: str = "metadata",
                  fetch: Optional[Callable[[str], Optional[bytes]]] = None) -> "Metadata":
        """`fetch(path)`: the bytes of a file of the checkpoint (the checksum table of version 4),
        or None when it is missing."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise MetadataError(f"{where}: not valid JSON ({exc}); the file is damaged") from None
        return _parse(body, where, fetch)


def assemble(dumped: Dict[str, str]) -> bytes:
    """metadata.json from its top-level entries, each already serialised (canonical JSON): the
    canonical object with a crc32 of everything else spliced in at its sorted place, `checksum`."""
    canonical = "{" + ",".join(f"{json.dumps(k)}:{dumped[k]}" for k in sorted(dumped)) + "}"
    dumped = {**dumped, "checksum": str(zlib.crc32(canonical.encode()))}
    return ("{" + ",".join(f"{json.dumps(k)}:{dumped[k]}" for k in sorted(dumped)) + "}").encode()


dtype_itemsize = dtypes.itemsize


def order_key(info: Mapping[str, Any]) -> Tuple[int, float]:
    """How checkpoints are ordered (newest = largest), from their metadata's `info`: the training
    step given to save() (-1 when none was), then when the state was captured (save() was called;
    the commit time for older checkpoints)."""
    step = info.get("step")
    captured = info.get("captured_unix", info.get("created_unix", 0.0))
    return (int(step) if isinstance(step, int) and not isinstance(step, bool) else -1,
            float(captured) if isinstance(captured, (int, float)) else 0.0)


def _tensor_to_json(t: TensorMeta, tables: Optional[Dict[Any, int]]) -> Dict[str, Any]:
    """A grid tensor (version 3) is its layout: mesh, dims, the mesh's rank table (shared by all
    tensors on that mesh, in the top-level `meshes`), the split rule and the writer choices.
    Other regions stored in the tensor's own array at their global offsets (the common case) are
    written as [offsets, lengths, writer]; others as [offsets, lengths, writer, array, array_offsets]."""
    head = {"dtype": t.dtype, "shape": list(t.shape), "layout": t.layout, "holders": t.holders}
    if t.grid is not None and tables is not None:
        return {**head, "array": t.grid.array, "grid": grid_to_json(t.grid, tables)}
    arrays = {r.array for r in t.regions}
    default = next(iter(arrays)) if len(arrays) == 1 else None
    regions = []
    for r in t.regions:
        if r.array == default and r.array_offsets == r.offsets:
            regions.append([list(r.offsets), list(r.lengths), r.writer])
        else:
            regions.append([list(r.offsets), list(r.lengths), r.writer, r.array, list(r.array_offsets)])
    return {**head, "array": default, "regions": regions}


def _array_head(a: ArrayMeta) -> Dict[str, Any]:
    return {"path": a.path, "shape": list(a.shape), "chunks": list(a.chunks), "dtype": a.dtype,
            "block_bytes": a.block_bytes}


def _packed_table(a: ArrayMeta):
    """Version 3+: the packed table of every chunk's checksum(s), row-major (format/checksums.py)."""
    per_chunk = blocks_per_chunk(a.chunks, a.dtype, a.block_bytes) if a.block_bytes else 1
    try:
        return crc.pack(crc.grid_counts(a.shape, a.chunks), a.checksums, per_chunk if a.block_bytes else 0)
    except KeyError as exc:
        raise ValueError(f"array {a.path!r}: no checksum for chunk {exc}") from None
    except ValueError as exc:
        raise ValueError(f"array {a.path!r}: {exc}") from None


def _location_table(a: ArrayMeta):
    """Version 5: (pack index, offset low, offset high) of every chunk, row-major."""
    try:
        return crc.pack(crc.grid_counts(a.shape, a.chunks), a.locations, 3)
    except KeyError as exc:
        raise ValueError(f"array {a.path!r}: no pack location for chunk {exc}") from None


def _parse_locations(a: Dict[str, Any], shape: Tuple[int, ...], chunks: Tuple[int, ...], n_chunks: int, n_packs: int,
                     w: str, table_file: Optional[np.ndarray]) -> Mapping[str, Tuple[int, int, int]]:
    """Version 5: three uint32 per chunk (pack index < len(packs), byte offset), base64 in `at` or
    at value offset `at_at` of the table file."""
    table = _packed_values(a, "at", 3 * n_chunks, w, table_file, f"{n_chunks} chunk locations")
    expect(n_chunks == 0 or int(np.asarray(table).reshape(-1, 3)[:, 0].max()) < n_packs, w,
           "a chunk location names a pack file the metadata does not list")
    return crc.PackedChecksums(crc.grid_counts(shape, chunks), table, 3)


def _packed_values(a: Dict[str, Any], name: str, n: int, w: str, table_file: Optional[np.ndarray], what: str):
    """`n` uint32 values of an array entry: base64 in `name`, or at value offset `<name>_at` of the
    table file (version 4+, large tables)."""
    if table_file is not None:
        expect(name not in a, w, f"both {name} and {name}_at")
        at = check_int(a.get(f"{name}_at"), w, 0, len(table_file))
        expect(at + n <= len(table_file), w, f"{name}_at {at} + {n} values runs past the table file")
        return table_file[at:at + n]
    try:
        return crc.decode(a.get(name), n)
    except ValueError:
        raise fail(w, f"{name} is not a packed table of {what}") from None


def _parse_packed(a: Dict[str, Any], shape: Tuple[int, ...], chunks: Tuple[int, ...], dtype: str, n_chunks: int,
                  w: str, table_file: Optional[np.ndarray]) -> Tuple[Mapping[str, Any], int]:
    """Version 3+: exactly one packed value per chunk (per block with block_bytes > 0), base64 in
    `crc32`, or (version 4) at value offset `crc32_at` of the checksum table file."""
    expect("checksums" not in a, w, "version 3+ stores a packed crc32 table, not checksums")
    block = check_int(a.get("block_bytes"), w, 0, 1 << 40)
    per_chunk = blocks_per_chunk(chunks, dtype, block) if block else 1
    table = _packed_values(a, "crc32", n_chunks * per_chunk, w, table_file, f"{n_chunks} x {per_chunk} checksums")
    return crc.PackedChecksums(crc.grid_counts(shape, chunks), table, per_chunk if block else 0), block


def _read_table_file(body: Dict[str, Any], where: str,
                     fetch: Optional[Callable[[str], Optional[bytes]]]) -> Optional[np.ndarray]:
    """Version 4: the checksum table file named in metadata.json, checked against its length and crc32."""
    entry = body.get("checksum_table")
    if entry is None:
        return None
    w = f"{where}.checksum_table"
    expect(isinstance(entry, dict), w, "entry is not an object")
    path = safe_relative_path(entry.get("path"), w)
    nbytes = check_int(entry.get("nbytes"), w, 0, 1 << 40)
    expected = check_int(entry.get("crc32"), w, 0, (1 << 32) - 1)
    expect(nbytes % 4 == 0, w, "nbytes is not a multiple of 4")
    raw = fetch(path) if fetch is not None else None
    if raw is None:
        raise MetadataError(f"{where}: its checksum table {path!r} is missing; the checkpoint is incomplete or "
                            "damaged (it cannot be verified, so it is not loaded)")
    if len(raw) != nbytes or zlib.crc32(raw) != expected:
        raise MetadataError(f"{where}: its checksum table {path!r} fails its length/crc32 check "
                            f"({len(raw)} bytes, expected {nbytes}); the checkpoint is damaged")
    return np.frombuffer(raw, dtype="<u4")


def _array_to_json_v2(a: ArrayMeta) -> Dict[str, Any]:
    """Block checksums (block_bytes > 0) are base64 of the little-endian uint32 crc32 of each block."""
    body = {"path": a.path, "shape": list(a.shape), "chunks": list(a.chunks), "dtype": a.dtype}
    if not a.block_bytes:
        return {**body, "checksums": {k: int(v) for k, v in a.checksums.items()}}
    sums = {k: base64.b64encode(struct.pack(f"<{len(v)}I", *v)).decode("ascii") for k, v in a.checksums.items()}
    return {**body, "block_bytes": a.block_bytes, "checksums": sums}


def blocks_per_chunk(chunks: Tuple[int, ...], dtype: str, block_bytes: int) -> int:
    return max(1, -(-math.prod(chunks) * dtype_itemsize(dtype) // block_bytes))


def _parse_sums(a: Dict[str, Any], chunks: Tuple[int, ...], dtype: str, version: int, w: str
                ) -> Tuple[Dict[str, Any], int]:
    sums = a.get("checksums", {})
    expect(isinstance(sums, dict) and all(isinstance(k, str) and len(k) < 256 for k in sums), w,
            "checksums malformed")
    block = a.get("block_bytes", 0)
    if version < 2 or block == 0:
        return {k: check_int(v, w, 0, (1 << 32) - 1) for k, v in sums.items()}, 0
    block = check_int(block, w, 1, 1 << 40)
    n = blocks_per_chunk(chunks, dtype, block)
    out = {}
    for k, v in sums.items():
        expect(isinstance(v, str) and len(v) == 4 * -(-4 * n // 3), w, f"chunk {k!r:.40}: expected {n} block checksums")
        try:
            raw = base64.b64decode(v.encode("ascii"), validate=True)
        except ValueError:
            raw = b""
        expect(len(raw) == 4 * n, w, f"chunk {k!r:.40}: block checksums are not base64 of {n} uint32")
        out[k] = struct.unpack(f"<{n}I", raw)
    return out, block


def _parse(body: Any, where: str, fetch: Optional[Callable[[str], Optional[bytes]]] = None) -> Metadata:
    expect(isinstance(body, dict), where, "top level is not an object")
    expect(body.get("format") == FORMAT_NAME, where, f"format is {body.get('format')!r:.40}, not {FORMAT_NAME!r}")
    version = check_int(body.get("version"), f"{where}.version", 0, 1 << 30)
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: checkpoint format version {version} is newer than this bytecheckpoint "
            f"understands ({FORMAT_VERSION}); upgrade bytecheckpoint to load it")
    checksum = body.pop("checksum", None)
    if checksum is not None:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        expect(zlib.crc32(canonical.encode()) == checksum, where, "metadata checksum mismatch")
    save_id = body.get("save_id")
    expect(isinstance(save_id, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", save_id or "") is not None,
            where, "bad save_id")
    world = check_int(body.get("world_size"), f"{where}.world_size", 1, 1 << 24)

    table_file = _read_table_file(body, where, fetch) if version >= 4 else None
    packs: Tuple[str, ...] = ()
    if version >= PACKED_VERSION:
        raw_packs = body.get("packs")
        expect(isinstance(raw_packs, list) and len(raw_packs) <= (1 << 24), where, "packs is not a list")
        packs = tuple(safe_relative_path(p, f"{where}.packs") for p in raw_packs)
    views: Dict[str, Tuple[int, ...]] = {}
    if version >= SAFETENSORS_VERSION:
        raw_views = body.get("safetensors")
        expect(isinstance(raw_views, dict) and len(raw_views) <= (1 << 16), where, "safetensors is not an object")
        for k, v in raw_views.items():
            expect(isinstance(k, str) and 0 < len(k) < 4096 and isinstance(v, list) and v, where,
                   f"safetensors entry {k!r:.60} malformed")
            views[k] = tuple(check_int(i, f"{where}.safetensors", 0, len(packs) - 1) for i in v)
            expect(all(packs[i].endswith(".safetensors") for i in views[k]), where,
                   f"safetensors entry {k!r:.60} names a pack that is not a .safetensors file")
    arrays_raw = body.get("arrays")
    expect(isinstance(arrays_raw, dict), where, "arrays is not an object")
    arrays: Dict[str, ArrayMeta] = {}
    for path, a in arrays_raw.items():
        w = f"{where}.arrays[{path!r:.60}]"
        safe_relative_path(path, w)
        expect(isinstance(a, dict) and a.get("path") == path, w, "array entry malformed")
        expect(isinstance(a.get("dtype"), str) and a["dtype"] in DTYPES, w, f"unknown dtype {a.get('dtype')!r:.40}")
        shape = check_ints(a.get("shape"), w)
        chunks = check_ints(a.get("chunks"), w, len(shape))
        expect(math.prod(shape) <= MAX_ELEMENTS and all(c >= 1 for c in chunks), w, "absurd shape or chunks")
        # every chunk has a checksum: bounds the chunk count by the metadata's own size
        n_chunks = math.prod(-(-s // c) for s, c in zip(shape, chunks)) if shape else 1
        if version >= 3:
            sums, block = _parse_packed(a, shape, chunks, a["dtype"], n_chunks, w, table_file)
        else:
            sums, block = _parse_sums(a, chunks, a["dtype"], version, w)
            expect(n_chunks == len(sums), w, f"{n_chunks} chunks but {len(sums)} checksums")
        locations: Mapping[str, Any] = {}
        if version >= PACKED_VERSION and ("at" in a or "at_at" in a):
            locations = _parse_locations(a, shape, chunks, n_chunks, len(packs), w, table_file)
        arrays[path] = ArrayMeta(path, shape, chunks, a["dtype"], sums, block, locations, packs)

    tables = parse_tables(body.get("meshes", []) if version >= 3 else [], world, where)
    tensors_raw = body.get("tensors")
    expect(isinstance(tensors_raw, dict), where, "tensors is not an object")
    tensors: Dict[str, TensorMeta] = {}
    for key, t in tensors_raw.items():
        w = f"{where}.tensors[{key!r:.60}]"
        expect(isinstance(t, dict), w, "entry is not an object")
        expect(isinstance(t.get("dtype"), str) and t["dtype"] in DTYPES, w, f"unknown dtype {t.get('dtype')!r:.40}")
        shape = check_ints(t.get("shape"), w)
        expect(math.prod(shape) <= MAX_ELEMENTS, w, "absurd shape")
        expect(t.get("layout") in ("replicated", "sharded", "flat"), w, "bad layout")
        holders = check_int(t.get("holders"), w, 0, world)
        if version >= 3 and "grid" in t:
            expect("regions" not in t, w, "both grid and regions")
            tensors[key] = parse_grid_tensor(key, t, shape, holders, arrays, tables, world, w)
            continue
        regions_raw = t.get("regions")
        expect(isinstance(regions_raw, list), w, "regions is not a list")
        regions = []
        default = t.get("array")
        for r in regions_raw:
            expect(isinstance(r, list) and len(r) in (3, 5), w, "region malformed")
            offs, lens = check_ints(r[0], w, len(shape)), check_ints(r[1], w, len(shape))
            expect(all(o + l <= s for o, l, s in zip(offs, lens, shape)), w, "region outside the tensor")
            name = r[3] if len(r) == 5 else default
            arr = arrays.get(name) if isinstance(name, str) else None
            expect(arr is not None, w, f"region names unknown array {name!r:.60}")
            aoffs = check_ints(r[4], w, len(arr.shape)) if len(r) == 5 else offs
            expect(len(arr.shape) == len(shape) and arr.dtype == t["dtype"] and
                    all(o + l <= s for o, l, s in zip(aoffs, lens, arr.shape)), w, "region outside its array")
            regions.append(RegionMeta(offs, lens, name, aoffs, check_int(r[2], w, 0, world - 1)))
        tensors[key] = TensorMeta(key, t["dtype"], shape, t["layout"], holders, tuple(regions))

    objects_raw = body.get("objects")
    expect(isinstance(objects_raw, list), where, "objects is not a list")
    objects = []
    for o in objects_raw:
        w = f"{where}.objects"
        expect(isinstance(o, dict), w, "entry is not an object")
        objects.append(ObjectFileMeta(check_int(o.get("rank"), w, 0, world - 1), safe_relative_path(o.get("path"), w),
                                      check_int(o.get("nbytes"), w, 0, 1 << 40), check_int(o.get("crc32"), w, 0, (1 << 32) - 1)))
    info = body.get("info", {})
    expect(isinstance(info, dict), where, "info is not an object")
    if "data_dir" in info:
        expect(isinstance(info["data_dir"], str) and re.fullmatch(r"(data|part)-[A-Za-z0-9_-]{1,64}", info["data_dir"])
                is not None, where, "bad data_dir")
    _check_structure(body.get("structure"), tensors, where)
    owners = body.get("object_owners", {})
    expect(isinstance(owners, dict) and len(owners) <= (1 << 24), where, "object_owners is not an object")
    for k, r in owners.items():
        expect(isinstance(k, str) and len(k) < 65536, where, "object_owners has a malformed key")
        check_int(r, f"{where}.object_owners", 0, world - 1)
    return Metadata(version, save_id, world, tensors, arrays, tuple(objects), body.get("structure"), info, packs,
                    views, dict(owners))


def _check_structure(node: Any, tensors: Mapping[str, TensorMeta], where: str, depth: int = 0) -> None:
    """The nesting tree: {"dict": [[key, node]...]}, {"list"|"tuple": [...]}, {"tensor": key},
    {"object": key}; tensor leaves must name saved tensors."""
    expect(depth < 256 and isinstance(node, dict) and len(node) == 1, where, "structure malformed")
    kind, body = next(iter(node.items()))
    if kind == "dict":
        expect(isinstance(body, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in body), where,
                "structure malformed")
        for _, child in body:
            _check_structure(child, tensors, where, depth + 1)
    elif kind in ("list", "tuple"):
        expect(isinstance(body, list), where, "structure malformed")
        for child in body:
            _check_structure(child, tensors, where, depth + 1)
    elif kind == "tensor":
        expect(isinstance(body, str) and body in tensors, where, f"structure names unknown tensor {body!r:.60}")
    else:
        expect(kind == "object" and isinstance(body, str), where, "structure malformed")

