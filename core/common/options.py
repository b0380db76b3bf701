"""A Checkpointer's tunables, validated in one place. Environment variables only supply defaults,
and only through `Options.from_env()` (used for the default instance and the adapters' own)."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional, Union

from .errors import CheckpointError

ZeroRedundancy = Union[str, bool]

# Environment variable -> option, for from_env().
ENV = {
    "BCP_ASYNC_SAVE": "async_save",
    "BCP_STAGING_SLOTS": "staging_slots",
    "BCP_IO_THREADS": "io_threads",
    "BCP_IO_CONCURRENCY": "io_concurrency",
    "BCP_ZERO_REDUNDANCY": "zero_redundancy",
    "BCP_TIMEOUT_S": "timeout_s",
    "BCP_DEAD_PEER_S": "dead_peer_s",
    "BCP_FILE_IO": "local_io",
    "BCP_FSDP1_ROUTE": "fsdp1_route",
    "BCP_PINNED_LOAD_BYTES": "pinned_load_bytes",
    "BCP_RECORD_STATS": "record_stats",
    "BCP_ASYNC_STAGING": "async_staging",
    "BCP_DIRECT_IO": "direct_io",
    # older names, kept working
    "BCP_COLLECTIVE_TIMEOUT_S": "timeout_s",
    "BCP_COPY_CONCURRENCY": "io_threads",
    "BCP_ZERO_REDUNDANCY_LOAD": "zero_redundancy",
}


@dataclass(frozen=True)
class Options:
    async_save: bool = False
    # Staging buffer sets for async save: 2 = ping-pong (a 3rd save waits for the 1st's write).
    staging_slots: int = 2
    # Worker threads per operation for checksums, encoding and file I/O (None: one per CPU, 4 to 16).
    io_threads: Optional[int] = None
    # Storage requests in flight (tensorstore Context limits).
    io_concurrency: int = 32
    # Read bytes that several ranks need once and share them: "auto" (where it pays: remote or
    # shared storage, several hosts, NCCL), True, False.
    zero_redundancy: ZeroRedundancy = "auto"
    # Longest wait for peers: arrival at a save/load, commit of an async save.
    timeout_s: float = 600.0
    # An async save gives up on a peer whose heartbeat stopped this long ago (a dead rank).
    dead_peer_s: float = 30.0
    # Local directories: "posix" (plain file I/O) or "tensorstore" (its file kvstore).
    local_io: str = "posix"
    # FSDP1 models: "flat" (each rank's flat-parameter shard written as per-parameter flat shards,
    # no all-gather) or "sharded_tensor" (FSDP's sharded state dict; see state/fsdp1.py).
    fsdp1_route: str = "flat"
    # Loads into GPU tensors read through this much page-locked host memory (slabs, allocated on
    # the first such load and kept until close()); 0: pageable reads and blocking copies instead.
    pinned_load_bytes: int = 64 << 20
    # Each rank's phases of every save and load, kept beside the checkpoint (data-<id>/stats/, read by
    # `bytecheckpoint stats`): "all"; "save" (loads record in memory and logs only, never write);
    # "off" (nothing recorded; docs/monitoring.md).
    record_stats: str = "all"
    # An async save copies, before save() returns, only what no optimizer step changes; the tensors of
    # the optimizers in the state are copied in the background and each optimizer's next step() waits
    # for its own (docs/async_staging.md): "auto" (for CUDA tensors), True (CPU tensors too), False.
    async_staging: Union[str, bool] = "auto"
    # Pack files on local file systems written with O_DIRECT (no page-cache copy, same bytes; chosen
    # from a steady loop of saves and cold resumes: storage/posix.py): "auto" (where the file system
    # takes it, else buffered), True (an error where refused), False (buffered).
    direct_io: Union[str, bool] = "auto"

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> CheckpointError:
            return CheckpointError(f"Checkpointer: {name} must be {want}, got {getattr(self, name)!r}")
        if not isinstance(self.staging_slots, int) or isinstance(self.staging_slots, bool) or self.staging_slots < 1:
            raise bad("staging_slots", "an integer >= 1")
        if self.io_threads is not None and (not isinstance(self.io_threads, int) or self.io_threads < 1):
            raise bad("io_threads", "None or an integer >= 1")
        if not isinstance(self.io_concurrency, int) or self.io_concurrency < 1:
            raise bad("io_concurrency", "an integer >= 1")
        if (not isinstance(self.pinned_load_bytes, int) or isinstance(self.pinned_load_bytes, bool)
                or self.pinned_load_bytes < 0):
            raise bad("pinned_load_bytes", "an integer >= 0 (bytes; 0 turns the pinned load path off)")
        if self.zero_redundancy not in ("auto", True, False):
            raise bad("zero_redundancy", '"auto", True or False')
        for name in ("timeout_s", "dead_peer_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise bad(name, "a positive number of seconds")
        if self.local_io not in ("posix", "tensorstore"):
            raise bad("local_io", '"posix" or "tensorstore"')
        if self.fsdp1_route not in ("flat", "sharded_tensor"):
            raise bad("fsdp1_route", '"flat" or "sharded_tensor"')
        if self.record_stats not in ("all", "save", "off"):
            raise bad("record_stats", '"all", "save" or "off"')
        for name in ("async_staging", "direct_io"):
            if getattr(self, name) not in ("auto", True, False):
                raise bad(name, '"auto", True or False')

    @property
    def threads(self) -> int:
        # I/O-bound (fdatasync, reads): 4 even on 1-3 cores (docs/results.md); more where there are
        # more cores (an H200 host's 16: a 2 GiB GPU load 0.43 s with 4, 0.26 s with 16)
        return self.io_threads or max(4, min(16, os.cpu_count() or 1))

    def replaced(self, **overrides: Any) -> "Options":
        """These options with some changed by name; an unknown name is an error naming the valid ones."""
        unknown = sorted(set(overrides) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"Checkpointer: unknown option(s) {unknown}; options are "
                            f"{[f.name for f in fields(self)]} (and storage_options, process_group, local_tier)")
        return replace(self, **overrides) if overrides else self

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None, **overrides: Any) -> "Options":
        env = os.environ if env is None else env
        values: dict = {}
        types = {f.name: f.type for f in fields(cls)}
        for var, name in ENV.items():
            raw = env.get(var)
            if raw is None or raw == "" or name in values:
                continue
            values[name] = _parse(var, name, raw, types[name])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(var: str, name: str, raw: str, typ: str) -> Any:
    text = raw.strip().lower()
    try:
        if name == "zero_redundancy":
            return "auto" if text == "auto" else text not in _NO
        if name in ("async_staging", "direct_io"):
            if text not in _SWITCH:
                raise ValueError(text)
            return _SWITCH[text]
        if name == "async_save":
            return text in _YES
        if name in ("local_io", "fsdp1_route"):
            return text
        if name == "record_stats":
            return "all" if text in _YES else "off" if text in _NO else text
        if "float" in typ:
            return float(text)
        return int(text)
    except ValueError:
        raise CheckpointError(f"environment variable {var}={raw!r} is not a valid {name}") from None


_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")  # every yes/no setting's words
_SWITCH = {"auto": "auto", **dict.fromkeys(_YES, True), **dict.fromkeys(_NO, False)}


def env_flag(var: str, default: bool, env: Optional[Mapping[str, str]] = None) -> bool:
    """A yes/no default from the environment (e.g. BCP_LOG_METRICS for the adapters' metrics)."""
    raw = (os.environ if env is None else env).get(var, "").strip().lower()
    if not raw:
        return default
    if raw in _YES:
        return True
    if raw in _NO:
        return False
    raise CheckpointError(f"environment variable {var}={raw!r} must be 1/0 (true/false, yes/no, on/off)")
