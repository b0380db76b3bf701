"""Tunables in one place; each can be overridden by an environment variable."""
import os
from dataclasses import dataclass


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


@dataclass(frozen=True)
class Tunables:
    # Concurrent tensorstore file/network operations (one Context per process).
    io_concurrency: int = _env_int("BCP_IO_CONCURRENCY", 32)
    # Threads tensorstore uses to encode/decode/copy chunks.
    copy_concurrency: int = _env_int("BCP_COPY_CONCURRENCY", min(4, os.cpu_count() or 1))
    # Per-tensor chunk grids with more than this many chunks per saved region fall
    # back to one zarr array per region (avoids millions of tiny chunk files).
    max_chunks_per_region: int = _env_int("BCP_MAX_CHUNKS_PER_REGION", 16)
    # Seconds a collective may wait for a peer before failing instead of hanging.
    collective_timeout_s: int = _env_int("BCP_COLLECTIVE_TIMEOUT_S", 600)
    # Number of staging buffer sets for async save (ping-pong = 2).
    staging_slots: int = _env_int("BCP_STAGING_SLOTS", 2)


TUNABLES = Tunables()
