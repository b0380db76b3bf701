"""Start gloo ranks without waiting for them, kill -9 them, and judge what is left on storage.

Unlike tests/launcher.run_ranks (which fails a test as soon as a rank fails), a Job lets the test
kill ranks at chosen moments and then look at exit codes and outputs. Every wait is bounded; a
Job always ends with every rank process gone (killed by pid if needed).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import bytecheckpoint as bcp

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, TESTS)

from launcher import free_port  # noqa: E402

# How long a rank waits for a dead peer before failing (async commits wait on marker objects with
# this limit; production default 600 s). Kept short so that a survivor's error is seen quickly.
PEER_TIMEOUT_S = 8


class Job:
    def __init__(self, target: str, world: int, args: Optional[dict] = None, env: Optional[Dict[str, str]] = None,
                 log_dir: Optional[str] = None):
        self.world = world
        self.port = free_port()
        self.log_dir = log_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "bcp-fault-logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.procs: List[subprocess.Popen] = []
        self.log_paths: List[str] = []
        pythonpath = os.pathsep.join(p for p in (HERE, TESTS, os.environ.get("PYTHONPATH", "")) if p)
        for rank in range(world):
            e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), PYTHONPATH=pythonpath,
                     OMP_NUM_THREADS="1", BCP_TEST_ARGS=json.dumps(args or {}), AWS_EC2_METADATA_DISABLED="true",
                     PYTHONFAULTHANDLER="1", BCP_COLLECTIVE_TIMEOUT_S=str(PEER_TIMEOUT_S))
            e.update(env or {})
            path = os.path.join(self.log_dir, f"{target.replace(':', '.')}-{self.port}-r{rank}.log")
            self.log_paths.append(path)
            with open(path, "wb") as log:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "launcher_worker", target], env=e,
                                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def kill(self, ranks: Sequence[int]) -> None:
        for r in ranks:
            p = self.procs[r]
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> List[Optional[int]]:
        """Exit codes after at most `timeout` seconds (None: still running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.02)
        return [p.poll() for p in self.procs]

    def finish(self, timeout: float) -> List[int]:
        """Wait, then kill whatever is still running; exit codes (-9 for killed)."""
        self.wait(timeout)
        self.dump_stacks()
        self.kill(range(self.world))
        return [p.wait() for p in self.procs]

    def dump_stacks(self) -> None:
        """SIGABRT to ranks still running: faulthandler writes every thread's stack to the log."""
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            os.kill(p.pid, signal.SIGABRT)
        deadline = time.monotonic() + 3
        while running and time.monotonic() < deadline and any(p.poll() is None for p in running):
            time.sleep(0.05)

    def outputs(self) -> List[str]:
        out = []
        for path in self.log_paths:
            with open(path, "rb") as f:
                out.append(f.read().decode(errors="replace"))
        return out

    def describe(self) -> str:
        return "\n".join(f"--- rank {r} (exit {p.poll()}) ---\n{o[-3000:]}"
                         for r, (p, o) in enumerate(zip(self.procs, self.outputs())))


def wait_markers(marker_dir: str, name: str, world: int, job: Job, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(marker_dir, f"{name}.{r}")) for r in range(world)):
            return True
        if any(p.poll() not in (None, 0) for p in job.procs):
            return False
        time.sleep(0.002)
    return False


def kill_when_ready(job: Job, marker_dir: str, rng, window: float, victims: str, survivor_exit_s: float,
                    trial: int) -> Tuple[int, int]:
    """Once every rank marked `ready` (about to save), wait a random time within `window` and SIGKILL
    one random rank (victims "one") or every rank ("all"); every survivor must exit by itself within
    `survivor_exit_s`; then every process of the job is gone. Returns (survivors, survivors that exited
    with an error)."""
    world = job.world
    try:
        assert wait_markers(marker_dir, "ready", world, job, 120), f"trial {trial}: never ready:\n{job.describe()}"
        time.sleep(rng.uniform(0, window))
        dead = list(range(world)) if victims == "all" else [rng.randrange(world)]
        job.kill(dead)
        codes = job.wait(survivor_exit_s)
        survivors = [r for r in range(world) if r not in dead]
        if any(codes[r] is None for r in survivors):
            job.dump_stacks()
        for r in survivors:
            assert codes[r] is not None, f"trial {trial}: surviving rank {r} hung after its peer was killed:\n" \
                                         f"{job.describe()}"
        return len(survivors), sum(codes[r] != 0 for r in survivors)
    finally:
        job.finish(5)


def run(target: str, world: int, args: dict, timeout: float = 120, env: Optional[Dict[str, str]] = None) -> List[str]:
    """Run to completion; every rank must exit 0 in time."""
    job = Job(target, world, args, env)
    codes = job.finish(timeout)
    if codes != [0] * world:
        raise AssertionError(f"{target} exit codes {codes}:\n{job.describe()}")
    return job.outputs()


# ---------------------------------------------------------------------- judging storage
@dataclass
class Outcome:
    kind: str                     # empty | incomplete | complete
    detail: str = ""
    problems: List[str] = field(default_factory=list)


def judge(path: str, version: int, storage_options=None, scale: int = 1) -> Outcome:
    """What a crashed save left at `path`: nothing, an incomplete checkpoint (never loadable, reported
    as incomplete by inspect/verify/CLI), or a complete one that loads exactly `version` and verifies."""
    import fault_scenarios as fs
    from bytecheckpoint.tools.cli import main as cli_main
    problems: List[str] = []
    template = fs.build_state(version, 0, 1, scale, zero=True)
    if bcp.is_checkpoint(path, storage_options=storage_options):
        try:
            fs.load_and_check(path, version, scale, storage_options)
        except Exception as exc:  # noqa: BLE001 - recorded as a problem
            problems.append(f"committed checkpoint does not load as version {version}: {exc}")
        report = bcp.verify(path, storage_options=storage_options)
        if not report.ok:
            problems.append(f"committed checkpoint fails verify: {report.problems[:3]}")
        return Outcome("complete", problems=problems)
    try:
        bcp.load(path, template, storage_options=storage_options)
        problems.append("an uncommitted checkpoint loaded")
    except bcp.IncompleteCheckpointError as exc:
        kind, detail = "incomplete", str(exc)
    except bcp.CheckpointNotFoundError as exc:
        kind, detail = "empty", str(exc)
    except Exception as exc:  # noqa: BLE001 - wrong error type is a problem
        kind, detail = "error", f"{type(exc).__name__}: {exc}"
        problems.append(f"load of a partial checkpoint raised {kind}: {detail}")
    if kind == "incomplete":
        info = bcp.inspect(path, storage_options=storage_options)
        if info.complete:
            problems.append("inspect reports a partial checkpoint as complete")
        if storage_options is None and cli_main(["inspect", path]) != 2:
            problems.append("`bytecheckpoint inspect` does not exit 2 for a partial checkpoint")
        if storage_options is None and cli_main(["verify", path]) == 0:
            problems.append("`bytecheckpoint verify` exits 0 for a partial checkpoint")
    if bcp.verify(path, storage_options=storage_options).ok:
        problems.append("verify passes a partial checkpoint")
    return Outcome(kind, detail, problems)


def states_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))
