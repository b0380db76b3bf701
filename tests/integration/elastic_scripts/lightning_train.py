"""An elastic Lightning training script, as a user writes it (elastic_common.py: the test
controls and the events it reports):

    trainer = Trainer(strategy=DDPStrategy(timeout=timedelta(seconds=60)),
                      num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),     # torchrun's, per restart
                      devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                      plugins=[ByteCheckpointIO(async_save=True)],
                      callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=...)])
    trainer.fit(model, ckpt_path=bcp.latest(ckpt_dir))      # None on a first launch

Launched by torchrun's elastic agent; restarted on the new world after a node is lost or joins.
The plugin here is a test-only subclass that reports each save and how long the load took.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_common as ec  # noqa: E402

import torch  # noqa: E402
import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402
from lightning_bytecheckpoint import ByteCheckpointIO  # noqa: E402


class ReportingIO(ByteCheckpointIO):
    """ByteCheckpointIO that reports its saves (path, step, digest) and times its load."""

    load_s = None

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        saved = ec.digest(checkpoint["state_dict"], checkpoint["optimizer_states"][0]["state"])
        super().save_checkpoint(checkpoint, path, storage_options)
        ec.emit("saving", step=checkpoint["global_step"], digest=saved, path=str(path))

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        t0 = time.perf_counter()
        out = super().load_checkpoint(path, map_location, weights_only)
        ReportingIO.load_s = time.perf_counter() - t0
        return out


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = ec.model()

    def training_step(self, batch, batch_idx):
        return ec.loss_of(self.net, self.global_step + 1)  # the batch of this step (the same on every rank)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(list(range(4 * ec.STEPS)), batch_size=1)  # only counts the steps


class Report(Callback):
    def __init__(self, resume_from) -> None:
        self.resume_from = resume_from
        self.final = None

    def _digest(self, trainer, pl_module) -> str:
        return ec.digest(pl_module.state_dict(), trainer.optimizers[0].state_dict()["state"])

    def on_train_start(self, trainer, pl_module) -> None:
        if self.resume_from is not None:
            ec.emit("resumed", path=self.resume_from, step=trainer.global_step, load_s=ReportingIO.load_s,
                    digest=self._digest(trainer, pl_module))
        else:
            ec.emit("fresh")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        def stopping() -> bool:
            if trainer.received_sigterm:  # the agent restarts this worker (a node joined)
                sys.stdout.flush()
                os._exit(143)
            return False
        ec.gate(trainer.global_step + 1, stopping)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        ec.emit("step", step=step, loss=float(outputs["loss"]))
        if ec.slow_from(step):  # runs before ModelCheckpoint's hook (Lightning calls checkpoint callbacks last)
            ec.slow_writes(trainer.strategy.checkpoint_io.checkpointer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.final = (trainer.global_step, self._digest(trainer, pl_module))


def main() -> None:
    torch.set_num_threads(1)
    ec.hold_until_full()
    ckpt_dir = os.path.join(ec.DIR, "ckpt")
    resume_from = bcp.latest(ckpt_dir)
    report = Report(resume_from)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=60)),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        max_steps=ec.STEPS,
        plugins=[ReportingIO(async_save=True)],
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1), report],
        use_distributed_sampler=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(Net(), ckpt_path=resume_from)
    step, digest = report.final
    ec.emit("done", step=step, digest=digest)


if __name__ == "__main__":
    ec.run(main)
    sys.stdout.flush()
    os._exit(0)  # gloo threads must not race interpreter finalization (tests/integration/_leave.py)
