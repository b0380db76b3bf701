"""Lightning integration: ``Trainer(plugins=[ByteCheckpointIO(async_save=True)])``.

Importing this package also lets ``LightningModule.load_from_checkpoint`` read bytecheckpoint
directories (see loading.py). docs/lightning.md has the support table and the calling contract.
"""
from .checkpoint_io import ByteCheckpointIO
from .loading import load_from_checkpoint, read_checkpoint
from .strategies import install_hooks as _install_hooks

_install_hooks()

__all__ = ["ByteCheckpointIO", "load_from_checkpoint", "read_checkpoint"]
