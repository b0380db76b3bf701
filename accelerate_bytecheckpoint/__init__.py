"""Accelerate adapter: ``attach(accelerator)`` routes save_state/load_state through bytecheckpoint."""

from ._attach import CHECKPOINT_SUBDIR, ByteCheckpointAttachment, attach

__all__ = ["attach", "ByteCheckpointAttachment", "CHECKPOINT_SUBDIR"]
