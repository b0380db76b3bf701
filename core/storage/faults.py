"""Fault injection for tests: a Storage wrapper that fails, delays or kills requests by rule.

Nothing in the production path knows about it: a Checkpointer wraps its storages in
`FaultyStorage` only while rules are installed on it. Install rules in-process with

    with faults.inject({"op": "write", "kind": "enospc", "key": "/c/"}, checkpointer=ckpt): ...

(for bcp.save/load's engine, `checkpointer=default_checkpointer()`), or for subprocesses
(every rank of a multi-process test) with the environment variable BCP_FAULTS, read when a
Checkpointer is built from the environment (the default instance, the adapters' own):

    BCP_FAULTS='[{"op": "write", "kind": "enospc", "key": "/c/", "rank": 1}]'

Rule fields (see `Fault`): op (write|read|list|delete|sync|any), kind (error|enospc|denied|
unavailable|slow|hang|kill), key (substring of the key; "" = all), skip (let the first N matches
pass), count (fire N times; 0 = every time), delay_s (slow/hang), rank (only where RANK matches).
Failures look like the wrapped storage's own: OSError with an errno for local directories,
the classified StorageError of a tensorstore status for kvstores.
"""
from __future__ import annotations

import contextlib
import errno as _errno
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .base import Done, Request, Storage, Version
from .errors import classify, classify_os_error

ENV = "BCP_FAULTS"
OPS = ("write", "read", "list", "delete", "sync", "any")
KINDS = ("error", "enospc", "denied", "unavailable", "slow", "hang", "kill")

# What tensorstore itself says for each kind (the library's error handling sees the same text).
_MESSAGES = {
    "error": "UNKNOWN: Error writing local file {key!r}: Input/output error [OS error 5: Input/output error] "
             "[injected fault]",
    "enospc": "RESOURCE_EXHAUSTED: Error writing local file {key!r}: No space left on device "
              "[OS error 28: No space left on device] [injected fault]",
    "denied": "PERMISSION_DENIED: AccessDenied: Access Denied. [http_response_code='403'] [injected fault]",
    "unavailable": "UNAVAILABLE: InternalError: We encountered an internal error. Please try again. "
                   "[http_response_code='503'] [injected fault]",
}
_ERRNO = {"error": _errno.EIO, "enospc": _errno.ENOSPC, "denied": _errno.EACCES, "unavailable": _errno.EAGAIN}


@dataclass
class Fault:
    op: str = "any"
    kind: str = "error"
    key: str = ""
    skip: int = 0
    count: int = 0
    delay_s: float = 0.0
    rank: Optional[int] = None
    seen: int = field(default=0, repr=False)
    fired: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"fault op {self.op!r} is not one of {OPS}")
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {KINDS}")

    def matches(self, op: str, key: str) -> bool:
        if self.op not in ("any", op) or (self.key and self.key not in key):
            return False
        if self.rank is not None and os.environ.get("RANK", "0") != str(self.rank):
            return False
        self.seen += 1
        if self.seen <= self.skip or (self.count and self.fired >= self.count):
            return False
        self.fired += 1
        return True


class Rules:
    """The active rules of one Checkpointer (thread-safe)."""

    def __init__(self, rules: Sequence[Fault] = ()):
        self._lock = threading.Lock()
        self._rules: List[Fault] = list(rules)

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._rules)

    def rules(self) -> List[Fault]:
        with self._lock:
            return list(self._rules)

    def add(self, rules: Sequence[Fault]) -> None:
        with self._lock:
            self._rules.extend(rules)

    def remove(self, rules: Sequence[Fault]) -> None:
        with self._lock:
            for r in rules:
                if r in self._rules:
                    self._rules.remove(r)

    def fire(self, op: str, key: str) -> Optional[str]:
        """Apply matching rules to one request: sleep for `slow`/`hang`, die for `kill`; return the
        kind of a failing rule (or None)."""
        with self._lock:
            hits = [r for r in self._rules if r.matches(op, key)]
        failing = None
        for r in hits:
            if r.kind in ("slow", "hang"):
                time.sleep(r.delay_s if r.kind == "slow" else (r.delay_s or 3600))
            elif r.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # pragma: no cover - SIGKILL is not deliverable late
            elif failing is None:
                failing = r.kind
        return failing


def rules_from_env(env: Optional[Dict[str, str]] = None) -> List[Fault]:
    raw = (os.environ if env is None else env).get(ENV, "")
    return [Fault(**spec) for spec in json.loads(raw)] if raw else []


def rules_env(rules: Sequence[Dict[str, Any]]) -> Dict[str, str]:
    """{BCP_FAULTS: json} for a subprocess environment."""
    return {ENV: json.dumps(list(rules))}


@contextlib.contextmanager
def inject(*rules: Fault | Dict[str, Any], checkpointer: Any) -> Iterator[List[Fault]]:
    """Activate rules on `checkpointer` (its `fault_rules`) for the block; yields them. For the
    engine behind bcp.save, pass bytecheckpoint.checkpointer.default_checkpointer()."""
    made = [r if isinstance(r, Fault) else Fault(**r) for r in rules]
    checkpointer.fault_rules.add(made)
    try:
        yield made
    finally:
        checkpointer.fault_rules.remove(made)


class FaultyStorage(Storage):
    """`inner` with the rules applied in front of every request."""

    def __init__(self, inner: Storage, rules: Rules):
        self._inner, self._rules = inner, rules
        self.url, self.scheme, self.request_timeout_s = inner.url, inner.scheme, inner.request_timeout_s
        self.read_only = inner.read_only

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _error(self, kind: str, op: str, key: str, bulk: bool = False) -> Exception:
        """What the wrapped storage itself raises: bulk POSIX requests fail with a bare OSError
        (the chunk layer names the tensor), everything else with a classified StorageError."""
        from .posix import PosixStorage
        if isinstance(self._inner, PosixStorage):
            exc = OSError(_ERRNO[kind], f"{os.strerror(_ERRNO[kind])} [injected fault]", key)
            return exc if bulk else classify_os_error(exc, f"{op} {self.where(key)!r}", self.url)
        return classify(ValueError(_MESSAGES[kind].format(key=key)), f"{op} {self.where(key)}", self.url)

    def _check(self, op: str, key: str) -> None:
        kind = self._rules.fire(op, key)
        if kind is not None:
            raise self._error(kind, op, key)

    def _bulk(self, op: str, key: str, start) -> Request:
        kind = self._rules.fire(op, key)
        return Done(error=self._error(kind, op, key, bulk=True)) if kind else start()

    def write(self, key: str, data: memoryview) -> Request:
        return self._bulk("write", key, lambda: self._inner.write(key, data))

    def write_parts(self, key: str, parts) -> Request:
        return self._bulk("write", key, lambda: self._inner.write_parts(key, parts))

    def read(self, key: str) -> Request:
        return self._bulk("read", key, lambda: self._inner.read(key))

    def read_into(self, key: str, dest: memoryview) -> Request:
        return self._bulk("read", key, lambda: self._inner.read_into(key, dest))

    def read_range(self, key: str, start: int, stop: int) -> Request:
        return self._bulk("read", key, lambda: self._inner.read_range(key, start, stop))

    def read_range_into(self, key: str, start: int, dests) -> Request:
        return self._bulk("read", key, lambda: self._inner.read_range_into(key, start, dests))

    def get(self, key: str) -> Optional[bytes]:
        self._check("read", key)
        return self._inner.get(key)

    def get_versioned(self, key: str, known: Version = None) -> Tuple[Version, Optional[bytes], bool]:
        self._check("read", key)
        return self._inner.get_versioned(key, known)

    def put(self, key: str, data: bytes, *, if_absent: bool = False, durable: bool = False) -> bool:
        self._check("write", key)
        return self._inner.put(key, data, if_absent=if_absent, durable=durable)

    def put_aside(self, key: str, data: bytes) -> Request:
        return self._bulk("write", key, lambda: self._inner.put_aside(key, data))

    def list(self, prefix: str = "") -> List[str]:
        self._check("list", prefix)
        return self._inner.list(prefix)

    def delete(self, key: str) -> None:
        self._check("delete", key)
        self._inner.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self._check("delete", prefix)
        self._inner.delete_prefix(prefix)

    def remove_root(self) -> None:
        self._check("delete", "")
        self._inner.remove_root()

    def exists_any(self) -> bool:
        return self._inner.exists_any()

    def prepare(self, keys) -> None:
        self._inner.prepare(keys)

    def sync(self) -> None:
        self._check("sync", self.url)
        self._inner.sync()
