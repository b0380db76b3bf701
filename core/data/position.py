"""Where the data stream stands: one record, the same on every rank and for every process count.

``DataPosition`` is what a checkpoint holds (``to_state()``: plain values only, so it is stored
per rank in the safe encoding and never pickled); ``verdict`` is the one line a resume reports.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

from .order import per_rank_len

FORMAT = "bytecheckpoint.data/1"


@dataclass(frozen=True)
class DataPosition:
    """The data stream's position in global units.

    Attributes:
        epoch: the epoch whose order is being consumed.
        consumed: positions of that epoch's order taken by finished loader steps, in samples over
            all processes; None where the framework keeps the count itself (Accelerate).
        dataset_len: N, the dataset's length when saved.
        global_batch: samples per loader step over all processes (per-process batch x processes).
        shuffle, seed: the order is ``randperm(N)`` seeded ``seed + epoch`` (or ``range(N)``)...
        generator_state: ...or whatever a ``RandomSampler`` draws from a ``torch.Generator`` in
            this state (the generator's state at the start of the epoch).
        drop_last: the sampler's (DistributedSampler's) ``drop_last``.
        drop_last_batch: the loader's ``drop_last`` (an epoch ends before a last partial step).
        world_size: the process count that saved it (messages; with ``drop_last_batch``, where the
            saved run's epoch ended).
    """

    epoch: int
    consumed: Optional[int]
    dataset_len: int
    global_batch: int
    shuffle: bool = True
    seed: Optional[int] = None
    generator_state: Optional[bytes] = None
    drop_last: bool = False
    drop_last_batch: bool = False
    world_size: int = 1

    def to_state(self) -> Dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_state(cls, state: Any) -> "DataPosition":
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a bytecheckpoint data position: 'format' is {found!r}, expected {FORMAT!r} (a "
                             f"record saved by a newer bytecheckpoint? upgrade it to load this checkpoint)")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in ("epoch", "consumed", "dataset_len", "global_batch") if n not in state)
        if missing:
            raise ValueError(f"bytecheckpoint data position without {missing}: the record is damaged")
        return cls(**{k: v for k, v in state.items() if k in names})

    def _full_steps_end(self) -> int:
        """Where the saving run's epoch ended with the loader's ``drop_last``: after its last full
        step. DistributedSampler pads each rank first, so with ``N mod G > G - W`` the padded
        epoch holds one more full step than ``N // G`` (N=23, G=12, W=2: 2 steps, not 1)."""
        w, g = self.world_size, self.global_batch
        if g <= 0 or w <= 0 or g % w:
            return self.dataset_len // g * g if g > 0 else self.dataset_len
        steps = per_rank_len(self.dataset_len, w, drop_last=self.drop_last) // (g // w)
        return steps * g

    @classmethod
    def is_record(cls, state: Any) -> bool:
        return isinstance(state, dict) and state.get("format") == FORMAT

    def normalized(self) -> "DataPosition":
        """A position at the end of its epoch (every sample taken, or, with the loader's
        ``drop_last``, every full step of the saving run taken) is the start of the next epoch."""
        c = self.consumed
        if c is None:
            return self
        if c >= self.dataset_len or (self.drop_last_batch and c >= self._full_steps_end()):
            return dataclasses.replace(self, epoch=self.epoch + 1, consumed=0, generator_state=None)
        return self


@dataclass(frozen=True)
class Verdict:
    """What a resume does with the saved position: ``exact`` (every later global step equals the
    uninterrupted run's), and the one line that says so or names the reason."""

    exact: bool
    line: str
    replayed: int = 0   # samples of the interrupted epoch trained a second time
    skipped: int = 0    # samples of the interrupted epoch never trained

    def __str__(self) -> str:
        return self.line


def keep_hint(global_batch: int, world: int) -> str:
    """How a resume on ``world`` processes goes step for step again: the saved global batch kept,
    or, where ``world`` does not divide it, that no per-process batch can."""
    if world > 0 and global_batch % world == 0:
        return f"keep the global batch at {global_batch} ({global_batch // world} per process) to resume step for step"
    return (f"no per-process batch resumes step for step on {world} processes: the saved global batch "
            f"{global_batch} is not divisible by {world}")


def verdict(saved: DataPosition, *, dataset_len: int, global_batch: int, world: int) -> Verdict:
    """The resume of ``saved`` on ``world`` processes taking ``global_batch`` samples per step."""
    if saved.dataset_len != dataset_len:
        return Verdict(False, f"data order: not exact: the dataset has {dataset_len} samples, the checkpoint's had "
                              f"{saved.dataset_len}; epoch {saved.epoch} restarts from its first sample")
    where = (f"epoch {saved.epoch}, {saved.consumed}/{saved.dataset_len} samples consumed" if saved.consumed is not None
             else f"epoch {saved.epoch}'s order")
    if saved.global_batch and global_batch and saved.global_batch != global_batch:
        return Verdict(False, f"data order: continues by sample count (no sample replayed or skipped), not step for "
                              f"step: global batch {saved.global_batch} -> {global_batch} ({global_batch // world} "
                              f"per process x {world} processes); {keep_hint(saved.global_batch, world)} ({where})")
    return Verdict(True, f"data order: exact ({where}, {saved.world_size} -> {world} processes)")
