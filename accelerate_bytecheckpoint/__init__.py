"""Accelerate adapter: ``attach(accelerator)`` routes save_state/load_state through bytecheckpoint."""

from ._attach import CHECKPOINT_SUBDIR, ByteCheckpointAttachment, attach
from ._compat import AccelerateCompatError

__all__ = ["attach", "ByteCheckpointAttachment", "CHECKPOINT_SUBDIR", "AccelerateCompatError"]
