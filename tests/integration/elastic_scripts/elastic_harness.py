"""Several torchrun elastic agents on this machine, each a "node": start them, kill one with all
its processes, watch what their workers report (elastic_common.py's events).

    with Cluster(workdir, "core_train.py", env={...}) as c:
        c.start("a"); c.start("b")
        ev = c.wait_for("both ranks stepped", lambda evs: ...)
        c.kill("a")

Each agent runs `torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d
--rdzv-endpoint=127.0.0.1:<port> --max-restarts=N`, in a session of its own (its workers, which
torchrun starts in sessions of their own, are found through /proc and killed by process group).
The rendezvous store is hosted by this process (a TCPStore on a free port; the agents join it with
`is_host=false`), like a rendezvous endpoint on a machine that outlives the nodes: torchrun's
c10d rendezvous cannot survive the loss of the node that hosts its store. Every wait is bounded; on
failure the agents' logs and the events are in the message, and close() kills everything.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

#: Rendezvous settings for fast recovery (docs/elastic.md): a lost node is dropped from the
#: rendezvous keep_alive_interval * keep_alive_max_attempt seconds after its last heartbeat (sent
#: every interval plus the time of the store update), and a round with at least MIN nodes closes
#: last_call_timeout seconds after MIN was reached (whole seconds, at least 1). With 1 s x 2 a live
#: node under load was declared dead and the next node to join started a job of its own beside it.
FAST_RDZV = {"join_timeout": 120, "last_call_timeout": 1, "close_timeout": 10, "keep_alive_interval": 1,
             "keep_alive_max_attempt": 3}
#: What the tests use: one more second of slack against heartbeats delayed on a busy machine.
TOLERANT_RDZV = dict(FAST_RDZV, keep_alive_max_attempt=4)
#: The engine side: an async save gives up on a dead peer after 2 s (default 30 s), so a survivor
#: whose save was collective leaves (and is restarted) quickly; collectives are bounded at 60 s.
FAST_BCP_ENV = {"BCP_DEAD_PEER_S": "2", "BCP_TIMEOUT_S": "60"}


#: torch 2.13's agents share their rendezvous store with the workers by default, and then a node
#: that joins a running job waits forever (60 s: the store's read timeout) for the worker store's
#: address when the previous rank-0 agent stays rank 0: that agent published the address under the
#: previous round's key prefix only (dynamic_rendezvous.next_rendezvous builds it once). Without
#: sharing, the rank-0 agent publishes a fresh address in every round. docs/elastic.md.
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class ClusterError(AssertionError):
    pass


def _children() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def descendants(pid: int) -> List[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s process group and every descendant's (a lost node: no teardown at all)."""
    try:
        os.killpg(pid, signal.SIGSTOP)  # a stopped agent starts no new worker while we look
    except ProcessLookupError:
        pass
    for p in [pid, *descendants(pid)]:
        for kill in (lambda: os.killpg(os.getpgid(p), signal.SIGKILL), lambda: os.kill(p, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass


class Cluster:
    def __init__(self, workdir: str, script: str, args: List[str] = (), *, env: Optional[Dict[str, str]] = None,
                 max_restarts: int = 3, nnodes: str = "1:2", rdzv: Optional[Dict[str, Any]] = None,
                 bcp_env: Optional[Dict[str, str]] = None) -> None:
        import torch.distributed as dist

        self.workdir = os.path.abspath(workdir)
        os.makedirs(os.path.join(self.workdir, "gates"), exist_ok=True)
        self.script = script if os.path.isabs(script) else os.path.join(HERE, script)
        self.args = list(args)
        self.max_restarts = max_restarts
        self.nnodes = nnodes
        self.rdzv = dict(FAST_RDZV if rdzv is None else rdzv, is_host="false")
        self.env = {**(FAST_BCP_ENV if bcp_env is None else bcp_env), **(env or {})}
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                                   timeout=datetime.timedelta(seconds=60))
        self.port = self.store.port
        self.run_id = f"bcp-elastic-{os.getpid()}-{int(time.time() * 1000) % 10**9}"
        self.agents: Dict[str, subprocess.Popen] = {}
        self.killed: Dict[str, float] = {}
        self.changes: List[float] = []   # times of membership changes (a node lost or added)
        self.events_path = os.path.join(self.workdir, "events.jsonl")

    # ------------------------------------------------------------------ nodes
    def command(self) -> List[str]:
        conf = ",".join(f"{k}={v}" for k, v in self.rdzv.items())
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.run_id}",
                f"--rdzv-conf={conf}", f"--max-restarts={self.max_restarts}", "--monitor-interval=0.1",
                "--local-addr=127.0.0.1", self.script, *self.args]

    def start(self, node: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
               "ELASTIC_DIR": self.workdir, "ELASTIC_NODE": node,
               "LOGLEVEL": os.environ.get("ELASTIC_LOGLEVEL", "INFO"), **NO_SHARED_STORE, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, HERE, env.get("PYTHONPATH")) if p)
        if any(p.poll() is None for p in self.agents.values()):
            self.changes.append(time.time())
        log = open(os.path.join(self.workdir, f"agent_{node}.log"), "ab")
        self.agents[node] = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                             cwd=self.workdir, start_new_session=True)
        log.close()

    def kill(self, node: str) -> float:
        """Lose `node`: its agent and every worker, SIGKILLed. Returns the time of the kill."""
        kill_tree(self.agents[node].pid)
        t = time.time()
        self.killed[node] = t
        self.changes.append(t)
        self.agents[node].wait(30)
        return t

    def open_gate(self, name: str) -> None:
        with open(os.path.join(self.workdir, "gates", name), "w"):
            pass

    # ------------------------------------------------------------------ what happened
    def events(self) -> List[Dict[str, Any]]:
        try:
            with open(self.events_path) as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    def logs(self, chars: int = 6000) -> str:
        out = []
        for node in self.agents:
            path = os.path.join(self.workdir, f"agent_{node}.log")
            try:
                with open(path, errors="replace") as f:
                    out.append(f"----- agent {node} -----\n{f.read()[-chars:]}")
            except OSError:
                pass
        return "\n".join(out)

    def fail(self, why: str) -> None:
        events = "\n".join(json.dumps({k: v for k, v in e.items() if k != "traceback"}) for e in self.events()[-40:])
        errors = "\n".join(e.get("traceback", "") for e in self.unexpected_errors(self.events()))
        raise ClusterError(f"{why}\n----- last events -----\n{events}\n{errors}\n{self.logs()}")

    def wait_for(self, what: str, predicate: Callable[[List[Dict[str, Any]]], Any], timeout: float) -> Any:
        """Poll the events until `predicate(events)` is truthy (returns it); fail on an error event, an
        agent that exited on its own with a failure, or the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            events = self.events()
            errors = self.unexpected_errors(events)
            if errors:
                self.fail(f"a worker failed while waiting for {what}: {errors[0]['error']}")
            found = predicate(events)
            if found:
                return found
            for node, proc in self.agents.items():
                code = proc.poll()
                if code not in (None, 0) and node not in self.killed:
                    self.fail(f"agent {node} exited {code} while waiting for {what}")
            if time.monotonic() > deadline:
                self.fail(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.05)

    def unexpected_errors(self, events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Failures of workers that did not live through a membership change. A worker whose peer
        was lost fails by design (its collectives break, torchrun restarts it); any other failure
        is a bug."""
        started = {e["pid"]: e["t"] for e in events if e["event"] == "start"}
        return [e for e in events if e["event"] == "error"
                and not any(started.get(e["pid"], e["t"]) <= t <= e["t"] for t in self.changes)]

    def wait_exit(self, node: str, timeout: float) -> int:
        try:
            code = self.agents[node].wait(timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"agent {node} did not finish within {timeout:.0f} s")
        if code != 0:
            self.fail(f"agent {node} exited {code}")
        return code

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        script = os.path.basename(self.script).encode()
        for pid in {e["pid"] for e in self.events()}:  # workers whose agent died first (orphans)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if script in f.read():
                        os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        del self.store

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------- event helpers
def of(events: List[Dict[str, Any]], event: str, **match: Any) -> List[Dict[str, Any]]:
    return [e for e in events if e["event"] == event and all(e.get(k) == v for k, v in match.items())]


def after(events: List[Dict[str, Any]], t: float) -> List[Dict[str, Any]]:
    return [e for e in events if e["t"] >= t]
