"""PosixStorage: a local directory through plain file I/O.

Measured on this project's benchmark, the tensorstore file kvstore's Python API copies every
chunk once more each way (bytes <-> Cord); plain files avoid that, read straight into target
tensors, and release the GIL for the worker pool. Same keys and layout as the kvstore would
write, so either can read what the other wrote (and tensorstore's zarr3 driver opens the arrays).

Bulk writes run on the caller's worker thread and return a finished Request; bulk reads run when
their result is asked for, on the worker thread that asks. Durability: a chunk of DATASYNC_BYTES
or more is fdatasync'ed right after its write, on the worker thread that wrote it, so the disk
works while other workers checksum and write the next chunks; `sync()` (once per save, before the
commit) then fsyncs what is left: small files and new directories, or, when there are many of
them, flushes the whole file system once (syncfs). Measured against one syncfs at the end, which
also waits for every other process's dirty data on that file system: docs/results.md.

Files of DATASYNC_BYTES or more are written with O_DIRECT (direct_io "auto", the default, or True):
no copy into the page cache, no dirty pages for the kernel to flush on the training's cores
(docs/async_staging.md: 2.6 CPU-s/GiB buffered vs ~0.2 here), and no save slowed by the writeback of
the ones before it. In a steady loop of sync saves with old checkpoints kept (benchmarks/bench_steady.py)
buffered saves swung 0.2-0.8 s for the same 405 MiB (mean 0.34 s), O_DIRECT ones 0.19-0.28 s (mean
0.23 s); a resume is a new process reading from the device either way (cold, 0.47-0.59 s both). What
O_DIRECT gives up: a load in the same process right after a save reads from the device, not the page
cache (docs/results.md). direct_io=False writes buffered. Requests are whole 4 KiB pages
from page-aligned memory: page-aligned parts go straight from their buffer, the rest through a
small aligned bounce buffer; the last page is padded and the file cut to its size, so the bytes are
exactly the buffered path's. A file system that refuses O_DIRECT (tmpfs, some FUSE) is remembered
and written buffered ("auto"), or is an error naming it (True).
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import uuid
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..common.errors import CheckpointError, CorruptCheckpointError
from .direct_writer import _REFUSED, BOUNCE_BYTES, PAGE, _DirectWriter, _Refused  # noqa: F401 - PAGE, BOUNCE_BYTES: tests
from .base import Done, Request, Storage, Version, check_key_inside
from .errors import classify_os_error

try:
    import ctypes
    import ctypes.util
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
except OSError:  # pragma: no cover - non-glibc platforms fall back to os.sync
    _LIBC = None


_IOV_MAX = 512
# Chunks at least this big are fdatasync'ed as they are written; smaller files wait for sync().
DATASYNC_BYTES = 1 << 20
# sync() fsyncs up to this many small files / new directories one by one, else one syncfs.
MAX_SINGLE_SYNCS = 256

log = logging.getLogger("bytecheckpoint")


def _consume(bufs: List[memoryview], n: int) -> None:
    """Drop the first `n` bytes of a scatter/gather list (after a short readv/writev)."""
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs.pop(0)
    if bufs and n:
        bufs[0] = bufs[0][n:]


class _LazyRead(Request):
    def __init__(self, fn):
        self._fn = fn

    def result(self):
        return self._fn()


class PosixStorage(Storage):
    scheme = "file"

    def __init__(self, url: str, root: str, request_timeout_s: Optional[float] = None, direct_io: Any = "auto"):
        self.url, self.root, self.request_timeout_s = url, root, request_timeout_s
        self.direct_io = direct_io
        # None: not tried yet; False: refused here (or off): buffered writes from now on
        self._direct_ok: Optional[bool] = None if direct_io and hasattr(os, "O_DIRECT") else False
        self._made_dirs: set = set()
        self._dirs_lock = threading.Lock()
        self._unsynced: set = set()  # small files and new directories written since the last sync()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _makedirs(self, directory: str) -> None:
        """Each directory is created once per storage object (a save makes hundreds of chunk dirs)."""
        if directory in self._made_dirs:
            return
        new = []
        d = directory
        while d and not os.path.isdir(d):
            new.append(d)
            d = os.path.dirname(d)
        os.makedirs(directory, exist_ok=True)
        with self._dirs_lock:
            self._made_dirs.add(directory)
            self._unsynced.update(new)
            if new:
                self._unsynced.add(d)  # the existing parent gained an entry

    def prepare(self, keys: Sequence[str]) -> None:
        try:
            for directory in sorted({os.path.dirname(self._path(k)) for k in keys}):
                self._makedirs(directory)
        except OSError:
            pass  # a hint only: the write that needs the directory reports the error, naming the tensor

    # ------------------------------------------------------------ bulk
    def _create(self, path: str, flags: int = 0) -> int:
        """os.open a new file for writing (mode 0o666 less the umask, as open(path, "wb")), creating its
        directory (again, if it vanished since it was made)."""
        flags |= os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._makedirs(os.path.dirname(path))
        try:
            return os.open(path, flags, 0o666)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return os.open(path, flags, 0o666)

    def _open_new(self, path: str):
        return os.fdopen(self._create(path), "wb")

    def write(self, key: str, data: memoryview) -> Request:
        return self.write_parts(key, [data])

    def write_parts(self, key: str, parts: Sequence[memoryview]) -> Request:
        """The parts written in place, back to back: with O_DIRECT when they are DATASYNC_BYTES or more
        (and direct_io allows: see the module docstring), else with writev (no join); such a file is
        fdatasync'ed now, a smaller one by sync()."""
        path = self._path(key)
        views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]  # bytes, whatever the format
        nbytes = sum(len(v) for v in views)
        if nbytes >= DATASYNC_BYTES and self._direct_ok is not False:
            try:
                self._write_direct(path, views)
                self._direct_ok = True
                return Done()
            except _Refused as exc:
                if self.direct_io is True:
                    return Done(error=CheckpointError(
                        f"{self.url!r}: the file system refuses O_DIRECT writes ({exc}); save with direct_io='auto' "
                        f"(falls back to buffered writes) or direct_io=False (BCP_DIRECT_IO)"))
                self._direct_ok = False
                log.debug("bytecheckpoint: %s refuses O_DIRECT (%s); buffered writes from now on", self.url, exc)
            except OSError as exc:
                return Done(error=exc)
        try:
            with self._open_new(path) as f:
                fd, total = f.fileno(), 0
                bufs = list(views)
                while bufs:  # writev may write less than asked (> 2 GiB, signals): go on where it stopped
                    n = os.writev(fd, bufs[:_IOV_MAX])
                    total += n
                    _consume(bufs, n)
                if total >= DATASYNC_BYTES:
                    os.fdatasync(fd)
                    return Done()
        except OSError as exc:
            return Done(error=exc)
        with self._dirs_lock:
            self._unsynced.add(path)
        return Done()

    def _write_direct(self, path: str, views: Sequence[memoryview]) -> None:
        try:
            fd = self._create(path, os.O_DIRECT)
        except OSError as exc:
            if exc.errno in _REFUSED:
                raise _Refused(exc) from None
            raise
        writer = _DirectWriter(fd)
        try:
            for v in views:
                writer.add(v)
            writer.finish()
        except OSError as exc:
            if exc.errno in _REFUSED and writer.pos == 0:  # opened, but the first aligned write refused
                raise _Refused(exc) from None
            raise
        finally:
            writer.release()
            os.close(fd)

    def read(self, key: str) -> Request:
        return _LazyRead(lambda: self._read_whole(key))

    def _read_whole(self, key: str) -> Optional[torch.Tensor]:
        try:
            with open(self._path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = torch.empty(size, dtype=torch.uint8)
                if size:
                    f.readinto(memoryview(buf.numpy()))
        except FileNotFoundError:
            return None
        return buf

    def read_into(self, key: str, dest: memoryview) -> Request:
        def run() -> Optional[int]:
            try:
                with open(self._path(key), "rb") as f:
                    if os.fstat(f.fileno()).st_size != len(dest):
                        raise CorruptCheckpointError(f"{self.where(key)} has the wrong size; the checkpoint is "
                                                     f"damaged")
                    return f.readinto(dest)
            except FileNotFoundError:
                return None
        return _LazyRead(run)

    def read_range(self, key: str, start: int, stop: int) -> Request:
        def run():
            try:
                with open(self._path(key), "rb") as f:
                    f.seek(start)
                    buf = torch.empty(stop - start, dtype=torch.uint8)
                    got = f.readinto(memoryview(buf.numpy())) if stop > start else 0
            except FileNotFoundError:
                return None
            if got != stop - start:
                raise CorruptCheckpointError(f"{self.where(key)} is shorter than expected; the checkpoint is damaged")
            return buf
        return _LazyRead(run)

    def read_range_into(self, key: str, start: int, dests: Sequence[memoryview]) -> Request:
        def run() -> Optional[int]:
            want, path = sum(len(d) for d in dests), self._path(key)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                got, bufs, pos = 0, list(dests), start
                while bufs:  # preadv may return short (signals, > 2 GiB): continue where it stopped
                    n = os.preadv(fd, bufs[:_IOV_MAX], pos)
                    if n == 0:
                        break
                    got, pos = got + n, pos + n
                    _consume(bufs, n)
            finally:
                os.close(fd)
            if got != want:
                raise CorruptCheckpointError(f"{self.where(key)} is shorter than expected; the checkpoint is damaged")
            return got
        return _LazyRead(run)

    # ------------------------------------------------------------ small objects
    def size(self, key: str) -> Optional[int]:
        try:
            return os.stat(self._path(key)).st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def get(self, key: str) -> Optional[bytes]:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            return None
        except OSError as exc:
            raise classify_os_error(exc, f"reading {self.where(key)!r}", self.url) from exc

    def get_versioned(self, key: str, known: Version = None) -> Tuple[Version, Optional[bytes], bool]:
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None, None, known is not None
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        if version == known:
            return version, None, False
        return version, self.get(key), True

    def put(self, key: str, data: bytes, *, if_absent: bool = False, durable: bool = False) -> bool:
        path = self._path(key)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with self._open_new(tmp) as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            if if_absent:
                try:
                    os.link(tmp, path)  # atomic, and fails if the key exists
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp)
            else:
                os.replace(tmp, path)
            if durable:
                fsync_path(os.path.dirname(path), gone=OSError)
            else:
                with self._dirs_lock:
                    self._unsynced.update((path, os.path.dirname(path)))
        except OSError as exc:
            _unlink_quietly(tmp)
            raise classify_os_error(exc, f"writing {self.where(key)!r}", self.url) from exc
        return True

    def put_aside(self, key: str, data: bytes) -> Request:
        """A stats record: tmp + rename, never fsynced nor flushed by sync() (the next save's sync must
        not pay for it). Directories are made only when missing, never the top one (a record of a
        data directory removed meanwhile is dropped, not left as an orphan)."""
        path = self._path(key)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            if not os.path.isdir(os.path.dirname(path)):
                if "/" in key and not os.path.isdir(self._path(key.split("/", 1)[0])):
                    raise FileNotFoundError(errno.ENOENT, "the checkpoint's data directory is gone", path)
                os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            _unlink_quietly(tmp)
            return Done(error=classify_os_error(exc, f"writing {self.where(key)!r}", self.url))
        return Done(True)

    def list(self, prefix: str = "") -> List[str]:
        out: List[str] = []
        base = self.root.rstrip("/")
        for directory, _, files in os.walk(base):
            rel = os.path.relpath(directory, base)
            for name in files:
                key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                if key.startswith(prefix) and ".tmp-" not in name:
                    out.append(key)
        return sorted(out)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise classify_os_error(exc, f"deleting {self.where(key)!r}", self.url) from exc

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise CheckpointError("refusing to delete an empty prefix (the whole store)")
        check_key_inside(prefix, self.url)
        root = os.path.realpath(self.root)
        target = os.path.realpath(self._path(prefix.rstrip("/")))
        if os.path.commonpath([target, root]) != root or target == root:
            raise CheckpointError(f"{self.url!r}: refusing to delete {prefix!r} outside the checkpoint")
        if prefix.endswith("/"):
            shutil.rmtree(target, ignore_errors=True)
        else:  # a key prefix that is not a directory: remove the matching entries
            for key in self.list(prefix):
                self.delete(key)
        with self._dirs_lock:
            self._made_dirs.clear()
            self._unsynced.clear()

    def remove_root(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        with self._dirs_lock:
            self._made_dirs.clear()
            self._unsynced.clear()

    def exists_any(self) -> bool:
        return os.path.isdir(self.root) and bool(os.listdir(self.root))

    def sync(self) -> None:
        """Make everything written so far durable: big chunks already are (fdatasync on write);
        fsync the small files and new directories, or flush the file system once if they are many."""
        with self._dirs_lock:
            pending, self._unsynced = self._unsynced, set()
        if len(pending) <= MAX_SINGLE_SYNCS:
            try:
                for path in sorted(pending, key=lambda p: -p.count(os.sep)):  # files and leaves first
                    fsync_path(path)
            except OSError as exc:
                raise classify_os_error(exc, f"flushing {self.url!r} to disk", self.url) from exc
            return
        self.syncfs()

    def syncfs(self) -> None:
        """One flush of the whole file system."""
        if not os.path.isdir(self.root):
            return
        fd = os.open(self.root, os.O_RDONLY)
        try:
            if _LIBC is not None and hasattr(_LIBC, "syncfs"):
                if _LIBC.syncfs(fd) != 0:
                    os.fsync(fd)
            else:
                os.sync()
        except OSError as exc:
            raise classify_os_error(exc, f"flushing {self.url!r} to disk", self.url) from exc
        finally:
            os.close(fd)


def fsync_path(path: str, gone=(FileNotFoundError, NotADirectoryError)) -> None:
    """fsync a file or directory; an open that fails with `gone` means nothing to keep (removed
    since, or for a directory fsync after a put: not openable at all)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except gone:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
