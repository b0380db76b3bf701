"""Chunk-level tensor I/O through the Storage interface: chunk bytes, where they live, checksums.

A chunk's bytes are a C-order little-endian run of its elements (zarr v3's "bytes" codec). Format
5 stores them inside a rank's pack files (packs.py; `chunk_location` gives pack and offset);
formats 1-4 stored each chunk as its own object, at zarr v3's default chunk key `c/i/j/...` of a
zarr array, which these readers still open. The hot paths move whole chunks (or the checksum
blocks a read needs) through the storage themselves: measured on this project's benchmark,
reading through tensorstore's zarr3 driver (decode + copy into a fresh array + crc32c codec) was
4-8x slower than a kvstore read plus one copy into the target tensor.

Checksums (format 2): the zlib crc32 of every BLOCK_BYTES-long block of a chunk is recorded in
the global metadata, so a load that needs only part of a chunk (a resharding boundary) reads just
the blocks that hold that part, and still checks every byte it reads. Format-1 arrays carry one
crc32 per chunk and are read whole. crc32 runs through ISA-L (`isal`, same polynomial and values
as zlib, several times faster) when it is installed, else zlib.

Because the save planner aligns chunk grids with the saved boxes, every chunk is written whole
by exactly one rank: no read-modify-write, no locking.
"""
from __future__ import annotations

import itertools
import math
import warnings
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..common import dtypes
from ..common.errors import CheckpointError, CorruptCheckpointError
from ..format.metadata import ArrayMeta, dtype_itemsize

try:  # ISA-L's crc32: the zlib polynomial and values, ~4x faster than zlib's (measured: docs/results.md)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - optional accelerator
    from zlib import crc32 as _crc32

# torch warns that a read-only buffer (a storage's bytes) makes a writable tensor: these tensors are
# only ever copied out of. Filtered once, for calls from this module only: a catch_warnings() block
# around the call would change the process-wide filters while other threads run (loads run here on
# worker threads; training runs beside an async save).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)

# Chunks are checksummed per block of this many bytes (format 2), the unit of a verified range read.
BLOCK_BYTES = 1 << 20  # the format's checksum block (recorded per array: readers take it from the metadata)

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]


def chunk_key(array_path: str, index: Sequence[int]) -> str:
    return f"{array_path}/c/" + "/".join(map(str, index)) if index else f"{array_path}/c"


def chunk_location(meta: ArrayMeta, index: Sequence[int]) -> Tuple[str, Optional[int]]:
    """Where a stored chunk's bytes are: (pack file, byte offset) in format 5, else (its own
    file, None)."""
    if meta.locations:
        pack, low, high = meta.locations[chunk_name(index)]
        return meta.pack_files[pack], low | (high << 32)
    return chunk_key(meta.path, index), None


def describe_chunk(meta: ArrayMeta, index: Sequence[int]) -> str:
    key, offset = chunk_location(meta, index)
    return key if offset is None else f"{chunk_name(index)} of {meta.path} (in {key} at byte {offset})"


def _read_whole_chunk(storage, meta: ArrayMeta, index: Sequence[int]):
    key, offset = chunk_location(meta, index)
    if offset is None:
        return storage.read(key)
    return storage.read_range(key, offset, offset + chunk_bytes_len(meta))


def chunk_extent(meta: ArrayMeta, index: Sequence[int]) -> Tuple[int, ...]:
    """The shape of the chunk's part inside the array (an edge chunk is stored padded to the full
    chunk shape; the padding is nobody's data)."""
    return tuple(min(c, s - i * c) for c, s, i in zip(meta.chunks, meta.shape, index))


def chunk_name(index: Sequence[int]) -> str:
    """How a chunk is named in the metadata's checksum table."""
    return ".".join(map(str, index)) if index else "c"


def chunks_in_box(meta: ArrayMeta, box: Box) -> Iterator[Tuple[Tuple[int, ...], Box]]:
    """(chunk index, overlap of the chunk with `box`) for every chunk that `box` touches."""
    offs, lens = box
    if any(n == 0 for n in lens):
        return
    ranges = [range(o // c, (o + n - 1) // c + 1) for o, n, c in zip(offs, lens, meta.chunks)]
    for index in itertools.product(*ranges):
        lo = [max(o, i * c) for o, i, c in zip(offs, index, meta.chunks)]
        hi = [min(o + n, (i + 1) * c, s) for o, n, i, c, s in zip(offs, lens, index, meta.chunks, meta.shape)]
        yield tuple(index), (tuple(lo), tuple(h - l for l, h in zip(lo, hi)))


def _slices(box: Box, origin: Sequence[int]) -> Tuple[slice, ...]:
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(box[0], box[1], origin))


_NO_NUMPY = dtypes.NUMPY_STAND_IN


def _bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of the tensor's bytes (any dtype, incl. bf16/float8) with its shape."""
    return t.view(_NO_NUMPY[t.dtype]).numpy() if t.dtype in _NO_NUMPY else t.numpy()


def encode_box(meta: ArrayMeta, array_offsets: Sequence[int], data: torch.Tensor
               ) -> List[Tuple[Tuple[int, ...], np.ndarray]]:
    """(chunk index, payload) of every chunk of the box at `array_offsets` (whole chunks only), as
    bytes to write (no copy unless an edge chunk is padded)."""
    box = (tuple(array_offsets), tuple(data.shape))
    bits = _bits(data.detach().cpu() if data.is_cuda else data.detach())
    encoded = []
    for index, part in chunks_in_box(meta, box):
        chunk_shape = chunk_extent(meta, index)
        if part[1] != chunk_shape:
            raise CheckpointError(f"internal: box {box} does not cover chunk {index} of {meta.path} whole")
        payload = bits[_slices(part, box[0])]
        full = tuple(meta.chunks)
        if chunk_shape != full:  # zarr stores edge chunks at full size, padded with the fill value
            padded = np.zeros(full, dtype=payload.dtype)
            padded[tuple(slice(0, n) for n in chunk_shape)] = payload
            payload = padded
        encoded.append((index, payload))
    if not box[1]:  # 0-d array: a single chunk
        encoded.append(((), bits))
    return encoded


ChunkRef = Tuple[str, Tuple[int, ...]]  # (array path, chunk index)


def chunk_nbytes(meta: ArrayMeta, itemsize: int) -> int:
    n = itemsize
    for c in meta.chunks:
        n *= c
    return n


def chunk_parts(meta: ArrayMeta, box: Box, dest: torch.Tensor) -> Iterator[Tuple[Tuple[int, ...], Box, torch.Tensor]]:
    """For a box of the array and a destination of shape box[1]: (chunk index, part of the chunk in
    array coordinates, the view of `dest` it goes to), for every chunk the box touches."""
    if not box[1] and not meta.shape:  # 0-d array
        yield (), ((), ()), dest
        return
    for index, part in chunks_in_box(meta, box):
        yield index, part, dest[_slices(part, box[0])]


def chunk_tensor(raw, meta: ArrayMeta, dtype: torch.dtype) -> torch.Tensor:
    """The chunk's elements as a tensor of the chunk shape (no copy)."""
    if isinstance(raw, torch.Tensor):
        return raw.view(dtype).view(tuple(meta.chunks))  # a uint8 tensor: POSIX read or broadcast buffer
    return _from_bytes(raw, meta.chunks, dtype)


def copy_parts(chunk: torch.Tensor, index: Sequence[int], meta: ArrayMeta,
               parts: Sequence[Tuple[Box, torch.Tensor]]) -> None:
    origin = tuple(i * c for i, c in zip(index, meta.chunks))
    for part, dest in parts:
        dest.copy_(chunk[_slices(part, origin)] if part[1] else chunk)


def _bytes_view(raw) -> memoryview:
    if isinstance(raw, torch.Tensor):
        return memoryview(raw.numpy()).cast("B")
    return memoryview(raw).cast("B") if not isinstance(raw, memoryview) or raw.format != "B" else raw


def crc32(raw, value: int = 0) -> int:
    return _crc32(_bytes_view(raw), value)


def block_checksums(data: memoryview, block: int) -> Tuple[int, ...]:
    """crc32 of every `block`-long piece of `data` (one value for empty data)."""
    if not len(data):
        return (_crc32(data),)
    return tuple(_crc32(data[i:i + block]) for i in range(0, len(data), block))


def _stream_blocks(bufs: Sequence[memoryview], block: int) -> Iterator[int]:
    """crc32 per `block` bytes of the concatenation of `bufs` (no copy)."""
    crc, filled = 0, 0
    for b in bufs:
        pos = 0
        while pos < len(b):
            take = min(block - filled, len(b) - pos)
            crc = _crc32(b[pos:pos + take], crc)
            filled += take
            pos += take
            if filled == block:
                yield crc
                crc, filled = 0, 0
    if filled:
        yield crc


def _corrupt(meta: ArrayMeta, index: Sequence[int], what: str, where: str = "") -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{what}: chunk {describe_chunk(meta, index)}{where} fails its crc32 checksum; the "
                                  f"checkpoint is damaged (run `python -m bytecheckpoint verify` for a report)")


def check(raw, meta: ArrayMeta, index: Sequence[int], what: str, crc: Optional[int] = None) -> None:
    """Check a whole chunk's bytes against its checksum(s)."""
    if meta.unchecked:
        return
    want = meta.checksums.get(chunk_name(index))
    if meta.block_bytes and want is not None:
        if tuple(_stream_blocks([_bytes_view(raw)], meta.block_bytes)) != tuple(want):
            raise _corrupt(meta, index, what)
        return
    if want is None or (crc32(raw) if crc is None else crc) != want:
        raise _corrupt(meta, index, what)


def check_range(bufs: Sequence[memoryview], start: int, meta: ArrayMeta, index: Sequence[int], what: str) -> None:
    """Check bytes [start, start + total) of a chunk, held in `bufs` back to back; start is a block
    boundary and the range ends at one or at the chunk's end (see block_range)."""
    if meta.unchecked:
        return
    want = meta.checksums.get(chunk_name(index))
    first = start // meta.block_bytes
    got = tuple(_stream_blocks(bufs, meta.block_bytes))
    if want is None or got != tuple(want[first:first + len(got)]):
        raise _corrupt(meta, index, what, f" (bytes {start}..{start + sum(len(b) for b in bufs)})")


# ------------------------------------------------------------------ reading parts of chunks

def chunk_bytes_len(meta: ArrayMeta) -> int:
    return math.prod(meta.chunks) * dtype_itemsize(meta.dtype)


def part_span(meta: ArrayMeta, index: Sequence[int], part: Box) -> Tuple[int, int, bool]:
    """(first byte, end byte, contiguous) of a part (array coordinates) inside its stored chunk."""
    if not meta.chunks:
        return 0, dtype_itemsize(meta.dtype), True
    isz = dtype_itemsize(meta.dtype)
    origin = [i * c for i, c in zip(index, meta.chunks)]
    lo = [o - b for o, b in zip(part[0], origin)]
    hi = [o + n - 1 for o, n in zip(lo, part[1])]
    first = int(np.ravel_multi_index(lo, meta.chunks))
    last = int(np.ravel_multi_index(hi, meta.chunks))
    return first * isz, (last + 1) * isz, last - first + 1 == math.prod(part[1])


def block_range(meta: ArrayMeta, start: int, stop: int) -> Tuple[int, int]:
    """[start, stop) widened to whole checksum blocks (the whole chunk for format-1 arrays)."""
    total = chunk_bytes_len(meta)
    if not meta.block_bytes:
        return 0, total
    b = meta.block_bytes
    return start // b * b, min(total, -(-stop // b) * b)


class ChunkRead:
    """One stored chunk read for the parts of it a load needs, and checked.

    - the whole chunk lands in one contiguous destination: read straight into it;
    - one contiguous part into a contiguous destination: a range read of the blocks that hold it,
      scattered into [head scratch, destination, tail scratch] (no copy), every block checked;
    - otherwise: the blocks that hold the parts (the whole chunk for format-1 arrays) are read
      into a buffer, checked, and the parts copied out.
    """

    def __init__(self, storage, meta: ArrayMeta, index: Tuple[int, ...], parts, keep: bool = False):
        """keep=True: read the whole chunk and keep its bytes as `raw` (a uint8 tensor) after finish()."""
        self.meta, self.index, self.parts = meta, index, parts
        self.raw: Optional[torch.Tensor] = None
        self.key, base = chunk_location(meta, index)
        self.base = base or 0
        self.view: Optional[memoryview] = None
        self.bufs: Optional[List[memoryview]] = None
        self.buffer: Optional[torch.Tensor] = None
        total = chunk_bytes_len(meta)
        if lands_whole(meta, parts):
            self.req, self.view = start_read_into(storage, meta, index, parts[0][1])
            return
        spans = [part_span(meta, index, part) for part, _ in parts]
        if keep or not spans:
            lo, hi = 0, total
            self.start, self.stop = 0, total
        else:
            lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
            self.start, self.stop = block_range(meta, lo, hi)
        if (self.start, self.stop) == (0, total):
            self.req = _read_whole_chunk(storage, meta, index)
            return
        if len(parts) == 1 and spans[0][2] and _flat_cpu(parts[0][1]):
            dest = uint8_view(parts[0][1])
            head = memoryview(bytearray(lo - self.start))
            tail = memoryview(bytearray(self.stop - hi))
            self.bufs = [b for b in (head, dest, tail) if len(b)]
            self.req = storage.read_range_into(self.key, self.base + self.start, self.bufs)
            return
        self.buffer = torch.empty(total, dtype=torch.uint8)  # only the read range is touched
        self.bufs = [memoryview(self.buffer[self.start:self.stop].numpy())]
        self.req = storage.read_range_into(self.key, self.base + self.start, self.bufs)

    def finish(self, what: str, dtype: torch.dtype) -> int:
        """Wait, check, copy into place; returns the bytes read."""
        if self.view is not None:
            n = finish_read_into(self.req, self.view, self.meta, self.index, what)
            self.raw = as_uint8_view(self.parts[0][1])
            return n
        if self.bufs is None:  # the whole chunk, through a buffer
            raw = chunk_bytes(self.req, self.meta, self.index, what)
            copy_parts(chunk_tensor(raw, self.meta, dtype), self.index, self.meta, self.parts)
            self.raw = as_uint8(raw)
            return len(raw)
        wait_for(self.req, self.key, what)
        check_range(self.bufs, self.start, self.meta, self.index, what)
        if self.buffer is not None:
            copy_parts(chunk_tensor(self.buffer, self.meta, dtype), self.index, self.meta, self.parts)
        return self.stop - self.start


def _flat_cpu(t: torch.Tensor) -> bool:
    return t.is_contiguous() and not t.is_cuda


def as_uint8_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor (a view, no copy)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def uint8_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, as a flat memoryview (no copy)."""
    return memoryview(as_uint8_view(t).numpy()).cast("B")


def wait_for(request, key: str, what: str):
    """A request's result; a failed read is a CheckpointError naming `key`, a missing object a
    CorruptCheckpointError."""
    try:
        got = request.result()
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed read is a clean, named error on every path
        raise CheckpointError(f"reading {what} ({key}) failed: {exc}") from exc
    if got is None:
        raise CorruptCheckpointError(f"{what}: chunk {key} is missing; the checkpoint is damaged")
    return got


def start_chunk_reads(storage, refs: Sequence[Tuple[ArrayMeta, Tuple[int, ...]]]) -> List[object]:
    """Start reading whole chunks (all in flight for object stores; run lazily on the worker that
    waits, for local files)."""
    return [_read_whole_chunk(storage, meta, index) for meta, index in refs]


def lands_whole(meta: ArrayMeta, parts, any_device: bool = False) -> bool:
    """A chunk that fills one contiguous CPU destination is read straight into it (no copy);
    any_device: a destination on any device (the pinned path uploads into it directly)."""
    if len(parts) != 1:
        return False
    part, dest = parts[0]
    return tuple(part[1]) == tuple(meta.chunks) and dest.is_contiguous() and (any_device or not dest.is_cuda)


def start_read_into(storage, meta: ArrayMeta, index: Sequence[int], dest: torch.Tensor):
    view = uint8_view(dest)  # a view: dest is contiguous (0-d tensors too)
    key, offset = chunk_location(meta, index)
    if offset is None:
        return storage.read_into(key, view), view
    return storage.read_range_into(key, offset, [view]), view


def finish_read_into(request, view: memoryview, meta: ArrayMeta, index: Sequence[int], what: str) -> int:
    wait_for(request, describe_chunk(meta, index), what)
    check(view, meta, index, what)
    return len(view)


def chunk_bytes(fut, meta: ArrayMeta, index: Sequence[int], what: str, verify: bool = True) -> bytes:
    """Wait for one whole-chunk read and check it."""
    value = wait_for(fut, describe_chunk(meta, index), what)
    if verify:
        check(value, meta, index, what)
    return value


def as_uint8(raw) -> torch.Tensor:
    return raw if isinstance(raw, torch.Tensor) else _from_bytes(raw, (len(raw),), torch.uint8)


def _from_bytes(raw: bytes, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).view(tuple(shape))


