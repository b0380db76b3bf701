"""Fault injection at the kvstore layer, for tests (off unless configured; one dict lookup when off).

Every key-value request of the library (tensor chunks, per-rank value files, the metadata
commit, listing, deletes) goes through `Store.kv`. When faults are configured, `Store.kv` is a
`FaultyKvStore` that wraps the real tensorstore KvStore and, for requests that match a rule,
fails them the way tensorstore reports a failure (a future whose result() raises ValueError with a
tensorstore-style status), delays them, or kills the process with SIGKILL.

Configure in-process with the `inject(...)` context manager, or for subprocesses (every rank of a
multi-process test) with the environment variable BCP_FAULTS holding a JSON list of rules:

    BCP_FAULTS='[{"op": "write", "kind": "enospc", "key": "/c/", "rank": 1}]'

Rule fields (see `Fault`): op (write|read|list|delete|sync|any), kind (error|enospc|denied|
unavailable|slow|kill), key (substring of the key; "" = all), skip (let the first N matches
pass), count (fire N times; 0 = every time), delay_s (slow), rank (only where RANK matches).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

ENV = "BCP_FAULTS"
OPS = ("write", "read", "list", "delete", "sync", "any")
KINDS = ("error", "enospc", "denied", "unavailable", "slow", "kill")

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


@dataclass
class Fault:
    op: str = "any"
    kind: str = "error"
    key: str = ""
    skip: int = 0
    count: int = 0
    delay_s: float = 0.0
    rank: Optional[int] = None
    # bookkeeping
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


_LOCK = threading.Lock()
_ACTIVE: List[Fault] = []
_ENV_LOADED: Optional[str] = None


def _load_env() -> None:
    """(Re)load the rules from BCP_FAULTS when it changes."""
    global _ENV_LOADED
    raw = os.environ.get(ENV, "")
    if raw == _ENV_LOADED:
        return
    _ENV_LOADED = raw
    _ACTIVE[:] = [r for r in _ACTIVE if not getattr(r, "_from_env", False)]
    if raw:
        for spec in json.loads(raw):
            rule = Fault(**spec)
            rule._from_env = True  # type: ignore[attr-defined]
            _ACTIVE.append(rule)


def active() -> bool:
    with _LOCK:
        _load_env()
        return bool(_ACTIVE)


@contextlib.contextmanager
def inject(*rules: Fault | Dict[str, Any]) -> Iterator[List[Fault]]:
    """Activate rules in this process for the duration of the block; yields them (see .fired)."""
    made = [r if isinstance(r, Fault) else Fault(**r) for r in rules]
    with _LOCK:
        _ACTIVE.extend(made)
    try:
        yield made
    finally:
        with _LOCK:
            for r in made:
                if r in _ACTIVE:
                    _ACTIVE.remove(r)


def fire(op: str, key: str) -> Optional[str]:
    """Apply matching rules for one request: sleep for `slow`, die for `kill`; return the error
    message of a failing rule (or None)."""
    with _LOCK:
        _load_env()
        hits = [r for r in _ACTIVE if r.matches(op, key)]
    error = None
    for r in hits:
        if r.kind == "slow":
            time.sleep(r.delay_s)
        elif r.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # pragma: no cover - SIGKILL is not deliverable late
        elif error is None:
            error = _MESSAGES[r.kind].format(key=key)
    return error


def check(op: str, key: str) -> None:
    """For synchronous operations (sync): raise the injected error directly."""
    msg = fire(op, key)
    if msg is not None:
        raise ValueError(msg)


class FailedFuture:
    """Stands in for a tensorstore Future whose request failed."""

    def __init__(self, message: str):
        self._exc = ValueError(message)

    def result(self, timeout: Optional[float] = None) -> Any:
        raise self._exc

    def exception(self, timeout: Optional[float] = None) -> BaseException:
        return self._exc

    def done(self) -> bool:
        return True

    def add_done_callback(self, fn) -> None:
        fn(self)

    def cancel(self) -> bool:
        return False

    def __await__(self):  # pragma: no cover - the library does not await futures
        raise self._exc
        yield


class FaultyKvStore:
    """A tensorstore KvStore with faults injected in front of read/write/list/delete_range."""

    def __init__(self, kv: Any):
        self._kv = kv

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def read(self, key, *args, **kwargs):
        msg = fire("read", _key(key))
        return FailedFuture(msg) if msg else self._kv.read(key, *args, **kwargs)

    def write(self, key, value, *args, **kwargs):
        msg = fire("delete" if value is None else "write", _key(key))
        return FailedFuture(msg) if msg else self._kv.write(key, value, *args, **kwargs)

    def list(self, *args, **kwargs):
        msg = fire("list", "")
        return FailedFuture(msg) if msg else self._kv.list(*args, **kwargs)

    def delete_range(self, rng, *args, **kwargs):
        msg = fire("delete", _key(getattr(rng, "inclusive_min", b"")))
        return FailedFuture(msg) if msg else self._kv.delete_range(rng, *args, **kwargs)


def wrap(kv: Any) -> Any:
    return FaultyKvStore(kv)


class _Failed:
    def __init__(self, exc: BaseException):
        self._exc = exc

    def result(self):
        raise self._exc


_ERRNO = {"error": 5, "enospc": 28, "denied": 13, "unavailable": 11}


class FaultyChunkIO:
    """The same rules in front of the POSIX chunk I/O used for local directories (chunk_io.py),
    failing the way the OS does (OSError with EIO / ENOSPC / EACCES / EAGAIN)."""

    def __init__(self, io: Any):
        self._io = io

    def __getattr__(self, name: str) -> Any:
        return getattr(self._io, name)

    def _os_error(self, msg: str, key: str) -> OSError:
        kind = next((k for k in _ERRNO if _MESSAGES[k].format(key=key) == msg), "error")
        return OSError(_ERRNO[kind], f"{os.strerror(_ERRNO[kind])} [injected fault]", key)

    def write(self, key: str, payload: Any):
        msg = fire("write", key)
        if msg:
            return 0, 0, _Failed(self._os_error(msg, key))
        return self._io.write(key, payload)

    def read(self, key: str):
        msg = fire("read", key)
        return _Failed(self._os_error(msg, key)) if msg else self._io.read(key)

    def read_into(self, key: str, dest: Any):
        msg = fire("read", key)
        if msg:
            raise self._os_error(msg, key)
        return self._io.read_into(key, dest)


def wrap_chunk_io(io: Any) -> Any:
    """Chunk I/O with faults, if any are configured (KvChunkIO already goes through Store.kv)."""
    if getattr(io, "direct", False) and active():
        return FaultyChunkIO(io)
    return io


def _key(key: Any) -> str:
    return key.decode(errors="replace") if isinstance(key, (bytes, bytearray)) else str(key)


def rules_env(rules: Sequence[Dict[str, Any]]) -> Dict[str, str]:
    """{BCP_FAULTS: json} for a subprocess environment."""
    return {ENV: json.dumps(list(rules))}
