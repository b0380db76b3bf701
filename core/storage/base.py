"""The storage interface: everything the engine asks of a checkpoint root, in one small protocol.

Two implementations: `PosixStorage` (local directories, plain file I/O) and `KvStorage` (any
tensorstore kvstore: s3://, gs://, memory://, and file:// on request). Fault injection is a third
class that wraps either (`faults.FaultyStorage`); nothing in the production path checks for it.

Keys are '/'-separated paths relative to the root. Bulk requests (`write`, `read`) return a
`Request` whose `result()` waits; small-object calls are synchronous. Every wait is bounded by the
storage's `request_timeout_s`, and a failure is a `StorageError` naming the URL and key.
"""
from __future__ import annotations

import abc
from typing import Any, List, Optional, Sequence, Tuple

from .errors import StorageTimeoutError

Version = Any  # an opaque stamp of one object's contents (mtime/size/inode, or a generation)


class Request(abc.ABC):
    """One bulk request in flight."""

    @abc.abstractmethod
    def result(self) -> Any:
        """Wait (bounded by the storage's request timeout) and return the value or raise."""


class Done(Request):
    """A request that already finished (POSIX writes run on the caller's worker thread)."""

    def __init__(self, value: Any = None, error: Optional[BaseException] = None):
        self._value, self._error = value, error

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class Storage(abc.ABC):
    """A checkpoint root. `url` names it in every error message."""

    url: str
    scheme: str
    request_timeout_s: Optional[float] = None
    read_only: bool = False  # http(s)://: load, inspect and verify only

    # ------------------------------------------------------------ bulk (tensor chunks)
    @abc.abstractmethod
    def write(self, key: str, data: memoryview) -> Request:
        """Start writing `data` (bytes-like, kept alive by the caller until result()) to `key`."""

    def write_parts(self, key: str, parts: Sequence[memoryview]) -> Request:
        """Start writing the concatenation of `parts` as one object (a pack file: format 5). This
        default joins them (one copy); local files write them in place (PosixStorage)."""
        return self.write(key, memoryview(b"".join(parts)))

    @abc.abstractmethod
    def read(self, key: str) -> Request:
        """Start reading a whole object; result() is a bytes-like value (bytes or a uint8 tensor),
        or None when the object does not exist."""

    @abc.abstractmethod
    def read_into(self, key: str, dest: memoryview) -> Request:
        """Start reading a whole object into `dest` (exactly its size); result() is the number of
        bytes read, or None when the object does not exist; CorruptCheckpointError when the size
        differs."""

    @abc.abstractmethod
    def read_range(self, key: str, start: int, stop: int) -> Request:
        """Start reading bytes [start, stop) of an object; result() as for read()."""

    @abc.abstractmethod
    def read_range_into(self, key: str, start: int, dests: Sequence[memoryview]) -> Request:
        """Start reading the bytes from `start` on into `dests`, back to back (a scatter read of
        exactly sum(len(d)) bytes); result() is the number of bytes read, or None when the object
        does not exist; CorruptCheckpointError when the object is shorter."""

    # ------------------------------------------------------------ small objects
    @abc.abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The object's bytes, or None when it does not exist."""

    @abc.abstractmethod
    def get_versioned(self, key: str, known: Version = None) -> Tuple[Version, Optional[bytes], bool]:
        """(version, data, changed). When the object still has version `known`, data is None and
        changed is False (nothing is read); a missing object has version None."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes, *, if_absent: bool = False, durable: bool = False) -> bool:
        """Write atomically (readers see the old or the new object, never a mix). With if_absent,
        return False (and write nothing) when the key exists. durable=True: on stable storage
        when this returns."""

    def put_aside(self, key: str, data: bytes) -> Request:
        """Write a small informational object (a stats record) off the critical path: atomic for
        readers, never fsynced, never part of a later sync(); may still be in flight on return
        (object stores). Errors surface from result() only."""
        try:
            return Done(self.put(key, data))
        except Exception as exc:  # noqa: BLE001 - delivered through the request
            return Done(error=exc)

    def size(self, key: str) -> Optional[int]:
        """The object's length in bytes, None when absent. This default reads it whole; stores that
        can stat an object say so (another format's archives are located from their tail)."""
        raw = self.get(key)
        return None if raw is None else len(raw)

    @abc.abstractmethod
    def list(self, prefix: str = "") -> List[str]:
        """Every key under `prefix`, sorted."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object (no error when absent)."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under `prefix` (a non-empty key prefix inside the root)."""

    @abc.abstractmethod
    def remove_root(self) -> None:
        """Remove everything under the root (and a local root directory itself)."""

    @abc.abstractmethod
    def exists_any(self) -> bool:
        """True when anything is stored under the root."""

    def prepare(self, keys: Sequence[str]) -> None:
        """Called with the keys a batch of writes is about to write (a hint: an object store has
        nothing to prepare; a file system creates their directories now, in one pass)."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every completed write of this process durable (no-op where writes already are)."""

    # ------------------------------------------------------------ helpers for implementations
    def where(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    def timed_out(self, key: str, what: str) -> StorageTimeoutError:
        return StorageTimeoutError(
            f"{what} {self.where(key)!r} did not finish within {self.request_timeout_s:g} s (the storage is "
            f"not answering); storage_options request_timeout sets the limit")


def check_key_inside(key: str, url: str) -> None:
    """A key (or prefix) names something inside the checkpoint root: relative, no '.'/'..' parts.
    Keys that reach deletes may come from a metadata file, which is untrusted input."""
    from ..common.errors import CheckpointError
    parts = key.rstrip("/").split("/")
    if key.startswith(("/", "\\")) or "\\" in key or "\x00" in key or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"{url!r}: refusing to touch {key!r}: not a path inside the checkpoint (the "
                              f"metadata that named it is damaged or hostile)")
