"""An elastic Accelerate training script, as a user writes it (elastic_common.py: the test
controls and the events it reports):

    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True))
    attachment = attach(accelerator, async_save=True)
    ...
    if attachment.latest() is not None:     # the newest committed checkpoint_<n>; None on a first launch
        accelerator.load_state()            # any process count; the naming counter continues past every folder
    ...
    accelerator.save_state()                # checkpoints/checkpoint_<n>, written in the background

Launched by torchrun's elastic agent; restarted on the new world after a node is lost or joins.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_common as ec  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

from accelerate_bytecheckpoint import CHECKPOINT_SUBDIR, attach  # noqa: E402


class Progress:
    """The step counter, checkpointed by Accelerate (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def main() -> None:
    torch.set_num_threads(1)
    ec.hold_until_full()
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=os.path.join(ec.DIR, "project"), automatic_checkpoint_naming=True))
    attachment = attach(accelerator, async_save=True)
    net = ec.model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(net, opt)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    def digest() -> str:
        return ec.digest(accelerator.unwrap_model(model).state_dict(), opt.state_dict()["state"])

    folder = attachment.latest()
    if folder is not None:
        t0 = time.perf_counter()
        accelerator.load_state()
        ec.emit("resumed", path=os.path.join(folder, CHECKPOINT_SUBDIR), step=progress.step,
                load_s=time.perf_counter() - t0, digest=digest())
    else:
        ec.emit("fresh")

    while progress.step < ec.STEPS:
        step = progress.step + 1
        ec.gate(step)
        loss = ec.loss_of(model, step)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        progress.step = step
        ec.emit("step", step=step, loss=loss.item())
        if ec.slow_from(step):
            ec.slow_writes(attachment.checkpointer)
        saved = digest()
        accelerator.save_state()
        folder = os.path.join(accelerator.project_dir, "checkpoints",
                              f"checkpoint_{accelerator.project_configuration.iteration - 1}")
        ec.emit("saving", step=step, digest=saved, path=os.path.join(folder, CHECKPOINT_SUBDIR))
    attachment.wait()
    ec.emit("done", step=progress.step, digest=digest())
    accelerator.end_training()


if __name__ == "__main__":
    ec.run(main)
    sys.stdout.flush()
    os._exit(0)  # gloo threads must not race interpreter finalization (tests/integration/_leave.py)
