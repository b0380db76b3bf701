"""PyTorch DCP checkpoints read as our own: `.metadata` + `*.distcp` (torch 2.11-2.15), including
the rank-local variant (`__<r>.metadata`, dcp.save(..., use_collectives=False)).

DCP's metadata is a pickle. It is read by an unpickler that admits only DCP's metadata classes
(and torch.Size, dtypes, layouts, paths), each rebuilt as a plain record here: nothing in the file
is executed, and any other name is refused by name. Its tensors become our Metadata: every DCP
chunk is a region held in an array of its own whose one chunk lies inside a `.distcp` file (the
tensor bytes of its torch.save archive, located by torch_zip, with the archive's crc32 as our
checksum). So the whole load path works on it unchanged: load-time resharding onto any layout,
reads straight into the target tensors, zero-redundancy sharing, verify, inspect, load_full.

Nesting comes from DCP's flatten mapping (planner_data: flat key -> path of dict keys and list
indices), so `{"model": ..., "optim": ...}` saved with dcp.save loads into the same template
through bcp.load. Non-tensor values (DCP "bytes" items, each a torch.save of the value) are read
with torch's weights_only unpickler, or a full unpickle with allow_pickle=True (DcpObjects).
"""
from __future__ import annotations

import io
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..common import dtypes
from ..common.errors import CheckpointError, CorruptCheckpointError, MetadataError
from ..format.metadata import Metadata
from ..format.records import ArrayMeta, RegionMeta, TensorMeta
from ..storage import Storage
from ..storage.chunks import chunk_name
from . import torch_zip

DCP_METADATA = ".metadata"
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
GAP_BYTES = 1 << 20      # header windows closer than this are fetched by one read
RUN_BYTES = 16 << 20     # ... up to this many bytes per read
READ_THREADS = 8


def metadata_keys(keys: Sequence[str]) -> List[str]:
    """The DCP metadata files among a checkpoint root's keys: `.metadata`, else the rank-local ones."""
    if DCP_METADATA in keys:
        return [DCP_METADATA]
    return sorted((k for k in keys if _RANK_METADATA.match(k)), key=lambda k: int(_RANK_METADATA.match(k).group(1)))


def is_dcp(store: Storage) -> bool:
    return store.get(DCP_METADATA) is not None or bool(metadata_keys(store.list()))


# ---------------------------------------------------------------- the restricted unpickler

class _Record:
    """A DCP metadata object rebuilt as plain attributes (dataclass state or __setstate__ tuple)."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


def _record(name: str):
    return type(name, (_Record,), {})


_DCP_CLASSES = {name: _record(name) for name in (
    "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "_StorageInfo")}
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": set(_DCP_CLASSES) - {"_StorageInfo"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.storage": {"_StorageInfo"},
}
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}


def _path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return _DCP_CLASSES[name]
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return str
        if module == "pathlib" and name in _PATHS:
            return _path
        if module == "collections" and name == "OrderedDict":
            return dict
        if module == "builtins" and name in ("set", "frozenset"):
            return tuple
        raise pickle.UnpicklingError(f"{module}.{name}")


def unpickle_metadata(raw: bytes, where: str) -> Any:
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise MetadataError(f"{where}: names {exc}, which is not one of DCP's metadata classes; refused without "
                            f"running anything. The file is not a PyTorch DCP metadata file (or was forged)") from None
    except Exception as exc:  # truncated / garbage bytes: any parse failure, one clear error
        raise MetadataError(f"{where}: not a readable DCP metadata pickle ({type(exc).__name__}: {exc}); the file "
                            f"is damaged") from None
    if type(md).__name__ != "Metadata" or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise MetadataError(f"{where}: not a DCP Metadata object")
    return md


# ---------------------------------------------------------------- DCP metadata -> ours

def read_metadata(store: Storage) -> Optional[Metadata]:
    """The DCP checkpoint at `store` as our Metadata, or None when there is none."""
    raw = store.get(DCP_METADATA)
    files = [DCP_METADATA] if raw is not None else metadata_keys(store.list())
    if not files:
        return None
    parsed = [unpickle_metadata(raw if raw is not None and f == DCP_METADATA else _get(store, f), store.where(f))
              for f in files]
    return _translate(store, parsed, rank_local=raw is None)


def _get(store: Storage, key: str) -> bytes:
    raw = store.get(key)
    if raw is None:
        raise CorruptCheckpointError(f"{store.where(key)} is missing")
    return raw


class _Item:
    __slots__ = ("key", "offsets", "sizes", "file", "offset", "length", "found")

    def __init__(self, key, offsets, sizes, file, offset, length):
        self.key, self.offsets, self.sizes = key, offsets, sizes
        self.file, self.offset, self.length = file, offset, length
        self.found: Optional[torch_zip.TensorBytes] = None


def _translate(store: Storage, parsed: Sequence[Any], rank_local: bool) -> Metadata:
    paths: Dict[str, Tuple[Any, ...]] = {}
    kinds: Dict[str, Any] = {}
    chunks: Dict[str, List[Any]] = {}   # rank-local metadata: every rank's file lists its own chunks
    storage: Dict[Tuple[str, Optional[Tuple[int, ...]]], Any] = {}
    for md in parsed:
        mapping = md.planner_data if isinstance(getattr(md, "planner_data", None), dict) else {}
        for fqn, value in md.state_dict_metadata.items():
            kinds.setdefault(fqn, value)
            chunks.setdefault(fqn, []).extend(getattr(value, "chunks", None) or ())
            path = mapping.get(fqn)
            paths[fqn] = tuple(path) if isinstance(path, tuple) and path and all(
                isinstance(p, (str, int)) for p in path) else (fqn,)
        for index, info in (md.storage_data or {}).items():
            offset = getattr(index, "offset", None)
            storage.setdefault((index.fqn, None if offset is None else tuple(offset)), info)
    where = store.url
    tensors, arrays, objects, items = {}, {}, {}, []
    files: Dict[str, int] = {}
    for fqn, value in kinds.items():
        key = "/".join(map(str, paths[fqn]))
        if type(value).__name__ == "BytesStorageMetadata":
            info = _info(storage, fqn, None, where)
            objects[key] = (info.relative_path, int(info.offset), int(info.length))
            continue
        if type(value).__name__ != "TensorStorageMetadata":
            raise MetadataError(f"{where}: {fqn!r} has storage metadata of type {type(value).__name__}")
        dtype = dtypes.name_of(_properties_dtype(value, fqn, where))
        shape = tuple(int(n) for n in value.size)
        seen = set()
        for chunk in chunks[fqn]:
            offsets, sizes = tuple(int(n) for n in chunk.offsets), tuple(int(n) for n in chunk.sizes)
            if offsets in seen or 0 in sizes:  # rank-local metadata repeats replicated chunks
                continue
            seen.add(offsets)
            info = _info(storage, fqn, offsets, where)
            files.setdefault(info.relative_path, len(files))
            items.append(_Item(key, offsets, sizes, info.relative_path, int(info.offset), int(info.length)))
        tensors[key] = (fqn, dtype, shape, len(seen))
    _locate(store, items)
    pack_files = tuple(files)
    regions: Dict[str, List[RegionMeta]] = {}
    for n, item in enumerate(items):
        fqn, dtype, shape, _ = tensors[item.key]
        found = item.found
        if found.shape != item.sizes or dtypes.name_of(found.dtype) != dtype:
            raise CorruptCheckpointError(
                f"{store.where(item.file)}: the chunk of {fqn!r} at offsets {list(item.offsets)} holds a "
                f"{dtypes.name_of(found.dtype)} tensor of shape {list(found.shape)}, the metadata says {dtype} "
                f"{list(item.sizes)}; the checkpoint is damaged")
        path = f"dcp/{n}"
        name = chunk_name((0,) * len(item.sizes))
        start = item.offset + found.start
        arrays[path] = ArrayMeta(path, item.sizes, item.sizes, dtype, {name: found.crc32}, 0,
                                 {name: (files[item.file], start & 0xFFFFFFFF, start >> 32)}, pack_files)
        writer = _RANK_FILE.match(item.file.rsplit("/", 1)[-1])
        regions.setdefault(item.key, []).append(RegionMeta(item.offsets, item.sizes, path, (0,) * len(item.sizes),
                                                           int(writer.group(1)) if writer else 0))
    out_tensors = {}
    for key, (fqn, dtype, shape, n) in tensors.items():
        layout = "sharded" if n > 1 else "replicated"
        out_tensors[key] = TensorMeta(key, dtype, shape, layout, max(n, 1), tuple(regions.get(key, ())))
    ranks = [int(m.group(1)) for m in (_RANK_FILE.match(f.rsplit("/", 1)[-1]) for f in files) if m]
    storage_meta = getattr(parsed[0], "storage_meta", None)
    info = {"format": "dcp", "dcp_version": getattr(parsed[0], "version", None), "rank_local": rank_local}
    return Metadata(version=0, save_id=str(getattr(storage_meta, "save_id", None) or "dcp"),
                    world_size=max(ranks) + 1 if ranks else 1, tensors=out_tensors, arrays=arrays, objects=(),
                    structure=structure(paths, {"/".join(map(str, paths[f])) for f, v in kinds.items()
                                                if type(v).__name__ == "TensorStorageMetadata"}),
                    info=info, packs=pack_files, foreign=DcpObjects(objects))


def _properties_dtype(value: Any, fqn: str, where: str) -> torch.dtype:
    props = getattr(value, "properties", None)
    dtype = getattr(props, "dtype", None)
    if dtype is None and isinstance(getattr(props, "state", None), tuple):
        dtype = props.state[0]
    if not isinstance(dtype, torch.dtype):
        raise MetadataError(f"{where}: tensor {fqn!r} has no dtype in its DCP properties")
    return dtype


def _info(storage: Mapping, fqn: str, offsets: Optional[Tuple[int, ...]], where: str) -> Any:
    info = storage.get((fqn, offsets))
    if info is None:
        raise MetadataError(f"{where}: DCP metadata lists {fqn!r}" + ("" if offsets is None else f" at offsets "
                            f"{list(offsets)}") + " but no file holds it; the checkpoint is incomplete")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{where}: {fqn!r} is stored with DCP storage extensions {info.transform_descriptors} "
                              f"(e.g. compression), which bytecheckpoint does not read yet; load it with "
                              f"torch.distributed.checkpoint")
    return info


def structure(paths: Mapping[str, Tuple[Any, ...]], tensor_keys: set) -> Any:
    """Our structure tree (docs/format.md) from DCP's flatten paths: str steps are dict keys, int
    steps list indices (0..n-1; other int keys stay a dict)."""
    from ..format import codec
    root: Dict[Any, Any] = {}
    for path in paths.values():
        node = root
        for step in path[:-1]:
            node = node.setdefault(step, {})
            if not isinstance(node, dict):
                raise MetadataError(f"DCP flatten mapping: {path!r} runs through a value")
        node[path[-1]] = "/".join(map(str, path))

    def build(node: Any) -> Any:
        if isinstance(node, str):
            return {"tensor" if node in tensor_keys else "object": node}
        keys = list(node)
        if keys and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
            return {"list": [build(node[i]) for i in range(len(keys))]}
        return {"dict": [[codec.encode(k), build(v)] for k, v in node.items()]}
    return build(root)


# ---------------------------------------------------------------- locating the tensor bytes

def _locate(store: Storage, items: List[_Item]) -> None:
    """Find every chunk's tensor bytes inside its archive: the archives' head and tail windows are
    fetched with few reads (neighbours merged, runs in parallel), then parsed."""
    spans = [(item.file, item.offset + a, item.offset + b, item) for item in items
             for a, b in torch_zip.windows(item.length)]
    windows: Dict[int, Dict[int, bytes]] = {}
    with ThreadPoolExecutor(READ_THREADS) as pool:
        for (_, start, _, item), data in _read_spans(store, spans, pool):
            windows.setdefault(id(item), {})[start - item.offset] = data

        def parse(item: _Item) -> None:
            blob = torch_zip.Blob(item.length, windows.get(id(item), {}),
                                  lambda a, b: _read(store, item.file, item.offset + a, item.offset + b),
                                  f"{store.where(item.file)} at byte {item.offset} ({item.key!r})")
            item.found = torch_zip.tensor_bytes(blob)
        list(pool.map(parse, items))


def _read_spans(store: Storage, spans: Sequence[Tuple[str, int, int, Any]], pool: ThreadPoolExecutor):
    """(span, its bytes) for every (file, start, stop, tag) span: neighbours in one file (gaps up to
    GAP_BYTES, runs up to RUN_BYTES) are fetched by one read, the runs in parallel on `pool`."""
    runs: List[List[Tuple[str, int, int, Any]]] = []
    for span in sorted(spans, key=lambda s: (s[0], s[1])):
        run = runs[-1] if runs else None
        if run and run[0][0] == span[0] and span[1] - max(s[2] for s in run) <= GAP_BYTES and \
                span[2] - run[0][1] <= RUN_BYTES:
            run.append(span)
        else:
            runs.append([span])

    def fetch(run):
        start, stop = run[0][1], max(s[2] for s in run)
        data = _read(store, run[0][0], start, stop)
        return [(s, data[s[1] - start:s[2] - start]) for s in run]
    return [got for done in pool.map(fetch, runs) for got in done]


def _read(store: Storage, key: str, start: int, stop: int) -> bytes:
    got = store.read_range(key, start, stop).result()
    if got is None:
        raise CorruptCheckpointError(f"{store.where(key)} is missing; the checkpoint is incomplete")
    data = got.numpy().tobytes() if isinstance(got, torch.Tensor) else bytes(got)
    if len(data) != stop - start:
        raise CorruptCheckpointError(f"{store.where(key)} is shorter than its metadata says; the checkpoint is "
                                     f"damaged or truncated")
    return data


# ---------------------------------------------------------------- non-tensor values

class DcpObjects:
    """The plain values of a DCP checkpoint: key -> (file, offset, length) of a torch.save of the
    value. Metadata.foreign of a DCP checkpoint (pipeline/load.py reads plain values through it)."""

    def __init__(self, where: Mapping[str, Tuple[str, int, int]]):
        self.where = dict(where)

    def read(self, store: Storage, keys: Sequence[str], allow_pickle: bool) -> Dict[str, Any]:
        spans = [(file, offset, offset + length, key) for key in keys if key in self.where
                 for file, offset, length in [self.where[key]]]
        with ThreadPoolExecutor(READ_THREADS) as pool:
            blobs = _read_spans(store, spans, pool)
        out = {}
        for (file, offset, _, key), raw in blobs:
            try:
                out[key] = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=not allow_pickle)
            except pickle.UnpicklingError as exc:
                raise CheckpointError(
                    f"{store.where(file)}: value {key!r} of this DCP checkpoint is a pickle that torch's weights_only "
                    f"loader refuses ({str(exc).splitlines()[0][:200]}). If you trust the checkpoint, load with "
                    f"allow_pickle=True") from None
            except Exception as exc:
                raise CorruptCheckpointError(f"{store.where(file)} at byte {offset}: value {key!r} cannot be read "
                                             f"({type(exc).__name__}: {exc}); the checkpoint is damaged") from None
        return out

    def problems(self, store: Storage) -> List[str]:
        """verify: every value's archive is whole (its records' crc32s match)."""
        import zipfile
        out = []
        for key, (file, offset, length) in sorted(self.where.items()):
            try:
                bad = zipfile.ZipFile(io.BytesIO(_read(store, file, offset, offset + length))).testzip()
                if bad is not None:
                    out.append(f"value {key!r} ({file} at byte {offset}): record {bad} fails its crc32")
            except (CheckpointError, zipfile.BadZipFile) as exc:
                out.append(f"value {key!r} ({file} at byte {offset}): {exc}")
        return out
