"""PyTorch DCP directories written by bytecheckpoint (`convert --to dcp`), in parallel.

DCP's FileSystemWriter stores every tensor as a whole `torch.save` archive inside a `.distcp` file.
Here the archive is built directly (`tensor_archive`: the same records torch.save writes, its data
64-byte aligned, the zip's crc32 over the tensor bytes) so that a tensor goes from the source into
the file with one copy and no pickling of its data, the crc32 and the writes outside the GIL.
Several writers, each appending to a file of its own (`__0_<w>.distcp`, as DCP's thread_count
does), read and write one tensor at a time each: memory holds a tensor per writer. `.metadata`
(pickled with torch's own DCP classes) is written last, under a temporary name renamed into place:
a converted directory is complete or absent. Tensors torch.save would write differently (no
legacy storage class, over 4 GiB: zip64) go through torch.save itself.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import queue
import struct
import threading
import uuid
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..foreign.torch_zip import contiguous_strides

ALIGN = 64
_LIMIT = 0xFFFFFFFF - (1 << 20)   # archives above this need zip64: torch.save writes those


# ---------------------------------------------------------------- one tensor's torch.save archive

class _Storage:
    def __init__(self, cls: type, numel: int):
        self.cls, self.numel = cls, numel


class _Tensor:
    def __init__(self, storage: _Storage, shape: Tuple[int, ...], stride: Tuple[int, ...]):
        self.storage, self.shape, self.stride = storage, shape, stride

    def __reduce_ex__(self, protocol: int):
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, self.shape, self.stride, False,
                                                 collections.OrderedDict())


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any):
        if isinstance(obj, _Storage):
            return ("storage", obj.cls, "0", "cpu", obj.numel)
        return None


def _storage_class(dtype: torch.dtype) -> Optional[type]:
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    return getattr(torch, name, None) if name else None


def data_pkl(dtype: torch.dtype, shape: Tuple[int, ...]) -> Optional[bytes]:
    """The data.pkl torch.save writes for a C-order tensor (None: a dtype torch pickles otherwise)."""
    cls = _storage_class(dtype)
    if cls is None:
        return None
    buf = io.BytesIO()
    numel = 1
    for n in shape:
        numel *= n
    _Pickler(buf, protocol=2).dump(_Tensor(_Storage(cls, numel), tuple(shape), contiguous_strides(shape)))
    return buf.getvalue()


def tensor_archive(tensor: torch.Tensor, crc: Optional[int] = None) -> Optional[List[Any]]:
    """The parts (bytes, and the tensor's own bytes as a memoryview) of the torch.save archive of a
    contiguous CPU tensor, or None where torch.save itself must write it."""
    pkl = data_pkl(tensor.dtype, tuple(tensor.shape))
    nbytes = tensor.numel() * tensor.element_size()
    if pkl is None or nbytes > _LIMIT:
        return None
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
    sid = str(uuid.uuid4().int).rjust(40, "0")[:40].encode()
    records = [("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", str(ALIGN).encode()),
               ("byteorder", b"little"), ("data/0", data), ("version", b"3\n"), (".data/serialization_id", sid)]
    parts: List[Any] = []
    central: List[bytes] = []
    at = 0
    for name, body in records:
        full = f"archive/{name}".encode()
        start = at + 30 + len(full) + 4
        pad = -start % ALIGN
        extra = struct.pack("<HH", 0x4246, pad) + b"\0" * pad   # torch's own "FB" padding field
        body_crc = crc if name == "data/0" and crc is not None else zlib.crc32(body)
        size = len(body)
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, body_crc, size, size, len(full),
                             len(extra)) + full + extra
        central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, body_crc, size, size,
                                   len(full), 0, 0, 0, 0, 0, at) + full)
        parts += [header, body]
        at += len(header) + size
    cd = b"".join(central)
    parts += [cd, struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(records), len(records), len(cd), at, 0)]
    return parts


# ---------------------------------------------------------------- the directory

BATCH_BYTES = 32 << 20   # a writer reads this many tensor bytes at once (one planned read: less per-tensor work)


class Leaf:
    """One DCP item: `path` (DCP's flatten path) and a value; `load()` gives the tensor or value.
    A saved tensor not read yet has its `key` (read in batches through `read_many`) and `nbytes`."""

    def __init__(self, path: Tuple[Any, ...], is_tensor: bool, load: Callable[[], Any], key: Optional[str] = None,
                 nbytes: int = 0):
        self.path, self.is_tensor, self.load, self.key, self.nbytes = path, is_tensor, load, key, nbytes


def batches(leaves: Sequence[Leaf], limit: int = BATCH_BYTES) -> List[List[int]]:
    """Consecutive leaves in runs of up to `limit` tensor bytes (a bigger tensor alone)."""
    out: List[List[int]] = []
    size = 0
    for n, leaf in enumerate(leaves):
        if not out or size + leaf.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(n)
        size += leaf.nbytes
    return out


Placed = Dict[int, Tuple[str, int, int, Any]]   # leaf index -> (file, start, length, (dtype, size) | None)


def write(leaves: Sequence[Leaf], dst: str, writers: int = 4,
          progress: Optional[Callable[[int, int], None]] = None,
          read_many: Optional[Callable[[List[str]], Dict[str, torch.Tensor]]] = None) -> Tuple[int, int, int, List[str]]:
    """Write every leaf into `dst` (a directory) as DCP; returns (tensors, values, tensor bytes, files)."""
    placed = write_share(leaves, dst, 0, 1, writers, progress, read_many)
    return write_metadata(leaves, placed, dst)


def write_share(leaves: Sequence[Leaf], dst: str, rank: int, world: int, writers: int = 4,
                progress: Optional[Callable[[int, int], None]] = None,
                read_many: Optional[Callable[[List[str]], Dict[str, torch.Tensor]]] = None) -> Placed:
    """This rank's share of the leaves (batches rank, rank + world, ...) into files `__<rank>_<w>.distcp`
    of `dst`; where each leaf went (write_metadata merges every rank's)."""
    mine = batches(leaves)[rank::world]
    writers = max(1, min(writers, len(mine) or 1))
    files = [f"__{rank}_{w}.distcp" for w in range(writers)]
    todo: "queue.Queue[List[int]]" = queue.Queue()
    for batch in mine:
        todo.put(batch)
    total = sum(len(b) for b in mine)
    placed: Placed = {}
    counts = {"done": 0}
    lock = threading.Lock()
    failed: List[BaseException] = []

    def run(w: int) -> None:
        with open(os.path.join(dst, files[w]), "wb") as f:
            while not failed:
                try:
                    batch = todo.get_nowait()
                except queue.Empty:
                    break
                try:
                    keys = [leaves[n].key for n in batch if leaves[n].key is not None]
                    read = read_many(keys) if read_many is not None and keys else {}
                    for n in batch:
                        leaf = leaves[n]
                        one(f, w, n, leaf, read.pop(leaf.key) if leaf.key in read else leaf.load())
                except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                    failed.append(exc)
            f.flush()
            os.fsync(f.fileno())

    def one(f, w: int, n: int, leaf: Leaf, value: Any) -> None:
        start = f.tell()
        if leaf.is_tensor:
            tensor = value.detach().cpu().contiguous()
            parts = tensor_archive(tensor)
            if parts is None:
                torch.save(tensor, f)
            else:
                for p in parts:
                    f.write(p)
            meta = (tensor.dtype, tuple(tensor.size()))
            del tensor, value, parts
        else:
            buf = io.BytesIO()
            torch.save(value, buf)
            f.write(buf.getbuffer())
            meta = None
        with lock:
            placed[n] = (files[w], start, f.tell() - start, meta)
            counts["done"] += 1
            done = counts["done"]
        if progress:
            progress(done, total)

    threads = [threading.Thread(target=run, args=(w,), name=f"bcp-convert-{w}") for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return placed


def write_metadata(leaves: Sequence[Leaf], placed: Placed, dst: str) -> Tuple[int, int, int, List[str]]:
    """DCP's `.metadata` for the leaves as `placed` (every rank's share), written last under a
    temporary name renamed into place; returns (tensors, values, tensor bytes, files)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)
    missing = [".".join(map(str, leaves[n].path)) for n in range(len(leaves)) if n not in placed]
    if missing:
        raise RuntimeError(f"convert: no writer wrote {missing[:5]} ({len(missing)} items)")
    tensors = values = nbytes = 0
    items: Dict[str, Any] = {}
    where: Dict[Any, Any] = {}
    mapping: Dict[str, Tuple[Any, ...]] = {}
    for n, leaf in enumerate(leaves):
        fqn = ".".join(map(str, leaf.path))
        mapping[fqn] = leaf.path
        file, start, length, meta = placed[n]
        if meta is None:
            items[fqn] = BytesStorageMetadata()
            where[MetadataIndex(fqn)] = _StorageInfo(file, start, length)
            values += 1
            continue
        dtype, size = meta
        size = torch.Size(size)
        tensors += 1
        nbytes += size.numel() * torch.empty((), dtype=dtype).element_size()
        zeros = torch.Size([0] * len(size))
        items[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), size, [ChunkStorageMetadata(zeros, size)])
        where[MetadataIndex(fqn, zeros)] = _StorageInfo(file, start, length)
    md = Metadata(state_dict_metadata=items, planner_data=mapping, storage_data=where,
                  storage_meta=StorageMeta(checkpoint_id=dst, save_id=uuid.uuid4().hex))
    md.version = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION (torch 2.11-2.15)
    tmp = os.path.join(dst, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(md, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(dst, ".metadata"))  # the commit point, last
    return tensors, values, nbytes, sorted({p[0] for p in placed.values()}) + [".metadata"]
