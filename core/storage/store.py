"""Store: every tensorstore call of the library goes through here.

One Context per process (all concurrency limits) and a root KvStore for small objects
(metadata, per-rank values, markers), listing and deleting. Tensor chunks move through
chunks.py / chunk_io.py, which use this Store's kvstore.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from typing import Any, List, Mapping, Optional

import tensorstore as ts

from ..errors import CheckpointError
from . import faults
from .errors import StorageError, classify
from .specs import context_spec, kvstore_spec, split_url, static_credentials_files

try:
    import ctypes
    import ctypes.util
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
except OSError:  # pragma: no cover - non-glibc platforms fall back to os.sync
    _LIBC = None

_CONTEXT_LOCK = threading.Lock()
_CONTEXT: Optional[ts.Context] = None

def shared_context() -> ts.Context:
    """Process-wide context so that the memory:// store and the I/O limits are shared."""
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            _CONTEXT = ts.Context(context_spec())
        return _CONTEXT


class Store:
    """A checkpoint root (directory or URL prefix)."""

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]] = None):
        self.url = os.fspath(url)
        self.scheme, _, self.local_root = split_url(self.url)
        secrets = _write_static_credentials(storage_options) if self.scheme == "s3" else None
        self.kv_spec = kvstore_spec(self.url, storage_options, secrets_dir=secrets)
        self.context = shared_context()
        self._kv: Optional[ts.KvStore] = None

    # ------------------------------------------------------------ small objects
    @property
    def kv(self) -> ts.KvStore:
        """The root KvStore (every key-value request goes through it; see faults.py)."""
        if self._kv is None:
            try:
                kv = ts.KvStore.open(self.kv_spec, context=self.context).result()
            except ValueError as exc:
                raise classify(exc, f"opening {self.url!r}", self.url) from exc
            if self.scheme in ("s3", "gs"):
                _probe_bucket(kv, self.url)
            self._kv = faults.wrap(kv) if faults.active() else kv
        return self._kv

    def read_bytes(self, key: str) -> Optional[bytes]:
        try:
            r = self.kv.read(key).result()
        except ValueError as exc:  # tensorstore reports I/O failures as ValueError
            raise classify(exc, f"reading {self._where(key)}", self.url) from exc
        return r.value if r.state == "value" else None

    def write_bytes(self, key: str, data: bytes, *, only_if_absent: bool = False, durable: bool = False) -> bool:
        """Write atomically; with only_if_absent, return False when the key already exists.
        durable=True flushes it to stable storage before returning."""
        try:
            if only_if_absent:
                current = self.kv.read(key).result()
                if current.state == "value":
                    return False
                # Conditional on "still absent": a concurrent writer makes this a no-op.
                written = self.kv.write(key, data, if_equal=current.stamp.generation).result().generation != b""
            else:
                self.kv.write(key, data).result()
                written = True
        except ValueError as exc:
            raise classify(exc, f"writing {self._where(key)}", self.url) from exc
        if written and durable:
            self.sync()
        return written

    def sync(self) -> None:
        """Flush local writes to disk. The file kvstore runs without per-file fsync (one fsync per
        chunk file dominated save time); one syncfs of the checkpoint's file system replaces them.
        Object stores are durable once a write returns."""
        if faults.active():
            try:
                faults.check("sync", self.url)
            except ValueError as exc:
                raise classify(exc, f"flushing {self.url!r} to disk", self.url) from exc
        if self.scheme != "file" or not os.path.isdir(self.local_root):
            return
        fd = os.open(self.local_root, os.O_RDONLY)
        try:
            if _LIBC is not None and hasattr(_LIBC, "syncfs"):
                if _LIBC.syncfs(fd) != 0:
                    os.fsync(fd)
            else:
                os.sync()
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        try:
            self.kv.write(key, None).result()
        except ValueError as exc:
            raise classify(exc, f"deleting {self._where(key)}", self.url) from exc

    def list(self, prefix: str = "") -> List[str]:
        rng = ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=_prefix_end(prefix)) if prefix else None
        try:
            keys = self.kv.list(rng).result() if rng is not None else self.kv.list().result()
        except ValueError as exc:
            raise classify(exc, f"listing {self._where(prefix)}", self.url) from exc
        return sorted(k.decode() for k in keys)

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise CheckpointError("refusing to delete an empty prefix (the whole store)")
        _check_key_inside(prefix, self.url)
        try:
            self.kv.delete_range(ts.KvStore.KeyRange(inclusive_min=prefix,
                                                     exclusive_max=_prefix_end(prefix))).result()
        except ValueError as exc:
            raise classify(exc, f"deleting {self._where(prefix)}", self.url) from exc
        if self.scheme == "file":  # the file driver leaves empty directories behind
            target = os.path.realpath(os.path.join(self.local_root, prefix))
            root = os.path.realpath(self.local_root)
            if os.path.commonpath([target, root]) == root and target != root:
                shutil.rmtree(target, ignore_errors=True)

    def remove_root(self) -> None:
        """Delete everything under the root (and the directory itself for local paths)."""
        if self.scheme == "file":
            shutil.rmtree(self.local_root, ignore_errors=True)
        else:
            try:
                self.kv.delete_range(ts.KvStore.KeyRange()).result()
            except ValueError as exc:
                raise classify(exc, f"deleting {self.url!r}", self.url) from exc

    def exists_any(self) -> bool:
        if self.scheme == "file":
            return os.path.isdir(self.local_root) and bool(os.listdir(self.local_root))
        return bool(self.list())

    def _where(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

def _check_key_inside(key: str, url: str) -> None:
    """A key (or prefix) names something inside the checkpoint root: relative, no '.'/'..' parts.
    Keys that reach deletes may come from a metadata file, which is untrusted input."""
    parts = key.rstrip("/").split("/")
    if key.startswith(("/", "\\")) or "\\" in key or "\x00" in key or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"{url!r}: refusing to touch {key!r}: not a path inside the checkpoint (the "
                              f"metadata that named it is damaged or hostile)")


def _probe_bucket(kv: ts.KvStore, url: str) -> None:
    """One cheap listing request when a remote root is first opened, so that a missing bucket or a
    wrong endpoint fails at once with an error naming the URL (S3 reads of a missing bucket look
    like missing keys otherwise). A listing that is only forbidden is not an error here: some
    credentials may read and write but not list; their requests report their own errors."""
    try:
        kv.list(ts.KvStore.KeyRange(inclusive_min="metadata.json", exclusive_max="metadata.json\x00")).result()
    except ValueError as exc:
        err = classify(exc, f"opening {url!r}", url)
        if not isinstance(err, PermissionError):
            raise err from exc


_SECRETS_LOCK = threading.Lock()
_SECRETS_DIR: Optional[str] = None


def _write_static_credentials(options: Optional[Mapping[str, Any]]) -> Optional[str]:
    """Explicit keys -> a private 0600 credentials file (see specs.aws_credentials_spec); its dir."""
    global _SECRETS_DIR
    opts = dict(options or {})
    if not (opts.get("access_key_id") and opts.get("secret_access_key")):
        return None
    cred_name, conf_name, cred_text, conf_text = static_credentials_files(opts)
    with _SECRETS_LOCK:
        if _SECRETS_DIR is None or not os.path.isdir(_SECRETS_DIR):
            _SECRETS_DIR = tempfile.mkdtemp(prefix="bytecheckpoint-aws-")  # mode 0700
            atexit.register(shutil.rmtree, _SECRETS_DIR, True)
        for name, text in ((cred_name, cred_text), (conf_name, conf_text)):
            path = os.path.join(_SECRETS_DIR, name)
            if not os.path.exists(path):
                tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.replace(tmp, path)
        return _SECRETS_DIR


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)
