"""The opened storages of one Checkpointer: one per (root URL, storage options), reused, with
the tensorstore Context that bounds their concurrency and the private credentials files explicit
S3 keys need. Closed with its Checkpointer."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from typing import Any, Mapping, Optional

from ..common.options import Options
from . import Storage, StorageEnv, open_storage
from .specs import context_spec, static_credentials_files

_STORAGE_CACHE_SIZE = 64


class StorageCache:
    def __init__(self, options: Options):
        self.options = options
        self._storages: "OrderedDict[tuple, Storage]" = OrderedDict()
        self._context = None
        self._secrets: Optional[str] = None
        self._lock = threading.RLock()

    def get(self, url: str, opts: Optional[Mapping[str, Any]]) -> Storage:
        key = (url, _freeze(opts))
        with self._lock:
            store = self._storages.get(key)
            if store is None:
                store = open_storage(url, opts, StorageEnv(self._tensorstore_context, self._secrets_dir,
                                                           self.options.local_io, self.options.direct_io))
                self._storages[key] = store
                while len(self._storages) > _STORAGE_CACHE_SIZE:
                    self._storages.popitem(last=False)
            else:
                self._storages.move_to_end(key)
            return store

    def close(self) -> None:
        with self._lock:
            self._storages.clear()
            self._context = None
            if self._secrets is not None:
                shutil.rmtree(self._secrets, ignore_errors=True)
                self._secrets = None

    def _tensorstore_context(self):
        import tensorstore as ts
        with self._lock:
            if self._context is None:
                self._context = ts.Context(context_spec(self.options.io_concurrency, self.options.threads))
            return self._context

    def _secrets_dir(self, opts: Mapping[str, Any]) -> Optional[str]:
        """Explicit S3 keys -> a private 0600 credentials file in a 0700 directory of this instance
        (tensorstore has no inline static-key provider; see specs.aws_credentials_spec)."""
        if not (opts.get("access_key_id") and opts.get("secret_access_key")):
            return None
        cred_name, conf_name, cred_text, conf_text = static_credentials_files(opts)
        with self._lock:
            if self._secrets is None or not os.path.isdir(self._secrets):
                self._secrets = tempfile.mkdtemp(prefix="bytecheckpoint-aws-")
            for name, text in ((cred_name, cred_text), (conf_name, conf_text)):
                path = os.path.join(self._secrets, name)
                if not os.path.exists(path):
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "w") as f:
                        f.write(text)
            return self._secrets


def _freeze(opts: Any) -> Any:
    if opts is None:
        return None
    if isinstance(opts, Mapping):
        return tuple(sorted((str(k), repr(v)) for k, v in opts.items()))
    return ("invalid", repr(opts))
