"""Lightning integration: ``Trainer(plugins=[ByteCheckpointIO(async_save=True)])``.

Importing this package also lets ``LightningModule.load_from_checkpoint`` read bytecheckpoint
directories (see loading.py). docs/lightning.md has the support table and the calling contract.
"""
from .checkpoint_io import ByteCheckpointIO
from .loading import load_from_checkpoint, read_checkpoint
from .local_tier import LocalTierCheckpoint, resume_path
from .strategies import install_hooks as _install_hooks

_install_hooks()

__all__ = ["ByteCheckpointIO", "LocalTierCheckpoint", "load_from_checkpoint", "read_checkpoint", "resume_path"]
