"""bytecheckpoint for torchtitan: one config line checkpoints torchtitan's Trainer through
bytecheckpoint (every rank its own share, async, reshardable across layouts and world sizes).

    from torchtitan_bytecheckpoint import ByteCheckpointManager
    config.checkpoint = ByteCheckpointManager.Config(enable=True, interval=500, async_mode="async")

docs/torchtitan.md says which layouts resume into which.
"""
from .manager import ByteCheckpointManager

__all__ = ["ByteCheckpointManager"]
