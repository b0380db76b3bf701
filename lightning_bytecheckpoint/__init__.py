"""Lightning integration: ``Trainer(plugins=[ByteCheckpointIO(async_save=True)])``.

See docs/lightning.md for what it does, how it hooks into the strategies and its limits.
"""
from .checkpoint_io import ByteCheckpointIO

__all__ = ["ByteCheckpointIO"]
