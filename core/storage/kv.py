"""KvStorage: a checkpoint root on any tensorstore kvstore (s3://, gs://, memory://, file://).

All tensorstore calls of the library happen here (and in specs.py, which builds the dicts). The
`ts.Context` carrying the concurrency limits belongs to the Checkpointer that opened the store.
Every wait is bounded by the request timeout; tensorstore reports failures as ValueError, which
`classify` turns into a StorageError naming the URL.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, List, Optional, Sequence, Tuple

import tensorstore as ts

from ..common.errors import CheckpointError, CorruptCheckpointError
from .base import Done, Request, Storage, Version, check_key_inside
from .errors import classify


class _Pending(Request):
    """A tensorstore future, waited for with the store's timeout; errors classified with the URL."""

    def __init__(self, storage: "KvStorage", future: Any, key: str, what: str, convert=None):
        self._storage, self._future, self._key, self._what, self._convert = storage, future, key, what, convert

    def result(self) -> Any:
        value = self._storage._wait(self._future, self._key, self._what)
        return self._convert(value) if self._convert is not None else value


def _value(read_result) -> Optional[bytes]:
    return read_result.value if read_result.state == "value" else None


class KvStorage(Storage):
    def __init__(self, url: str, scheme: str, spec: dict, context: ts.Context, local_root: str = "",
                 request_timeout_s: Optional[float] = None):
        self.url, self.scheme, self.kv_spec, self.local_root = url, scheme, spec, local_root
        self.request_timeout_s = request_timeout_s
        self._context = context
        self._kv: Optional[ts.KvStore] = None

    @property
    def kv(self) -> ts.KvStore:
        if self._kv is None:
            try:
                kv = ts.KvStore.open(self.kv_spec, context=self._context).result(timeout=self.request_timeout_s)
            except TimeoutError:
                raise self.timed_out("", "opening") from None
            except ValueError as exc:
                raise classify(exc, f"opening {self.url!r}", self.url) from exc
            if self.scheme in ("s3", "gs"):
                _probe_bucket(self, kv)
            self._kv = kv
        return self._kv

    def _wait(self, future: Any, key: str, what: str) -> Any:
        try:
            return future.result(timeout=self.request_timeout_s)
        except TimeoutError:
            future.cancel()
            raise self.timed_out(key, what) from None
        except ValueError as exc:  # tensorstore reports I/O failures as ValueError
            if str(exc).startswith("OUT_OF_RANGE"):  # a range past the end: the object was cut short
                raise CorruptCheckpointError(f"{self.where(key)} is shorter than expected; the checkpoint is "
                                             f"damaged") from None
            raise classify(exc, f"{what} {self.where(key)}", self.url) from exc

    # ------------------------------------------------------------ bulk
    def write(self, key: str, data: memoryview) -> Request:
        return _Pending(self, self.kv.write(key, bytes(data)), key, "writing")

    def write_parts(self, key: str, parts: Sequence[memoryview]) -> Request:
        return _Pending(self, self.kv.write(key, b"".join(parts)), key, "writing")

    def read(self, key: str) -> Request:
        return _Pending(self, self.kv.read(key), key, "reading", _value)

    def read_into(self, key: str, dest: memoryview) -> Request:
        def copy(raw: Optional[bytes]) -> Optional[int]:
            if raw is None:
                return None
            if len(raw) != len(dest):
                raise CorruptCheckpointError(f"{self.where(key)} has the wrong size; the checkpoint is damaged")
            dest[:] = raw
            return len(raw)
        return _Pending(self, self.kv.read(key), key, "reading", lambda r: copy(_value(r)))

    def read_range(self, key: str, start: int, stop: int) -> Request:
        fut = self.kv.read(key, byte_range=slice(start, stop))
        return _Pending(self, fut, key, "reading", _value)

    def read_range_into(self, key: str, start: int, dests: Sequence[memoryview]) -> Request:
        want = sum(len(d) for d in dests)

        def scatter(raw: Optional[bytes]) -> Optional[int]:
            if raw is None:
                return None
            if len(raw) != want:
                raise CorruptCheckpointError(f"{self.where(key)} is shorter than expected; the checkpoint is damaged")
            src, pos = memoryview(raw), 0
            for d in dests:
                d[:] = src[pos:pos + len(d)]
                pos += len(d)
            return want
        fut = self.kv.read(key, byte_range=slice(start, start + want))
        return _Pending(self, fut, key, "reading", lambda r: scatter(_value(r)))

    # ------------------------------------------------------------ small objects
    def get(self, key: str) -> Optional[bytes]:
        return _value(self._wait(self.kv.read(key), key, "reading"))

    def get_versioned(self, key: str, known: Version = None) -> Tuple[Version, Optional[bytes], bool]:
        kwargs = {"if_not_equal": known} if known is not None else {}
        r = self._wait(self.kv.read(key, **kwargs), key, "reading")
        if r.state == "missing":
            return None, None, known is not None
        if r.state == "unspecified":  # unchanged since `known`
            return known, None, False
        return r.stamp.generation, r.value, True

    def put(self, key: str, data: bytes, *, if_absent: bool = False, durable: bool = False) -> bool:
        if if_absent:
            current = self._wait(self.kv.read(key), key, "reading")
            if current.state == "value":
                return False
            # Conditional on "still absent": a concurrent writer makes this a no-op.
            gen = self._wait(self.kv.write(key, data, if_equal=current.stamp.generation), key, "writing").generation
            written = gen != b""
        else:
            self._wait(self.kv.write(key, data), key, "writing")
            written = True
        if written and durable:
            self.sync()
        return written

    def put_aside(self, key: str, data: bytes) -> Request:
        """One PUT started, not waited for (a stats record: off the critical path)."""
        try:
            return _Pending(self, self.kv.write(key, data), key, "writing")
        except Exception as exc:  # noqa: BLE001 - delivered through the request
            return Done(error=exc)

    def list(self, prefix: str = "") -> List[str]:
        rng = ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=_prefix_end(prefix)) if prefix else None
        fut = self.kv.list(rng) if rng is not None else self.kv.list()
        return sorted(k.decode() for k in self._wait(fut, prefix, "listing"))

    def delete(self, key: str) -> None:
        self._wait(self.kv.write(key, None), key, "deleting")

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise CheckpointError("refusing to delete an empty prefix (the whole store)")
        check_key_inside(prefix, self.url)
        rng = ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=_prefix_end(prefix))
        self._wait(self.kv.delete_range(rng), prefix, "deleting")
        if self.scheme == "file":  # the file driver leaves empty directories behind
            target = os.path.realpath(os.path.join(self.local_root, prefix))
            root = os.path.realpath(self.local_root)
            if os.path.commonpath([target, root]) == root and target != root:
                shutil.rmtree(target, ignore_errors=True)

    def remove_root(self) -> None:
        if self.scheme == "file":
            shutil.rmtree(self.local_root, ignore_errors=True)
        else:
            self._wait(self.kv.delete_range(ts.KvStore.KeyRange()), "", "deleting")

    def exists_any(self) -> bool:
        if self.scheme == "file":
            return os.path.isdir(self.local_root) and bool(os.listdir(self.local_root))
        return bool(self.list())

    def sync(self) -> None:
        """The file driver runs without per-file fsync (see specs.context_spec); one syncfs of the
        file system replaces them. Object stores are durable once a write returns."""
        if self.scheme == "file" and os.path.isdir(self.local_root):
            from .posix import PosixStorage
            PosixStorage(self.url, self.local_root).syncfs()


def _probe_bucket(storage: KvStorage, kv: ts.KvStore) -> None:
    """One cheap listing request when a remote root is first opened, so that a missing bucket or a
    wrong endpoint fails at once with an error naming the URL (S3 reads of a missing bucket look
    like missing keys otherwise). A listing that is only forbidden is not an error here: some
    credentials may read and write but not list; their requests report their own errors."""
    rng = ts.KvStore.KeyRange(inclusive_min="metadata.json", exclusive_max="metadata.json\x00")
    try:
        kv.list(rng).result(timeout=storage.request_timeout_s)
    except TimeoutError:
        raise storage.timed_out("", "opening") from None
    except ValueError as exc:
        err = classify(exc, f"opening {storage.url!r}", storage.url)
        if not isinstance(err, PermissionError):
            raise err from exc


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class ReadOnlyKvStorage(KvStorage):
    """http(s)://: a checkpoint directory served by a web server, loaded, inspected and verified
    in place. Nothing can be written or listed there. Servers that ignore Range requests (e.g.
    Python's http.server) get whole-object reads, sliced here."""

    read_only = True

    def read_range(self, key: str, start: int, stop: int) -> Request:
        return _Pending(self, self.kv.read(key), key, "reading", lambda r: _slice(_value(r), start, stop, self, key))

    def read_range_into(self, key: str, start: int, dests: Sequence[memoryview]) -> Request:
        want = sum(len(d) for d in dests)

        def scatter(r) -> Optional[int]:
            raw = _slice(_value(r), start, start + want, self, key)
            if raw is None:
                return None
            pos = 0
            for d in dests:
                d[:] = raw[pos:pos + len(d)]
                pos += len(d)
            return want
        return _Pending(self, self.kv.read(key), key, "reading", scatter)

    def _read_only(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.url!r} is read-only ({self.scheme}://): cannot {what}; save to a local path, "
                               f"s3:// or gs://")

    def write(self, key: str, data: memoryview) -> Request:
        raise self._read_only("write")

    def put(self, key: str, data: bytes, *, if_absent: bool = False, durable: bool = False) -> bool:
        raise self._read_only("write")

    def put_aside(self, key: str, data: bytes) -> Request:
        return Done(error=self._read_only("write"))

    def delete(self, key: str) -> None:
        raise self._read_only("delete")

    def delete_prefix(self, prefix: str) -> None:
        raise self._read_only("delete")

    def remove_root(self) -> None:
        raise self._read_only("delete")

    def list(self, prefix: str = "") -> List[str]:
        return []  # a web server has no listing to rely on

    def exists_any(self) -> bool:
        return False

    def sync(self) -> None:
        pass


def _slice(raw: Optional[bytes], start: int, stop: int, storage: Storage, key: str) -> Optional[memoryview]:
    if raw is None:
        return None
    if len(raw) < stop:
        raise CorruptCheckpointError(f"{storage.where(key)} is shorter than expected; the checkpoint is damaged")
    return memoryview(raw)[start:stop]
