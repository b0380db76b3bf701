"""The only package that talks to tensorstore or the file system for checkpoint bytes.

`open_storage` picks the implementation by URL scheme (a registry, not a chain of ifs):
local paths -> PosixStorage (or KvStorage with local_io="tensorstore"), s3:// gs:// memory:// ->
KvStorage. Spec builders are pure (specs.py); chunk encoding is chunks.py.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

from .base import Done, Request, Storage
from .specs import context_spec, kvstore_spec, split_common_options, split_url

__all__ = ["Storage", "Request", "Done", "open_storage", "kvstore_spec", "context_spec", "split_url"]


def _open_file(url: str, opts: Dict[str, Any], env: "StorageEnv", timeout: Optional[float]) -> Storage:
    scheme, _, root = split_url(url)
    kvstore_spec(url, opts)  # validates: no options apply to local paths
    if env.local_io == "tensorstore":
        from .kv import KvStorage
        return KvStorage(url, scheme, kvstore_spec(url, opts), env.context(), root, timeout)
    from .posix import PosixStorage
    return PosixStorage(url, root, timeout, env.direct_io)


def _open_kv(url: str, opts: Dict[str, Any], env: "StorageEnv", timeout: Optional[float]) -> Storage:
    from .kv import KvStorage
    scheme = split_url(url)[0]
    secrets = env.secrets_dir(opts) if scheme == "s3" else None
    return KvStorage(url, scheme, kvstore_spec(url, opts, secrets_dir=secrets), env.context(), "", timeout)


def _open_http(url: str, opts: Dict[str, Any], env: "StorageEnv", timeout: Optional[float]) -> Storage:
    from .kv import ReadOnlyKvStorage
    return ReadOnlyKvStorage(url, split_url(url)[0], kvstore_spec(url, opts), env.context(), "", timeout)


OPENERS: Dict[str, Callable[..., Storage]] = {"file": _open_file, "s3": _open_kv, "gs": _open_kv, "memory": _open_kv,
                                              "http": _open_http, "https": _open_http}


class StorageEnv:
    """What opening a storage needs from its Checkpointer: the tensorstore Context (concurrency
    limits, the memory:// store) and a private directory for explicit S3 credentials."""

    def __init__(self, context: Callable[[], Any], secrets_dir: Callable[[Mapping[str, Any]], Optional[str]],
                 local_io: str = "posix", direct_io: Any = "auto"):
        self.context, self.secrets_dir, self.local_io = context, secrets_dir, local_io
        self.direct_io = direct_io  # PosixStorage's O_DIRECT pack writes (Options.direct_io)


def open_storage(url: str, storage_options: Optional[Mapping[str, Any]], env: StorageEnv) -> Storage:
    opts, timeout = split_common_options(url, storage_options)
    return OPENERS[split_url(url)[0]](url, opts, env, timeout)
