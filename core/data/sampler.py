"""Samplers whose order is defined over the global sample space, so a position saved on W
processes resumes on any M (docs/data.md).

* ``ElasticSampler``: a ``DistributedSampler`` (same constructor, same output while no position
  was loaded) whose next pass can start at a saved position, the rest dealt to the current
  processes. Frameworks leave a DistributedSampler subclass alone (Lightning, Fabric, Accelerate).
* ``SeededOrder`` / ``GeneratorOrder``: the *global* order for frameworks that deal whole batches
  to processes themselves (Accelerate's ``BatchSamplerShard``): the same order on every process
  count, an epoch that never goes back to a stale value, and a record of it.
"""
from __future__ import annotations

import itertools
from typing import Iterator, Optional, Sequence, Tuple

import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

from .order import consumed_after, epoch_order, rank_stream
from .position import DataPosition, Verdict, verdict


class ElasticSampler(DistributedSampler):
    """``DistributedSampler`` with a reshardable position.

    Without a loaded position it yields exactly what ``DistributedSampler`` yields. After
    ``resume(position, batch_size)`` the next pass of the saved epoch starts at the saved
    position (``consumed`` samples of the epoch's global order) and deals the rest to this
    sampler's ``num_replicas`` processes; later epochs are DistributedSampler's again.
    ``len()`` stays the whole epoch's per-rank count (what Lightning and ``DataLoader`` expect).

    The position of a pass is known to the loader that counts the batches it handed out:
    ``bytecheckpoint.data.ElasticDataLoader`` (or ``make_stateful(loader)``) saves and restores it.
    """

    def __init__(self, dataset: Sequence, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._resume = 0                      # where the next pass of self.epoch starts
        self._pass: Tuple[int, int] = (0, 0)  # (epoch, start) of the latest pass

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume = 0  # a loaded position belongs to its own epoch only
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        epoch, start = self.epoch, self._resume
        self._pass = (epoch, start)
        stream = rank_stream(len(self.dataset), epoch, self.num_replicas, self.rank, consumed=start,
                             shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last)
        return itertools.chain(stream, self._ended(epoch, start))  # a list's iterator: DistributedSampler's speed

    def _ended(self, epoch: int, start: int) -> Iterator[int]:
        if self.epoch == epoch and self._resume == start:
            self._resume = 0  # the resumed pass ran to its end; an abandoned one would start there again
        return
        yield  # a generator: runs when the pass's last index has been taken

    @property
    def resume_at(self) -> int:
        """Positions of the current epoch's order the next pass skips (a loaded position; else 0)."""
        return self._resume

    def position(self, steps: int, batch_size: int, *, drop_last_batch: bool = False) -> DataPosition:
        """The position after ``steps`` batches of ``batch_size`` per process were handed out by
        the current pass (``steps == 0``: where the next pass starts)."""
        epoch, start = self._pass if steps else (self.epoch, self._resume)
        n = len(self.dataset)
        g = batch_size * self.num_replicas
        return DataPosition(epoch=epoch, consumed=consumed_after(start, steps, g, n), dataset_len=n, global_batch=g,
                            shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last,
                            drop_last_batch=drop_last_batch, world_size=self.num_replicas)

    def resume(self, saved: DataPosition, batch_size: int) -> Verdict:
        """Make the next pass continue ``saved`` (its epoch, seed and shuffle win over this
        sampler's); returns what that means for the current processes and batch size."""
        saved = saved.normalized()
        n = len(self.dataset)
        result = verdict(saved, dataset_len=n, global_batch=batch_size * self.num_replicas, world=self.num_replicas)
        if saved.seed is not None:  # the saved order wins (drop_last stays: it only shapes the padding)
            self.seed = saved.seed
        self.shuffle = saved.shuffle
        super().set_epoch(saved.epoch)
        self._resume = saved.consumed if saved.dataset_len == n and saved.consumed else 0
        return result


class SeededOrder(Sampler[int]):
    """The order ``randperm(n)`` seeded ``seed + epoch`` (Accelerate's ``SeedableRandomSampler``
    with ``initial_seed = seed``; DistributedSampler's global order), for a framework that deals
    batches to processes itself. Like SeedableRandomSampler it moves to the next epoch after a
    full pass; unlike it, ``set_epoch`` never goes back below the epoch a full pass reached (a
    loader whose epoch counter is stale after a resume cannot replay the resumed epoch)."""

    def __init__(self, data_source: Sequence, seed: int, epoch: int = 0) -> None:
        self.data_source = data_source
        self.seed, self.epoch, self._floor = int(seed), int(epoch), int(epoch)

    def set_epoch(self, epoch: int) -> None:
        if epoch >= self._floor:
            self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        yield from epoch_order(len(self.data_source), epoch, seed=self.seed)
        self._floor = self.epoch = epoch + 1

    def __len__(self) -> int:
        return len(self.data_source)

    def position(self, global_batch: int, world: int) -> DataPosition:
        return DataPosition(epoch=self.epoch, consumed=None, dataset_len=len(self), global_batch=global_batch,
                            shuffle=True, seed=self.seed, world_size=world)

    def restore(self, saved: DataPosition) -> None:
        self.seed = int(saved.seed) if saved.seed is not None else self.seed
        self.epoch = self._floor = int(saved.epoch)


class GeneratorOrder(Sampler[int]):
    """A ``RandomSampler`` drawing from its own ``torch.Generator`` (Accelerate's order without
    the seedable sampler), with the generator's state at the start of each epoch remembered, so
    that the epoch's order can be drawn again on any process count."""

    def __init__(self, inner: torch.utils.data.RandomSampler) -> None:
        if inner.generator is None:
            raise ValueError("GeneratorOrder needs a RandomSampler with its own generator (RandomSampler(..., "
                             "generator=torch.Generator().manual_seed(s)))")
        self.inner = inner
        self.data_source = inner.data_source
        self.epoch = 0
        self._start: Optional[torch.Tensor] = None    # the generator's state at the current epoch's start
        self._pending: Optional[torch.Tensor] = None  # a restored state, applied again at the next pass

    def __iter__(self) -> Iterator[int]:
        gen = self.inner.generator
        if self._pending is not None:
            gen.set_state(self._pending)
            self._pending = None
        epoch = self.epoch
        self._start = gen.get_state()
        yield from self.inner
        self.epoch, self._start = epoch + 1, gen.get_state()

    def __len__(self) -> int:
        return len(self.inner)

    def position(self, global_batch: int, world: int) -> DataPosition:
        start = self._start if self._start is not None else self.inner.generator.get_state()
        return DataPosition(epoch=self.epoch, consumed=None, dataset_len=len(self.data_source),
                            global_batch=global_batch, shuffle=True, generator_state=bytes(start.numpy().tobytes()),
                            world_size=world)

    def restore(self, saved: DataPosition) -> None:
        if saved.generator_state is None:
            raise ValueError("GeneratorOrder.restore: the record holds no generator state (saved from a seeded order)")
        state = torch.frombuffer(bytearray(saved.generator_state), dtype=torch.uint8).clone()
        self.inner.generator.set_state(state)
        self.epoch, self._start, self._pending = int(saved.epoch), state, state
