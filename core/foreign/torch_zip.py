"""Where the bytes of one `torch.save(tensor)` archive are, without unpickling it (pure).

PyTorch DCP's FileSystemWriter stores every tensor chunk as a whole torch.save zip archive inside
a `.distcp` file. The tensor's bytes are the archive's `*/data/0` record, stored (not compressed),
64-byte aligned, with the zip's CRC-32, which is the same zlib crc32 our chunk checksums use. So a
DCP chunk can be read like one of our chunks, straight into its target: what is needed is where
that record starts, its crc32, and proof that its bytes are the tensor in C order (the archive's
`data.pkl` names size, stride, storage offset and dtype; a transposed tensor is saved with its
strides, and reading its storage as C order would be silently wrong).

Parsing needs the archive's tail (central directory) and the start of `data.pkl`; `Blob` reads
them from windows fetched in bulk and asks `fetch` for anything outside them.
"""
from __future__ import annotations

import io
import math
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..common.errors import CorruptCheckpointError

HEAD_BYTES = 1024   # data.pkl of one tensor: ~200 bytes after a 64-byte local header
TAIL_BYTES = 2048   # the records after the data (version, serialization id) + central directory + EOCD
WHOLE_BYTES = 64 << 10  # archives up to this size are fetched whole

_EOCD = b"PK\x05\x06"
_EOCD64 = b"PK\x06\x06"
_LOCATOR64 = b"PK\x06\x07"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"


@dataclass(frozen=True)
class Record:
    name: str
    header: int      # local header offset inside the archive
    crc32: int
    size: int
    flags: int


@dataclass(frozen=True)
class TensorBytes:
    """The stored tensor of an archive: its bytes are [start, start + nbytes) of the archive."""
    start: int
    nbytes: int
    crc32: int
    dtype: torch.dtype
    shape: Tuple[int, ...]


class Blob:
    """The bytes of one archive of `length` bytes, from prefetched windows {start: bytes} (archive
    offsets), with `fetch(start, stop)` for what they do not hold."""

    def __init__(self, length: int, windows: Dict[int, bytes], fetch: Callable[[int, int], bytes], where: str):
        self.length, self.windows, self.fetch, self.where = length, windows, fetch, where

    def get(self, start: int, stop: int) -> bytes:
        if start < 0 or stop > self.length or start > stop:
            raise self.corrupt(f"a record points outside the archive ([{start}, {stop}) of {self.length} bytes)")
        for at, data in self.windows.items():
            if at <= start and stop <= at + len(data):
                return data[start - at:stop - at]
        data = self.fetch(start, stop)
        if len(data) != stop - start:
            raise self.corrupt(f"read {len(data)} of {stop - start} bytes: the file is truncated")
        return data

    def corrupt(self, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: not a readable torch.save archive ({msg}); the checkpoint is "
                                      f"damaged or truncated")


def windows(length: int) -> List[Tuple[int, int]]:
    """The archive ranges to fetch ahead: all of a small archive, else its head and tail."""
    if length <= WHOLE_BYTES:
        return [(0, length)]
    return [(0, HEAD_BYTES), (length - TAIL_BYTES, length)]


def records(blob: Blob) -> Tuple[List[Record], int]:
    """Every record of the archive from its central directory, in archive order, and where that
    directory starts (the end of the last record)."""
    tail_at = max(0, blob.length - TAIL_BYTES)
    tail = blob.get(tail_at, blob.length)
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        raise blob.corrupt("no end-of-central-directory record")
    count, cd_size, cd_offset = struct.unpack_from("<HII", tail, at + 10)
    if 0xFFFFFFFF in (cd_size, cd_offset) or count == 0xFFFF:
        loc = at - 20
        if loc < 0 or tail[loc:loc + 4] != _LOCATOR64:
            raise blob.corrupt("zip64 locator missing")
        (eocd64,) = struct.unpack_from("<Q", tail, loc + 8)
        rec = blob.get(eocd64, eocd64 + 56)
        if rec[:4] != _EOCD64:
            raise blob.corrupt("zip64 end record missing")
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", rec, 32)
    if cd_offset + cd_size > blob.length or count > 4096:
        raise blob.corrupt("central directory out of range")
    cd = blob.get(cd_offset, cd_offset + cd_size)
    out, p = [], 0
    for _ in range(count):
        if cd[p:p + 4] != _CENTRAL:
            raise blob.corrupt("bad central directory entry")
        flags, method, crc, csize, usize, nl, el, cl = struct.unpack_from("<HHxxxxIIIHHH", cd, p + 8)
        (header,) = struct.unpack_from("<I", cd, p + 42)
        name = cd[p + 46:p + 46 + nl].decode("utf-8", "replace")
        extra = cd[p + 46 + nl:p + 46 + nl + el]
        if 0xFFFFFFFF in (csize, usize, header):
            usize, csize, header = _zip64_sizes(extra, usize, csize, header, blob)
        if method != 0:
            raise blob.corrupt(f"record {name!r} is compressed")
        out.append(Record(name, header, crc, csize, flags))
        p += 46 + nl + el + cl
    return sorted(out, key=lambda r: r.header), cd_offset


def _zip64_sizes(extra: bytes, usize: int, csize: int, header: int, blob: Blob) -> Tuple[int, int, int]:
    p = 0
    while p + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, p)
        if tag == 1:
            values = list(struct.unpack_from(f"<{n // 8}Q", extra, p + 4))
            if usize == 0xFFFFFFFF:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF:
                csize = values.pop(0)
            if header == 0xFFFFFFFF:
                header = values.pop(0)
            return usize, csize, header
        p += 4 + n
    raise blob.corrupt("zip64 sizes missing")


def data_start(blob: Blob, rec: Record, end: int) -> int:
    """Where a record's data starts. torch writes sizes after the data (a data descriptor) and pads
    local headers to align data to 64 bytes, so the data is found from its end: the next record's
    header (`end`) less the descriptor, checked by its signature and crc32."""
    if not rec.flags & 0x8:
        return end - rec.size
    for length, signed in ((16, True), (24, True), (12, False), (20, False)):
        at = end - length
        if at - rec.size < rec.header + 30:
            continue
        desc = blob.get(at, end)
        body = desc[4:] if signed else desc
        if (desc[:4] == _DESCRIPTOR) == signed and struct.unpack_from("<I", body)[0] == rec.crc32:
            return at - rec.size
    raise blob.corrupt(f"record {rec.name!r}: no data descriptor")


def tensor_bytes(blob: Blob) -> TensorBytes:
    """The one tensor an archive holds, located and checked to be stored whole in C order."""
    recs, cd_offset = records(blob)
    ends = [r.header for r in recs[1:]] + [cd_offset]
    pkl_at = [i for i, r in enumerate(recs) if r.name.endswith("/data.pkl")]
    data_at = [i for i, r in enumerate(recs) if r.name.endswith("/data/0")]
    if len(pkl_at) != 1 or len(data_at) != 1 or any(r.name.split("/")[-2] == "data" for r in recs
                                                      if not r.name.endswith("/data/0")):
        raise blob.corrupt(f"records {[r.name for r in recs]} are not one tensor's")
    pkl_rec, pkl_end = recs[pkl_at[0]], ends[pkl_at[0]]
    start = data_start(blob, pkl_rec, pkl_end)
    pkl = blob.get(start, start + pkl_rec.size)
    dtype, storage_numel, offset, shape, stride = _tensor_record(pkl, blob)
    rec, end = recs[data_at[0]], ends[data_at[0]]
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    if offset != 0 or tuple(stride) != contiguous_strides(shape) and numel > 1 or \
            storage_numel * itemsize != rec.size or numel * itemsize != rec.size:
        raise CorruptCheckpointError(
            f"{blob.where}: the stored tensor is not a whole C-order storage (shape {list(shape)}, stride "
            f"{list(stride)}, storage offset {offset}, {rec.size} bytes); bytecheckpoint reads DCP chunks in place "
            f"and cannot map this one. Load it with torch.distributed.checkpoint and save it with bytecheckpoint")
    return TensorBytes(data_start(blob, rec, end), rec.size, rec.crc32, dtype, tuple(shape))


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """The strides of a C-order tensor of `shape` (as torch.save records them)."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


# ---------------------------------------------------------------- data.pkl, unpickled without executing it

class _Call:
    def __init__(self, fn: str, args: tuple = ()):
        self.fn, self.args = fn, args


class _Storage:
    def __init__(self, dtype: Optional[torch.dtype], numel: int):
        self.dtype, self.numel = dtype, numel


def _rebuild_v2(storage, offset, size, stride, *rest):
    return ("tensor", storage, offset, tuple(size), tuple(stride), None)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, *rest):
    return ("tensor", storage, offset, tuple(size), tuple(stride), dtype)


class _TensorPickle(pickle.Unpickler):
    """Admits only what torch.save writes for one plain tensor; builds descriptions, runs nothing."""

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return dict
        found = storage_or_dtype(module, name)
        if found is not None:
            return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor's record")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], tuple)):
            raise pickle.UnpicklingError(f"unexpected storage reference {pid!r:.80}")
        return _Storage(pid[1][1], int(pid[4]))


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


def storage_or_dtype(module: str, name: str) -> Any:
    """What a torch.save data.pkl names for a storage type (("typed", its dtype)) or a dtype; None for
    any other global. Shared by the unpicklers here and in torch_pickle.py: nothing is imported."""
    if module == "torch" and name.endswith("Storage"):
        return ("typed", _STORAGE_DTYPES.get(name))
    if module == "torch.storage" and name == "UntypedStorage":
        return ("typed", torch.uint8)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    return None


def _tensor_record(pkl: bytes, blob: Blob):
    try:
        value = _TensorPickle(io.BytesIO(pkl)).load()
    except Exception as exc:  # any malformed pickle: one clear error naming the archive
        raise blob.corrupt(f"its data.pkl is not one plain tensor: {exc}") from None
    if not (isinstance(value, tuple) and len(value) == 6 and value[0] == "tensor" and isinstance(value[1], _Storage)):
        raise blob.corrupt("its data.pkl is not one plain tensor")
    _, storage, offset, shape, stride, dtype = value
    dtype = dtype if dtype is not None else storage.dtype
    if not isinstance(dtype, torch.dtype):
        raise blob.corrupt("its storage type is unknown")
    numel = storage.numel
    if storage.dtype == torch.uint8 and dtype != torch.uint8:  # v3: an untyped storage counts bytes
        numel //= torch.empty((), dtype=dtype).element_size()
    return dtype, numel, int(offset), shape, stride
