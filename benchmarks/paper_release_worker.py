"""One rank of a benchmarks/bench_paper_release.py job (see its docstring), for one library.

Run by the driver, as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment),
with the interpreter of the library's venv:

    python paper_release_worker.py --library ours|release --job save|load --dir D --blocks N --vocab V

Job `save` (2 ranks): sync save, 2 -> 2 load, the fdatasync floor, async save. Job `load`: a load of
the sync checkpoint on however many ranks it is started with (1: the 2 -> 1 reshard). Rank 0 prints one
line `RESULT {json}`: seconds (max over ranks), and whether each load equalled the saved state.

Imports only torch, release_model and, for --library, that library: in the release's venv
`bytecheckpoint` is the paper's release, in ours it is ours.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from typing import Callable, Dict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from release_model import fsdp2_model_and_optim, local_state_bytes, state_fingerprint  # noqa: E402

FLOOR_TRIES = 3


# ---------------------------------------------------------------------------------------- libraries
class Ours:
    """bytecheckpoint (this repository): one Checkpointer, durable (fdatasync/fsync) when save returns."""

    name = "ours"

    def __init__(self):
        import bytecheckpoint as bcp

        self.ckpt = bcp.Checkpointer()

    def save(self, path, model, optim) -> None:
        self.ckpt.save(path, {"model": model, "optimizer": optim})

    def save_model(self, path, model) -> None:
        self.ckpt.save(path, {"model": model})

    def async_save(self, path, model, optim) -> Callable[[], None]:
        """Returns once the state is copied out; the returned wait() returns once it is committed."""
        return self.ckpt.save(path, {"model": model, "optimizer": optim}, async_save=True).wait

    def load(self, path, model, optim) -> None:
        self.ckpt.load(path, {"model": model, "optimizer": optim})

    def close(self) -> None:
        self.ckpt.close()


def _serve_on_loopback(world_size, conn) -> None:
    """The release's gRPC coordinator process, announcing 127.0.0.1: the release has no setting for it
    and would announce the address its host routes to 8.8.8.8 by (server_lib.get_host_ip)."""
    from bytecheckpoint.utilities.server import server_lib

    server_lib._get_local_ip = lambda: "127.0.0.1"
    server_lib._serve_in_loop(world_size, conn)


def _start_server_on_loopback(world_size: int) -> str:
    """server_lib.start_server_in_new_process, with the spawned process running _serve_on_loopback
    (a patch made here alone would not reach the spawned process)."""
    import multiprocessing

    parent_conn, child_conn = multiprocessing.Pipe()
    ctx = multiprocessing.get_context("spawn")
    ctx.Process(target=_serve_on_loopback, args=(world_size, child_conn), daemon=True).start()
    return parent_conn.recv()


class Release:
    """The paper authors' release, PyPI bytecheckpoint==0.0.2, framework "fsdp2" (FSDP2 / DTensor).

    Sync save: fast_saving=False (each .distcp file and .metadata is os.fsync'ed before save returns).
    Async save: fast_saving=True (returns after the state is copied; files, tracker in the background).
    Load: fast_loading=True (its parallel reads, the README's advice for speed).
    Each save passes a new global_steps (folder name kept): that runs its commit step, a gather of
    every rank's write status over its gRPC coordinator, then rank 0 writes the step tracker file."""

    name = "release"

    def __init__(self):
        # Its own byte items (optimizer param_groups, ...) are pickles that torch.load must unpickle:
        # torch >= 2.6 loads weights_only=True by default, which refuses them. In this process only.
        torch.load = functools.partial(torch.load, weights_only=False)
        import bytecheckpoint
        from bytecheckpoint.utilities.server import server_lib

        assert bytecheckpoint.__version__ == "0.0.2", f"not the release: {bytecheckpoint.__file__}"
        server_lib.start_server_in_new_process = _start_server_on_loopback
        self.bcp = bytecheckpoint
        self.step = 0

    def _save(self, path, model, optim, fast_saving: bool) -> None:
        self.step += 1  # its commit gather is tagged by the step: one tag per save
        self.bcp.save(path, {"model": model, "optimizer": optim}, framework="fsdp2", fast_saving=fast_saving,
                      global_steps=self.step, ignore_append_global_steps_to_folder=True)

    def save(self, path, model, optim) -> None:
        self._save(path, model, optim, fast_saving=False)

    def save_model(self, path, model) -> None:
        self.step += 1
        self.bcp.save(path, {"model": model}, framework="fsdp2", fast_saving=False, global_steps=self.step,
                      ignore_append_global_steps_to_folder=True)

    def async_save(self, path, model, optim) -> Callable[[], None]:
        self._save(path, model, optim, fast_saving=True)
        return self._wait_background

    def _wait_background(self) -> None:
        """Its async save hands the file writes and the commit to one background thread per part
        (model, optimizer); it returns no handle, so wait for those threads' queues."""
        from bytecheckpoint.storage._storage import _local_storage_writer
        from bytecheckpoint.storage._storage import base_storage

        for part in ("model", "optimizer"):
            _local_storage_writer.get_sync_queue(part, "fsdp2", "").join()
        if base_storage._process_should_exit.is_set():
            raise RuntimeError("the release's background save failed (see its log above)")

    def load(self, path, model, optim) -> None:
        self.bcp.load(path, {"model": model, "optimizer": optim}, framework="fsdp2", fast_loading=True)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------- timing
def rank() -> int:
    return dist.get_rank()


def max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn: Callable[[], object]) -> float:
    """The slowest rank's time in fn (all start together): what a training step waits for."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return max_over_ranks(time.perf_counter() - t0)


def remove_on_rank0(path: str) -> None:
    dist.barrier()
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def write_fdatasync(path: str, nbytes: int, chunk: int = 16 << 20) -> None:
    """The floor for a durable save of nbytes: one file written with os.write, then fdatasync."""
    buf = memoryview(bytearray(chunk))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[:min(chunk, left)])
        os.fdatasync(fd)
    finally:
        os.close(fd)


def verified_load(lib, path: str, args, expected: str) -> Dict[str, object]:
    """Load into a fresh model + fresh AdamW (built untimed); the time, and whether it equals `expected`."""
    model, optim = fsdp2_model_and_optim(args.blocks, args.vocab, trained=False)
    seconds = timed(lambda: lib.load(path, model, optim))
    return {"s": seconds, "ok": state_fingerprint(model, optim) == expected}


# ---------------------------------------------------------------------------------------- jobs
def save_job(lib, args) -> Dict[str, object]:
    model, optim = fsdp2_model_and_optim(args.blocks, args.vocab, trained=True)
    expected = state_fingerprint(model, optim)
    out: Dict[str, object] = {"fingerprint": expected}

    # First save of the process untimed, for both: the release starts its gRPC coordinator then, and
    # both plan (and cache plans) as they would at a training run's first checkpoint.
    warm = os.path.join(args.dir, "warm")
    lib.save(warm, model, optim)
    remove_on_rank0(warm)

    sync_path = os.path.join(args.dir, "sync")
    out["sync_save"] = timed(lambda: lib.save(sync_path, model, optim))

    # The model alone (~100 MB over both ranks), a first untimed save of that state too.
    for name in ("warm_model", "model_only"):
        t = timed(lambda: lib.save_model(os.path.join(args.dir, name), model))
        remove_on_rank0(os.path.join(args.dir, name))
    out["sync_save_model"] = t

    nbytes = local_state_bytes(model, optim)
    floor_file = os.path.join(args.dir, f"floor_rank{rank()}.bin")
    # A floor is a lower bound: the best of a few tries (the disk's write-back varies between them).
    out["floor"] = min(timed(lambda: write_fdatasync(floor_file, nbytes)) for _ in range(FLOOR_TRIES))
    out["floor_bytes_per_rank"] = nbytes
    os.remove(floor_file)

    load = verified_load(lib, sync_path, args, expected)
    out["load_2to2"], out["load_2to2_ok"] = load["s"], load["ok"]

    # Async: one untimed save first (allocations of staging memory), then the timed one. Blocking
    # time = until save returns; total = until it is durable and committed.
    lib.async_save(warm, model, optim)()
    remove_on_rank0(warm)
    async_path = os.path.join(args.dir, "async")
    dist.barrier()
    t0 = time.perf_counter()
    wait = lib.async_save(async_path, model, optim)
    blocking = time.perf_counter() - t0
    wait()
    total = time.perf_counter() - t0
    out["async_block"], out["async_total"] = max_over_ranks(blocking), max_over_ranks(total)
    out["async_load_ok"] = verified_load(lib, async_path, args, expected)["ok"]
    remove_on_rank0(async_path)
    return out


def load_job(lib, args) -> Dict[str, object]:
    load = verified_load(lib, os.path.join(args.dir, "sync"), args, args.expect)
    return {"load": load["s"], "load_ok": load["ok"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--library", choices=("ours", "release"), required=True)
    p.add_argument("--job", choices=("save", "load"), required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--expect", default="", help="load job: the saved state's fingerprint")
    args = p.parse_args()

    torch.set_num_threads(1)  # 2 ranks on a 2-core machine, as benchmarks/bench_real_model.py
    dist.init_process_group("gloo")
    lib = Ours() if args.library == "ours" else Release()
    try:
        out = save_job(lib, args) if args.job == "save" else load_job(lib, args)
        out["world"] = dist.get_world_size()
        if rank() == 0:
            print("RESULT " + json.dumps(out), flush=True)
    finally:
        lib.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
