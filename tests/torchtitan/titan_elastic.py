"""torchtitan's real Trainer with ByteCheckpointManager as torchrun's elastic agent starts it on every
"node" and restarts it after a membership change (test_torchtitan_elastic.py, elastic_harness.Cluster).

Nothing here resumes by hand: torchtitan's Trainer.train() calls the manager's load(), which takes the
newest committed step of the run's checkpoint folder at whatever world this incarnation has. The run's
spec (titan_rank.build_config's) is the JSON in $TITAN_SPEC; dp_shard is left to the world size, and the
global batch is fixed, so a smaller world trains each step in more gradient-accumulation micro-batches.

Reports, as elastic_common events: start, resumed (the step the manager loaded, or 0), step (its
global loss as torchtitan logs it, this rank's token rows, the world), done, error.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration", "elastic_scripts"))

import shims  # noqa: E402

shims.install()

import elastic_common as ec  # noqa: E402


def main() -> None:
    import torch.distributed as dist
    from torchtitan.tools.logging import init_logger

    import titan_rank

    ec.hold_until_full()
    spec = json.loads(os.environ["TITAN_SPEC"])
    init_logger()
    trainer = titan_rank.build_config(spec).build()
    try:
        shims.after_build(trainer)
        seen = titan_rank.record(trainer, spec)
        load, train_step = trainer.checkpointer.load, trainer.train_step

        def reported_load(*args, **kwargs):
            out = load(*args, **kwargs)
            ec.emit("resumed", step=trainer.step)
            return out

        def gated_step(*args, **kwargs):
            ec.gate(trainer.step)  # Trainer.train() counts the step before it trains it
            out = train_step(*args, **kwargs)
            ec.emit("step", step=trainer.step, loss=seen["losses"].get(trainer.step),
                    batches=seen["batches"].get(trainer.step, []),
                    accumulation=trainer.gradient_accumulation_steps)
            return out

        trainer.checkpointer.load, trainer.train_step = reported_load, gated_step
        trainer.train()
        trainer.checkpointer.maybe_wait_for_saving()
    finally:
        trainer.close()
    ec.emit("done", step=trainer.step)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    ec.run(main)
    sys.stdout.flush()
    os._exit(0)  # gloo threads must not race interpreter finalization (tests/integration/_leave.py)
