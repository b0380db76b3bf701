"""Error types. Every message names the key/path involved and the fix."""


class CheckpointError(RuntimeError):
    """Base class for every error bytecheckpoint raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path does not exist or holds no checkpoint at all."""


class IncompleteCheckpointError(CheckpointError):
    """The path holds data but no commit metadata: a save that never finished."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """Saving onto a committed checkpoint without overwrite=True."""


class FormatVersionError(CheckpointError):
    """The checkpoint was written by a newer format version."""


class MetadataError(CheckpointError):
    """The metadata file is damaged, malformed or unsafe."""


class StateMismatchError(CheckpointError, ValueError):
    """Shapes, dtypes or keys of the target state disagree with the checkpoint."""


class ShardLayoutError(CheckpointError, ValueError):
    """Shards passed to save overlap or do not cover their global tensor."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes fail their checksum."""


class RemoteRankError(CheckpointError):
    """Raised on every rank when one or more ranks failed a collective step."""


class PeerTimeoutError(CheckpointError, TimeoutError):
    """A peer rank did not arrive, answer or commit within the bound (dead, stuck, or never called)."""


class CheckpointerClosedError(CheckpointError):
    """The Checkpointer was closed; it takes no more work."""


def partly_written(exc: BaseException) -> BaseException:
    """A failure of a load that had started writing into the caller's tensors, saying so (same
    type where its constructor allows)."""
    if not isinstance(exc, CheckpointError) or "partly overwritten" in str(exc):
        return exc
    try:
        out = type(exc)(f"{exc} (the load stopped; tensors it was loading into may be partly overwritten: "
                        f"load again from an intact checkpoint before using them)")
    except TypeError:  # an error type with another constructor: raise it as it is
        return exc
    out.__cause__ = exc
    return out
