"""Lightning integration: ``Trainer(plugins=[ByteCheckpointIO(async_save=True)])``.

Importing this package also lets ``LightningModule.load_from_checkpoint`` read bytecheckpoint
directories (see loading.py). docs/lightning.md has the support table and the calling contract.
"""
from . import data as _data
from . import fabric_strategies as _fabric_strategies
from . import loading as _loading
from . import strategies as _strategies
from .checkpoint_io import ByteCheckpointIO
from .loading import load_from_checkpoint, read_checkpoint
from .local_tier import LocalTierCheckpoint, resume_path

# Layers: checkpoint_io (the plugin: engine calls only) <- strategies / fabric_strategies /
# loading / local_tier / data (adapters that know Lightning's objects) <- this module, the one place
# that installs their hooks (idempotent).
_strategies.install_hooks()
_fabric_strategies.install_hooks()
_data.install_hooks()
_loading.hook_load_from_checkpoint()

__all__ = ["ByteCheckpointIO", "LocalTierCheckpoint", "load_from_checkpoint", "read_checkpoint", "resume_path"]
