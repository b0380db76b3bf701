"""Worker threads for one operation, and the background runner of async saves.

crc32, tobytes, file I/O and tensor copies release the GIL, so chunks are encoded, checked and
moved in parallel. Threads belong to one save or load and end with it: a Checkpointer that is
idle holds no thread (frameworks check for leaked threads after teardown).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, List, Optional, Sequence


class Workers:
    """A small pool for one operation; `map` keeps order. Use as a context manager. `cpu_s`: the
    CPU seconds its pool threads spent on tasks (what an async save's background costs)."""

    def __init__(self, threads: int, name: str = "bytecheckpoint-io"):
        self._threads, self._name = max(1, threads), name
        self._pool: Optional[ThreadPoolExecutor] = None
        self._cpu: List[float] = []

    @property
    def cpu_s(self) -> float:
        return sum(self._cpu)

    def map(self, fn: Callable[..., Any], items: Sequence) -> Iterator:
        """fn(*item) for tuples, fn(item) otherwise; all submitted at once, results in order."""
        if not items or self._threads == 1:
            return map(lambda a: fn(*a) if isinstance(a, tuple) else fn(a), items)

        def call(a: Any) -> Any:
            c0 = time.thread_time()
            try:
                return fn(*a) if isinstance(a, tuple) else fn(a)
            finally:
                self._cpu.append(time.thread_time() - c0)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix=self._name)
        futures = [self._pool.submit(call, a) for a in items]
        return (f.result() for f in futures)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BackgroundRunner:
    """Runs async-save jobs one after another, each on its own thread, which ends with the job.

    Jobs keep their submission order: `fn(wait_turn)` runs at once on its thread and calls
    `wait_turn()` before the part that must follow the previous job (so a job can start its
    heartbeat while it waits), and two saves never commit out of order. `join()` returns when no
    job thread is left."""

    def __init__(self, name: str = "bytecheckpoint-save"):
        self._name = name
        self._lock = threading.Lock()
        self._last: Optional[threading.Thread] = None
        self._threads: list = []

    def submit(self, fn: Callable[[Callable[[], None]], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            previous = self._last

            def wait_turn() -> None:
                if previous is not None:
                    previous.join()

            thread = threading.Thread(target=_deliver, args=(future, lambda: fn(wait_turn)), name=self._name,
                                      daemon=False)
            self._last = thread
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()
        return future

    def spawn(self, fn: Callable[[], Any], name: str = "bytecheckpoint-warm-up") -> Future:
        """Run `fn()` on a thread of its own, outside the jobs' order (no job waits for it; join()
        does): a background warm-up that may wait for a slot a running save holds."""
        future: Future = Future()
        thread = threading.Thread(target=_deliver, args=(future, fn), name=name, daemon=False)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()
        return future

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for every job thread, including jobs that running jobs submit (e.g. pre-faulting)."""
        while True:
            with self._lock:
                threads = [t for t in self._threads if t.is_alive() and t is not threading.current_thread()]
            for t in threads:
                t.join(timeout)
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
            if not threads or timeout is not None:
                return


def _deliver(future: Future, fn: Callable[[], Any]) -> None:
    """A job thread's body: fn()'s result or exception into `future`."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - delivered through the future
        future.set_exception(exc)
