"""The metadata's vocabulary: the frozen records a checkpoint's metadata is made of (tensors,
their regions, the arrays holding them, per-rank object files, grid layouts) and the validators
that parse them strictly. A leaf below format/metadata.py (the JSON form) and format/grid_json.py (the
grid JSON form); docs/format.md is the specification."""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from ..common.dtypes import itemsize as dtype_itemsize
from ..common.errors import MetadataError
from ..geometry.grids import Geometry, RankTable

MAX_NDIM = 32
MAX_ELEMENTS = 1 << 50  # far above any real tensor; rejects absurd shapes before allocation
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.~%+=-]+(/[A-Za-z0-9_.~%+=-]+)*$")


@dataclass(frozen=True)
class RegionMeta:
    """One saved box of a logical tensor and where its bytes are."""
    offsets: Tuple[int, ...]
    lengths: Tuple[int, ...]
    array: str                      # zarr array path, relative to the checkpoint root
    array_offsets: Tuple[int, ...]  # where the box starts inside that array
    writer: int                     # rank that wrote it


@dataclass(frozen=True)
class ArrayMeta:
    path: str
    shape: Tuple[int, ...]
    chunks: Tuple[int, ...]
    dtype: str
    # chunk name ("i.j") -> zlib crc32 of the chunk (block_bytes == 0, format 1), or a tuple with
    # the crc32 of every block_bytes-long block of the chunk (the last one may be shorter)
    checksums: Mapping[str, Any] = field(default_factory=dict)
    block_bytes: int = 0
    # format 5: chunk name -> (pack file index, byte offset low 32 bits, high 32 bits) in
    # `pack_files` (the checkpoint's pack files, shared by all arrays); empty: one file per chunk
    locations: Mapping[str, Tuple[int, int, int]] = field(default_factory=dict)
    pack_files: Tuple[str, ...] = ()
    # another format's data that carries no checksum per region (a DeepSpeed partition's zip crc32
    # covers the whole partition): not checked on read; `verify` checks the whole records instead.
    # Never set for our own checkpoints (not serialized).
    unchecked: bool = False


@dataclass(frozen=True)
class TensorMeta:
    key: str
    dtype: str
    shape: Tuple[int, ...]
    layout: str                 # how it was held at save time: replicated | sharded | flat
    holders: int                # how many ranks held part of it
    regions: Sequence           # of RegionMeta; a GridRegions (generated) when `grid` is set
    grid: Optional["GridMeta"] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_itemsize(self.dtype)

    def rooted(self, prefix: str) -> "TensorMeta":
        """The same tensor with its array paths under `prefix/` (the save's data directory)."""
        if self.grid is not None:
            return grid_tensor(self.key, self.dtype, self.shape, self.layout, self.holders,
                                     replace(self.grid, array=f"{prefix}/{self.grid.array}"))
        return replace(self, regions=tuple(RegionMeta(r.offsets, r.lengths, f"{prefix}/{r.array}", r.array_offsets,
                                                      r.writer) for r in self.regions))


@dataclass(frozen=True)
class ObjectFileMeta:
    """Per-rank non-tensor values (safe JSON encoding), with a checksum."""
    rank: int
    path: str
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class GridMeta:
    """A regular (DTensor) layout, stored in one array at global offsets (docs/format.md, "grid").

    Mesh dim i shards tensor dim dims[i] (-1: replicates); `ranks[c]` is the rank at mesh
    coordinate c (row-major, -1: none). Each cell of the split is one region, cut into row blocks
    when its holders shared the write (`split_bytes`, see grids.split_rows); `choices[k]` says
    which of its cell's holders (in mesh coordinate order) wrote region k (None: the first)."""
    array: str
    mesh: Tuple[int, ...]
    dims: Tuple[int, ...]
    ranks: RankTable
    split_bytes: int
    choices: Optional[bytes] = None     # little-endian unsigned ints of `choice_width` bytes
    choice_width: int = 1
    region_arrays: bool = False         # True: region k is the whole array `<array>/r<k>`

    def array_of(self, k: int) -> str:
        return f"{self.array}/r{k}" if self.region_arrays else self.array

    def choice_array(self) -> Optional[np.ndarray]:
        if self.choices is None:
            return None
        return np.frombuffer(self.choices, dtype=f"<u{self.choice_width}")


class GridRegions(Sequence):
    """The regions of a grid tensor, generated on demand (a Sequence of RegionMeta).

    Nothing per region or per cell is kept: planners use the numpy form (`geometry()`, computed
    afresh; at 16384 ranks x 1000 tensors keeping it would hold ~1 GiB), and iterating generates
    RegionMeta objects as it goes (inspect, verify, export walk one tensor at a time)."""

    def __init__(self, shape: Tuple[int, ...], dtype: str, grid: GridMeta):
        self.shape, self.dtype, self.grid = tuple(shape), dtype, grid
        self._len: Optional[int] = None

    def geometry(self) -> Geometry:
        g = self.grid
        return Geometry(self.shape, dtype_itemsize(self.dtype), g.mesh, g.dims, g.ranks, g.split_bytes)

    def _generate(self, picks: Optional[Sequence[int]] = None) -> List[RegionMeta]:
        geo, g = self.geometry(), self.grid
        _, offsets, lengths = geo.regions()
        writers = geo.writers(g.choice_array())
        idx = range(len(writers)) if picks is None else picks
        zero = (0,) * len(self.shape)
        out = []
        for k in idx:
            o = tuple(offsets[k].tolist())
            out.append(RegionMeta(o, tuple(lengths[k].tolist()), g.array_of(k), zero if g.region_arrays else o,
                                  int(writers[k])))
        return out

    def __len__(self) -> int:
        if self._len is None:
            self._len = self.geometry().n_regions
        return self._len

    def __getitem__(self, k):
        if isinstance(k, slice):
            return self._generate(range(len(self))[k])
        n = len(self)
        if not -n <= k < n:
            raise IndexError(k)
        return self._generate([k % n])[0]

    def __iter__(self) -> Iterator[RegionMeta]:
        return iter(self._generate())

    def __eq__(self, other) -> bool:
        if isinstance(other, GridRegions) and (self.shape, self.dtype, self.grid) == (other.shape, other.dtype,
                                                                                     other.grid):
            return True
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash((self.shape, self.grid))

    def __repr__(self) -> str:
        return f"GridRegions({len(self)} regions of {self.grid.array!r})"

    def __reduce__(self):
        return GridRegions, (self.shape, self.dtype, self.grid)


def grid_tensor(key: str, dtype: str, shape: Tuple[int, ...], layout: str, holders: int, grid: GridMeta) -> TensorMeta:
    return TensorMeta(key, dtype, tuple(shape), layout, holders, GridRegions(tuple(shape), dtype, grid), grid)



# ---------------------------------------------------------------- validation

def fail(where: str, msg: str) -> MetadataError:
    return MetadataError(f"{where}: {msg}; the metadata file is damaged or not from bytecheckpoint")


def expect(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise fail(where, msg)


# The checks below run ~10 times per tensor on every load: their messages are formatted only on failure.

def check_int(v: Any, where: str, lo: int = 0, hi: int = MAX_ELEMENTS) -> int:
    if type(v) is not int or not lo <= v <= hi:  # bool is not an int here
        raise fail(where, f"expected an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def check_ints(v: Any, where: str, ndim: Optional[int] = None) -> Tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise fail(where, f"expected a list of integers, got {v!r:.80}")
    if ndim is not None and len(v) != ndim:
        raise fail(where, f"expected {ndim} dimensions, got {len(v)}")
    for x in v:
        if type(x) is not int or not 0 <= x <= MAX_ELEMENTS:
            check_int(x, where)
    return tuple(v)


def safe_relative_path(p: Any, where: str) -> str:
    """Refuse absolute paths, '..', and odd characters in stored paths."""
    if not (isinstance(p, str) and 0 < len(p) < 1024 and _SAFE_PATH.match(p) is not None) or \
            any(part in (".", "..") for part in p.split("/")):
        raise fail(where, f"unsafe path {p!r:.80}")
    return p
