"""Store: every tensorstore call of the library goes through here.

One Context per process (all concurrency limits), a root KvStore for small objects
(metadata, per-rank values) and zarr v3 arrays for tensor data.
"""
from __future__ import annotations

import os
import shutil
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorstore as ts
import torch

from ..errors import CheckpointError, CorruptCheckpointError
from ..metadata import ArrayMeta
from .specs import context_spec, kvstore_spec, split_url, zarr_spec

_CONTEXT_LOCK = threading.Lock()
_CONTEXT: Optional[ts.Context] = None

# torch dtype -> (same-width integer dtype for the bit-level view, tensorstore dtype)
_UINT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_EXOTIC = {torch.bfloat16: ts.bfloat16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _EXOTIC[getattr(torch, _name)] = getattr(ts, _name)


def shared_context() -> ts.Context:
    """Process-wide context so that the memory:// store and the I/O limits are shared."""
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            _CONTEXT = ts.Context(context_spec())
        return _CONTEXT


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes, typed so tensorstore stores the right dtype."""
    if t.dtype in _EXOTIC:
        return t.view(_UINT_OF_WIDTH[t.element_size()]).numpy().view(_EXOTIC[t.dtype].numpy_dtype)
    return t.numpy()


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype in _EXOTIC:
        a = a.view(np.dtype(f"int{a.dtype.itemsize * 8}") if a.dtype.itemsize > 1 else np.uint8)
        return torch.from_numpy(a).view(dtype)
    return torch.from_numpy(a)


class Store:
    """A checkpoint root (directory or URL prefix)."""

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]] = None):
        self.url = os.fspath(url)
        self.scheme, _, self.local_root = split_url(self.url)
        self.kv_spec = kvstore_spec(self.url, storage_options)
        self.context = shared_context()
        self._kv: Optional[ts.KvStore] = None
        self._arrays: Dict[Tuple[str, bool], Any] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ small objects
    @property
    def kv(self) -> ts.KvStore:
        if self._kv is None:
            self._kv = ts.KvStore.open(self.kv_spec, context=self.context).result()
        return self._kv

    def read_bytes(self, key: str) -> Optional[bytes]:
        try:
            r = self.kv.read(key).result()
        except ValueError as exc:  # tensorstore reports I/O failures as ValueError
            raise CheckpointError(f"reading {self._where(key)} failed: {exc}") from exc
        return r.value if r.state == "value" else None

    def write_bytes(self, key: str, data: bytes, *, only_if_absent: bool = False) -> bool:
        """Write atomically; with only_if_absent, return False when the key already exists."""
        try:
            if only_if_absent:
                current = self.kv.read(key).result()
                if current.state == "value":
                    return False
                # Conditional on "still absent": a concurrent writer makes this a no-op.
                return self.kv.write(key, data, if_equal=current.stamp.generation).result().generation != b""
            self.kv.write(key, data).result()
            return True
        except ValueError as exc:
            raise CheckpointError(f"writing {self._where(key)} failed: {exc}") from exc

    def delete(self, key: str) -> None:
        self.kv.write(key, None).result()

    def list(self, prefix: str = "") -> List[str]:
        rng = ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=_prefix_end(prefix)) if prefix else None
        return sorted(k.decode() for k in self.kv.list(rng).result())

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise CheckpointError("refusing to delete an empty prefix (the whole store)")
        self.kv.delete_range(ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=_prefix_end(prefix))).result()
        if self.scheme == "file":  # the file driver leaves empty directories behind
            shutil.rmtree(os.path.join(self.local_root, prefix), ignore_errors=True)

    def remove_root(self) -> None:
        """Delete everything under the root (and the directory itself for local paths)."""
        if self.scheme == "file":
            shutil.rmtree(self.local_root, ignore_errors=True)
        else:
            self.kv.delete_range(ts.KvStore.KeyRange()).result()

    def exists_any(self) -> bool:
        if self.scheme == "file":
            return os.path.isdir(self.local_root) and bool(os.listdir(self.local_root))
        return bool(self.kv.list().result())

    def _where(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    # ------------------------------------------------------------ tensor arrays
    def array(self, meta: ArrayMeta, *, create: bool = False):
        """Open (cached) a zarr array; create=True also writes its zarr.json."""
        cache_key = (meta.path, create)
        with self._lock:
            handle = self._arrays.get(cache_key)
        if handle is not None:
            return handle
        spec = zarr_spec(self.kv_spec, meta)
        if create:
            # Never delete_existing: other ranks may already have written chunks of this array.
            fut = ts.open(spec, context=self.context, create=True, open=True)
        else:
            # Writers and readers trust the metadata we recorded ourselves: no zarr.json round trip.
            fut = ts.open(spec, context=self.context, open=True, assume_metadata=True)
        handle = fut.result()
        with self._lock:
            self._arrays[cache_key] = handle
        return handle

    def write_region(self, meta: ArrayMeta, array_offsets: Sequence[int], data: np.ndarray):
        """Start writing `data` at `array_offsets`; returns tensorstore WriteFutures."""
        arr = self.array(meta)
        index = tuple(slice(o, o + n) for o, n in zip(array_offsets, data.shape))
        return arr[index].write(data) if index else arr.write(data)

    def read_region(self, meta: ArrayMeta, index: Tuple[slice, ...]):
        arr = self.array(meta)
        return arr[index].read() if index else arr.read()

    def create_array_metadata(self, meta: ArrayMeta) -> None:
        self.array(meta, create=True)


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def raise_read_error(exc: Exception, what: str) -> None:
    msg = str(exc)
    if "Digest mismatch" in msg or "checksum" in msg.lower():
        raise CorruptCheckpointError(f"{what}: stored bytes fail their crc32c checksum ({msg}); "
                                     f"the checkpoint is damaged") from exc
    raise CheckpointError(f"{what}: read failed: {msg}") from exc
