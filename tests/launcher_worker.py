"""Entry point of one rank started by launcher.run_ranks."""
import datetime
import gc
import importlib
import json
import os
import sys

import torch.distributed as dist


def gloo_threads() -> list:
    """Live gloo worker threads of this process (Linux): a process group not yet destroyed."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return [n for n in names if n.startswith("pt_gloo")]


def main() -> None:
    module, func = sys.argv[1].split(":")
    # Import before the process group exists, as a training script does. torch's
    # `ShardedGradScaler(process_group=dist.group.WORLD)` default is evaluated when
    # torch.distributed.fsdp is first imported: imported after init, it holds the default group
    # past destroy_process_group, its gloo threads outlive Python, and the process can abort at
    # exit ("terminate called without an active exception").
    target = getattr(importlib.import_module(module), func)
    if os.environ.get("BCP_LAYOUT_CHECK") == "1":  # set by the test suite (conftest.py), not by benchmarks
        import layout_check
        layout_check.install()
    world = int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(
        seconds=float(os.environ.get("BCP_TEST_PG_TIMEOUT_S", "60"))))  # benchmarks on a loaded machine: longer
    target(**json.loads(os.environ.get("BCP_TEST_ARGS", "{}")))
    # Success only: a failing rank exits at once (the launcher then kills its peers).
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()  # no rank tears gloo down while a peer is still sending
    gc.collect()  # models in reference cycles hold their process group until collected
    dist.destroy_process_group()
    if gloo_threads():
        # torch keeps some groups alive past destroy_process_group (FSDP2's default mesh, DeviceMesh
        # subgroups, DeepSpeed's groups); their gloo threads then race Python's finalization and
        # can abort the process at exit. Nothing is left to run here: leave without finalizing.
        # (tests/dist/test_teardown.py checks that the engine itself holds no group.)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

if __name__ == "__main__":
    main()
