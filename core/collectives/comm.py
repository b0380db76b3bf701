"""The single module that talks to torch.distributed.

Every collective is a no-op without an initialised process group, and `agree` turns a failure on
any rank into one error raised on every rank (no rank is left waiting in a collective).
"""
from __future__ import annotations

import datetime
import pickle
import socket
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from ..common.errors import CheckpointError, PeerTimeoutError, RemoteRankError

T = TypeVar("T")


class _Local:
    """`process_group=bytecheckpoint.LOCAL`: this process alone, even inside a process group (a
    save of state it holds whole, e.g. a DDP model saved by the main process only)."""

    def __repr__(self) -> str:
        return "bytecheckpoint.LOCAL"

    def __reduce__(self) -> str:
        return "LOCAL"  # the one instance, also after pickling (`is LOCAL` checks)


LOCAL = _Local()


class Comm:
    """`group`'s collectives. With a `watch` (liveness.PeerWatch), every wait is bounded: a peer
    whose heartbeat stopped for its dead_peer_s, or a wait longer than `timeout_s`, raises
    PeerTimeoutError naming the rank (collectives run on a background thread use this)."""

    def __init__(self, group: Optional[Any] = None, watch: Optional[Any] = None, timeout_s: float = 600.0):
        self.enabled = group is not LOCAL and dist.is_available() and dist.is_initialized()
        self.watch, self.timeout_s = watch, timeout_s
        self.group = group if self.enabled else None
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world_size = dist.get_world_size(group) if self.enabled else 1
        self.coordinator = 0  # group rank that plans and commits

    @property
    def key(self) -> Tuple[Any, int]:
        """Identifies the group for per-group caches (plans, host lists)."""
        return (id(self.group) if self.enabled else None, self.world_size)

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group)) if self.enabled else "none"

    def arrive(self, timeout_s: float, what: str) -> None:
        """Before a checkpoint's first collective: every rank must get here within `timeout_s`,
        or this rank raises (no rank waits without a bound for a peer that never comes)."""
        if not self.enabled or self.world_size == 1:
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if self.backend == "gloo":
                dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=True)
            else:  # NCCL and others: a tiny all-reduce whose wait is bounded
                t = torch.zeros(1, device=self._device())
                work = dist.all_reduce(t, group=self.group, async_op=True)
                if not work.wait(timeout):
                    raise RuntimeError(f"all-reduce did not complete in {timeout_s:g} s")
        except RuntimeError as exc:
            raise PeerTimeoutError(
                f"{what}: not every rank of the process group ({self.world_size} ranks) arrived within "
                f"{timeout_s:g} s. The call is collective: it was probably made on a subset of ranks (e.g. inside "
                f"`if rank == 0:`); call it on every rank, or pass process_group=bytecheckpoint.LOCAL to save or "
                f"load state this process holds whole by itself. [{exc}]") from exc

    def hosts(self) -> List[str]:
        """The host name of every rank (which ranks share a machine)."""
        return self.all_gather(socket.gethostname())

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    # ------------------------------------------------------------ object collectives
    def all_gather(self, obj: Any) -> List[Any]:
        if not self.enabled or self.world_size == 1:
            return [obj]
        if self.watch is not None:
            return self._bounded_all_gather(obj)
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Objects of all ranks on the coordinator; None elsewhere."""
        if not self.enabled or self.world_size == 1:
            return [obj]
        out: Optional[List[Any]] = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, dst=self._global(self.coordinator), group=self.group)
        return out

    def broadcast(self, obj: Any, src: Optional[int] = None) -> Any:
        if not self.enabled or self.world_size == 1:
            return obj
        root = self.coordinator if src is None else src
        if self.watch is not None:
            return self._bounded_all_gather(obj if self.rank == root else None)[root]
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(root), group=self.group)
        return box[0]

    def scatter(self, objs: Optional[Sequence[Any]]) -> Any:
        """The coordinator's objs[r] arrives at rank r."""
        if not self.enabled or self.world_size == 1:
            return objs[0]  # type: ignore[index]
        out: List[Any] = [None]
        dist.scatter_object_list(out, list(objs) if self.is_coordinator else None,
                                 src=self._global(self.coordinator), group=self.group)
        return out[0]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (one all-reduce: several yes/no questions at once)."""
        if not self.enabled or self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_of(self, flags: Sequence[bool]) -> List[bool]:
        """Per position, whether every rank's flag is set (one all-reduce of a byte per flag)."""
        if not self.enabled or self.world_size == 1:
            return list(flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.uint8, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [bool(v) for v in t.tolist()]

    def barrier(self) -> None:
        """Bounded only with a watch (the local tier's end of job)."""
        if self.enabled and self.world_size > 1:
            if self.watch is None:
                dist.barrier(group=self.group)
            else:
                self._wait(dist.all_reduce(torch.zeros(1), group=self.group, async_op=True), "barrier")

    # ------------------------------------------------------------ tensor collectives
    def exchange(self, sends: Sequence[Tuple[int, torch.Tensor]], receives: Sequence[Tuple[int, torch.Tensor]]) -> None:
        """Point to point: send each (group rank, tensor), receive into each (group rank, tensor),
        all posted at once (no ordering deadlock); waits bounded with a watch."""
        if not self.enabled or self.world_size == 1:
            return
        works = [dist.isend(t, dst=self._global(dst), group=self.group) for dst, t in sends if t.numel()]
        works += [dist.irecv(t, src=self._global(src), group=self.group) for src, t in receives if t.numel()]
        if self.watch is None:
            for w in works:
                w.wait()
            return
        # gloo's point-to-point work completes only inside wait(): wait on a helper thread, watched
        self._wait(_WaitingThread(works), "replica transfer")

    def broadcast_tensor_async(self, t: torch.Tensor, src: int):
        """Start a broadcast; returns its work handle (`.wait()`), or None when there is nothing to do."""
        if self.enabled and self.world_size > 1:
            return dist.broadcast(t, src=self._global(src), group=self.group, async_op=True)
        return None

    def tensor_device(self) -> torch.device:
        return self._device()

    def _device(self) -> torch.device:
        backend = dist.get_backend(self.group) if self.enabled else "gloo"
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------ bounded waits (with a watch)
    def _bounded_all_gather(self, obj: Any) -> List[Any]:
        """all_gather_object over tensor collectives whose waits are polled (gloo CPU tensors)."""
        data = pickle.dumps(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group,
                                   async_op=True), "exchanging sizes")
        longest = max(int(n) for n in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(dist.all_gather(out, mine, group=self.group, async_op=True), "exchanging plans")
        return [pickle.loads(t[:int(n)].numpy().tobytes()) for t, n in zip(out, sizes)]

    def _wait(self, work: Any, what: str) -> None:
        """Wait for `work`; with a watch, poll it and give up on a dead peer or after timeout_s. A
        transport error (a peer's socket closed) is turned into the dead peer's name when its
        heartbeat stops within dead_peer_s."""
        if self.watch is None:
            work.wait()
            return
        start = time.monotonic()
        self.watch.start_waiting()
        delay = 0.001
        while not work.is_completed():
            self.watch.check(what)
            if time.monotonic() - start > self.timeout_s:
                raise PeerTimeoutError(f"{what}: gave up after {self.timeout_s:g} s waiting for the other ranks "
                                       f"(timeout_s); nothing was committed")
            time.sleep(delay)
            delay = min(0.05, delay * 2)
        try:
            work.wait()
        except RuntimeError as exc:  # e.g. gloo "Connection closed by peer": find out who
            deadline = time.monotonic() + self.watch.dead_peer_s + 2.0
            while time.monotonic() < deadline:
                self.watch.check(what)
                time.sleep(0.05)
            raise PeerTimeoutError(f"{what}: the transfer failed ({exc}); every peer still has a heartbeat, so "
                                   f"the network failed rather than a rank") from exc

    # ------------------------------------------------------------ failure agreement
    def agree(self, error: Optional[BaseException], what: str) -> None:
        """Raise on every rank if any rank had an error in step `what`."""
        local = None if error is None else f"{type(error).__name__}: {error}"
        statuses = self.all_gather(local) if self.enabled else [local]
        failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
        if not failed:
            return
        if error is not None and len(failed) == 1:
            raise error
        detail = "; ".join(f"rank {r}: {s}" for r, s in failed[:8])
        more = f" (and {len(failed) - 8} more ranks)" if len(failed) > 8 else ""
        exc = RemoteRankError(f"{what} failed on {len(failed)} of {self.world_size} ranks: {detail}{more}")
        if error is not None:
            raise exc from error
        raise exc

    def run(self, fn: Callable[[], T], what: str) -> T:
        """Run fn on every rank; if it fails anywhere, every rank raises."""
        try:
            result = fn()
            error = None
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank by agree()
            result, error = None, exc
        self.agree(error, what)
        return result  # type: ignore[return-value]

    def run_on_coordinator(self, fn: Callable[[], T], what: str) -> T:
        """fn runs on the coordinator; its result (or its error) reaches every rank."""
        payload: Tuple[bool, Any] = (True, None)
        if self.is_coordinator:
            try:
                payload = (True, fn())
            except Exception as exc:  # noqa: BLE001 - shipped to every rank below
                payload = (False, exc if _picklable(exc) else CheckpointError(f"{type(exc).__name__}: {exc}"))
        ok, value = self.broadcast(payload)
        if not ok:
            raise value
        return value


class _WaitingThread:
    """Work handles waited for on a daemon thread, seen as one work (is_completed / wait). A wait
    stuck on a dead peer stays on that thread; its group is not used again (TierState.mark_broken)."""

    def __init__(self, works: Sequence[Any]):
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(list(works),), daemon=True, name="bytecheckpoint-p2p-wait").start()

    def _run(self, works: List[Any]) -> None:
        try:
            for w in works:
                w.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the caller's thread
            self._error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


def _picklable(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))
        return True
    except Exception:  # noqa: BLE001 - any failure means "send a plain copy instead"
        return False
