"""Liveness of the ranks of one group, through the c10d store every rank already shares: each
rank taking part in a background job bumps its own counter every `dead_peer_s / 6`; a rank
waiting on a collective reads its peers' counters about once a second and gives up on a peer
whose counter has not moved for `dead_peer_s` (it died or hangs). This is how collectives that
run on a background thread (the local tier's transfers and commit) stay bounded by `dead_peer_s`
like the persistent async save's marker board (commit.MarkerBoard), instead of by gloo's timeout.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..common.errors import PeerTimeoutError


class PeerWatch:
    """Heartbeats of one group's ranks in `store` under `prefix`. `ranks`: the global rank of each
    group rank (for messages). The heartbeat runs between hold() and the matching release(), while any
job holds it."""

    def __init__(self, store: Any, prefix: str, rank: int, ranks: Sequence[int], dead_peer_s: float):
        self.store, self.prefix, self.rank, self.ranks = store, prefix, rank, list(ranks)
        self.dead_peer_s = dead_peer_s
        self._users = 0
        self._lock = threading.Lock()
        self._stop: Optional[threading.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._seen: Dict[int, Tuple[int, float]] = {}
        self._next_check = 0.0

    def _key(self, r: int) -> str:
        return f"{self.prefix}/beat/{r}"

    # ------------------------------------------------------------ this rank's heartbeat
    def hold(self) -> None:
        """Start beating (or keep beating) until a matching release()."""
        with self._lock:
            self._users += 1
            if self._thread is not None:
                return
            self._beat()  # at once: peers may start watching before the thread's first beat
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stop,), daemon=True,
                                            name="bytecheckpoint-tier-heartbeat")
            self._thread.start()

    def release(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users or self._thread is None:
                return
            stop, thread = self._stop, self._thread
            self._stop = self._thread = None
        stop.set()
        thread.join()

    def _run(self, stop: threading.Event) -> None:
        interval = max(0.2, self.dead_peer_s / 6)
        while not stop.wait(interval):
            self._beat()

    def _beat(self) -> None:
        try:
            self.store.add(self._key(self.rank), 1)
        except Exception:  # noqa: BLE001 - a missed beat only makes peers wait longer; waits report the store
            pass

    # ------------------------------------------------------------ peers
    def start_waiting(self) -> None:
        """A new wait: peers' counters are compared from now on."""
        self._seen.clear()
        self._next_check = 0.0

    def check(self, what: str) -> None:
        """Raise PeerTimeoutError naming the peers whose heartbeat stopped `dead_peer_s` ago."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + min(1.0, self.dead_peer_s / 4)
        dead: List[int] = []
        for r in range(len(self.ranks)):
            if r == self.rank:
                continue
            try:
                count = int(self.store.add(self._key(r), 0))
            except Exception as exc:  # noqa: BLE001 - the store's host is gone: as fatal as a dead peer
                raise PeerTimeoutError(
                    f"{what}: the job's rendezvous store is unreachable ({type(exc).__name__}: {exc}); the process "
                    f"hosting it (rank {self.ranks[0]} or the launcher) probably died. Nothing was committed; earlier "
                    f"checkpoints are intact") from exc
            last = self._seen.get(r)
            if last is None or last[0] != count:
                self._seen[r] = (count, now)
            elif now - last[1] > self.dead_peer_s:
                dead.append(r)
        if dead:
            who = ", ".join(str(self.ranks[r]) for r in dead)
            raise PeerTimeoutError(
                f"{what}: rank{'s' if len(dead) > 1 else ''} {who} stopped responding (no heartbeat for more than "
                f"{self.dead_peer_s:g} s): it died or hangs. This local checkpoint was not committed; earlier ones "
                f"are intact (Checkpointer(dead_peer_s=...) sets the limit)")
