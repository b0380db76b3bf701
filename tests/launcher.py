"""Run a function on N gloo ranks in fresh processes, with a hard time limit.

Each rank is `python -m launcher_worker MODULE:FUNC` with RANK/WORLD_SIZE/MASTER_* set. If any
rank fails, the others are killed at once (no rank waits forever in a collective), and the
failing rank's output is raised as the test failure.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: str, world_size: int, args: Optional[Dict[str, Any]] = None, timeout: float = 120,
              extra_env: Optional[Dict[str, str]] = None) -> List[str]:
    """target is 'module:function' importable from tests/; returns each rank's output."""
    port = free_port()
    procs = []
    logs = []
    for rank in range(world_size):
        extra = dict(extra_env or {})
        path = os.pathsep.join(p for p in (extra.pop("PYTHONPATH", ""), HERE, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=path, OMP_NUM_THREADS="1",
                   BCP_TEST_ARGS=json.dumps(args or {}), **extra)
        log = open(os.path.join(_log_dir(), f"{target.replace(':', '.')}-{port}-r{rank}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "launcher_worker", target], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    failed: Optional[int] = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{target} on {world_size} ranks timed out after {timeout}s:\n" +
                                     _outputs(logs))
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    if failed is not None:
        raise AssertionError(f"{target}: rank {failed} failed (exit {procs[failed].returncode}):\n{outs[failed]}")
    return outs


def _outputs(logs) -> str:
    out = []
    for r, log in enumerate(logs):
        log.flush()
        log.seek(0)
        out.append(f"--- rank {r} ---\n{log.read()[-4000:]}")
    return "\n".join(out)


def _log_dir() -> str:
    d = os.path.join(os.environ.get("TMPDIR", "/tmp"), "bcp-test-logs")
    os.makedirs(d, exist_ok=True)
    return d
