"""transformers.Trainer adapter: ``attach(trainer)`` saves and resumes checkpoints through bytecheckpoint."""

from ._attach import TrainerAttachment, attach
from ._compat import TransformersCompatError
from ._folders import CHECKPOINT_SUBDIR

__all__ = ["attach", "TrainerAttachment", "CHECKPOINT_SUBDIR", "TransformersCompatError"]
