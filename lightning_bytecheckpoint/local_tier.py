"""The local tier under Lightning: frequent node-local checkpoints (with copies on peer nodes)
beside the usual persistent ``ModelCheckpoint`` ones, and a resume that picks the newest
complete one of either tier (docs/local_tier.md).

    ckpt = bcp.Checkpointer(local_tier=bcp.LocalTier(dir="/dev/shm/bcp", replicas=1))
    trainer = Trainer(plugins=[ByteCheckpointIO(checkpointer=ckpt)],
                      callbacks=[LocalTierCheckpoint(every_n_train_steps=10),
                                 ModelCheckpoint(dirpath="ckpts", every_n_train_steps=500)])
    trainer.fit(model, ckpt_path=resume_path("ckpts"))   # after a restart, on any number of ranks

Supported where every rank's checkpoint dict is whole (single device, DDP and its variants);
sharded strategies (FSDP, ModelParallel) are refused before anything is written.
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from . import _compat, _state
from ._state import resume_path  # noqa: F401 - public here (lightning_bytecheckpoint.resume_path)

class LocalTierCheckpoint(Callback):
    """Save to the local tier of the plugin's checkpointer every ``every_n_train_steps`` steps
    (every rank calls: each writes its share to its node and copies it to peer nodes). The save
    is asynchronous by default: training goes on once the state is staged.

    Needs ``Trainer(plugins=[ByteCheckpointIO(checkpointer=bcp.Checkpointer(local_tier=...))])``."""

    def __init__(self, every_n_train_steps: int = 1, async_save: bool = True) -> None:
        if every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1, got {every_n_train_steps}")
        self.every_n_train_steps = every_n_train_steps
        self.async_save = async_save
        self._last_step = -1

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _plugin_with_tier(trainer)   # fail at setup, not at the first save

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_train_steps or step == self._last_step:
            return
        self._last_step = step
        checkpoint = _compat.dump_checkpoint(trainer)
        sharded = _state.find_sharded(checkpoint)
        if sharded is not None:
            raise NotImplementedError(
                f"LocalTierCheckpoint: {sharded!r} is sharded ({type(trainer.strategy).__name__}); the Lightning "
                f"local-tier callback supports strategies whose checkpoint is whole on every rank (single device, "
                f"DDP). For sharded training call bcp.Checkpointer.save(..., tier='local') on every rank.")
        _plugin_with_tier(trainer).save_local(checkpoint, step, async_save=self.async_save)

    def state_dict(self) -> dict:
        return {"every_n_train_steps": self.every_n_train_steps}


def _plugin_with_tier(trainer: Any) -> Any:
    from .checkpoint_io import ByteCheckpointIO
    io = trainer.strategy.checkpoint_io
    if not isinstance(io, ByteCheckpointIO) or io.checkpointer.local_tier is None:
        raise ValueError("LocalTierCheckpoint needs Trainer(plugins=[ByteCheckpointIO(checkpointer="
                         "bcp.Checkpointer(local_tier=bcp.LocalTier(dir=...)))]); got "
                         f"{type(io).__name__}" + ("" if not isinstance(io, ByteCheckpointIO) else " without a local tier"))
    return io
