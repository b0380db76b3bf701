"""SaveHandle (what save() returns) and PendingSaves (one Checkpointer's in-flight async saves)."""
from __future__ import annotations

import atexit
import sys
import threading
from concurrent.futures import Future
from typing import List, Optional

from ..common.errors import CheckpointError
from ..monitor import SaveStats


def _at_exit(fn) -> None:
    """Run `fn` at interpreter exit *before* the thread pools shut down: a save in flight still
    submits its later stages (write, commit) to the engine's pools, which refuse new work once
    `concurrent.futures` has run its own exit hook (plain `atexit` runs after it). CPython's
    `threading._register_atexit` is the hook `concurrent.futures` itself uses; plain `atexit`
    where it is missing."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn)
            return
    except RuntimeError:  # already shutting down
        pass
    atexit.register(fn)


class SaveHandle:
    """Returned by save(). wait() blocks until committed and re-raises a background failure."""

    def __init__(self, path: str, future: Optional[Future] = None, pending: Optional["PendingSaves"] = None):
        self.path = path
        self._future = future
        self._pending = pending
        self.stats = SaveStats()  # a dict of today's numbers + .phases, .done, .record, .metrics()

    def wait(self, timeout: Optional[float] = None) -> "SaveHandle":
        if self._future is not None:
            try:
                self._future.result(timeout)
            finally:
                if self._future.done() and self._pending is not None:  # a failure is delivered once, here
                    self._pending.forget(self)
        return self

    def done(self) -> bool:
        return self._future is None or self._future.done()

    @property
    def is_async(self) -> bool:
        """True when the write and commit run in the background (async save): wait() before
        relying on the checkpoint. False: it was committed before save() returned."""
        return self._future is not None

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, done={self.done()})"


class PendingSaves:
    """Async saves not yet waited for. A background failure is raised by the handle's wait(), by
    the next save(), or (if nobody waited) printed at interpreter exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: List[SaveHandle] = []
        self._closed = False
        _at_exit(self.report_at_exit)

    def add(self, handle: SaveHandle) -> None:
        with self._lock:
            self._handles.append(handle)

    def forget(self, handle: SaveHandle) -> None:
        with self._lock:
            if handle in self._handles:
                self._handles.remove(handle)

    def handles(self) -> List[SaveHandle]:
        with self._lock:
            return list(self._handles)

    def paths(self) -> List[str]:
        """Targets of saves still running."""
        return [h.path for h in self.handles() if not h.done()]

    def wait_all(self) -> None:
        """Wait for every pending save; re-raise the first failure after draining them all."""
        first: Optional[BaseException] = None
        for h in self.handles():
            try:
                h.wait()
            except BaseException as exc:  # noqa: BLE001 - remember, keep draining, re-raise below
                first = first or exc
        if first is not None:
            raise first

    def raise_finished_failures(self) -> None:
        """A background failure of an earlier save surfaces on the next save()."""
        for h in [h for h in self.handles() if h.done()]:
            try:
                h.wait()
            except BaseException as exc:
                raise CheckpointError(f"an earlier async save to {h.path!r} failed: {exc}") from exc

    def close(self) -> None:
        self._closed = True
        atexit.unregister(self.report_at_exit)

    def report_at_exit(self) -> None:
        """Never exit with a save in flight, and never drop a failure nobody waited for."""
        if self._closed:
            return
        handles = self.handles()
        running = sum(1 for h in handles if not h.done())
        if running:
            sys.stderr.write(f"bytecheckpoint: waiting for {running} async save(s) to finish before exit\n")
        for h in handles:
            try:
                h.wait()
            except BaseException as exc:  # noqa: BLE001 - exiting anyway: say loudly what was lost
                sys.stderr.write(f"bytecheckpoint: ERROR: async save to {h.path!r} failed and was not committed: "
                                 f"{exc}\n")
