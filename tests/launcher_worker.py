"""Entry point of one rank started by launcher.run_ranks."""
import datetime
import importlib
import json
import os
import sys

import torch.distributed as dist


def main() -> None:
    module, func = sys.argv[1].split(":")
    world = int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(
        seconds=float(os.environ.get("BCP_TEST_PG_TIMEOUT_S", "60"))))  # benchmarks on a loaded machine: longer
    getattr(importlib.import_module(module), func)(**json.loads(os.environ.get("BCP_TEST_ARGS", "{}")))
    # Success only: a failing rank exits at once (the launcher then kills its peers).
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()  # no rank tears gloo down while a peer is still sending
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
