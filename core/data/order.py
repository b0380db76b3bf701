"""The global order of an epoch and the dealing of its rest to any number of processes (pure).

Definitions (docs/data.md):

* **order(e)**: the epoch's global order of dataset indices, the same on every process count:
  ``torch.randperm(N)`` from a generator seeded ``seed + e`` when shuffled (exactly
  ``DistributedSampler``'s order, and Accelerate's ``SeedableRandomSampler``'s with its initial
  seed), ``range(N)`` when not.
* **consumed** ``c``: positions of order(e) taken by finished loader steps, counted in samples
  (global units, never a per-rank count): after ``k`` steps of ``G`` samples, ``min(k * G, N)``.
* **rest on M processes**: ``order(e)[c:]``, padded with the order's head to a multiple of M
  (DistributedSampler's padding) or cut to a multiple of M (its ``drop_last``); rank ``r`` takes
  ``rest[r::M]`` (DistributedSampler's interleave).

Rank r's batch k on W processes holds positions ``r + W * (k * b + j)``, ``j < b``, of the padded
order, so global step k covers positions ``[k*G, (k+1)*G)`` whatever W is, as long as
``G = b * W`` is kept. With ``c = k * G`` the rest dealt to M processes is therefore exactly what an
uninterrupted M-process run trains after step k; with ``c = 0`` it is exactly
``DistributedSampler(num_replicas=M, rank=r)``'s stream.
"""
from __future__ import annotations

import math
from typing import List, Sequence

import torch


def epoch_order(n: int, epoch: int, *, shuffle: bool = True, seed: int = 0) -> List[int]:
    """The global order of epoch ``epoch`` over ``n`` samples (DistributedSampler's)."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def per_rank_len(n: int, world: int, *, drop_last: bool = False) -> int:
    """A rank's share of a whole epoch (``DistributedSampler.num_samples``, what ``len()`` reports)."""
    if drop_last and n % world != 0:
        return math.ceil((n - world) / world)
    return math.ceil(n / world)


def rest_of_epoch(order: Sequence[int], consumed: int, world: int, *, drop_last: bool = False) -> List[int]:
    """``order[consumed:]`` padded from the order's head (as DistributedSampler pads) or, with
    ``drop_last``, cut to a multiple of ``world``."""
    rest = list(order[consumed:]) if consumed or not isinstance(order, list) else order
    if drop_last:
        return rest[: len(rest) // world * world]
    pad = (-len(rest)) % world
    if pad and order:
        head = list(order[:pad]) * math.ceil(pad / len(order))
        rest = rest + head[:pad]
    return rest


def deal(rest: Sequence[int], world: int, rank: int) -> List[int]:
    """Round-robin, as DistributedSampler interleaves: rank r takes r, r + M, r + 2M, ..."""
    return rest[rank::world] if isinstance(rest, list) else list(rest[rank::world])


def rank_stream(n: int, epoch: int, world: int, rank: int, *, consumed: int = 0, shuffle: bool = True,
                seed: int = 0, drop_last: bool = False) -> List[int]:
    """What rank ``rank`` of ``world`` iterates in epoch ``epoch`` from position ``consumed`` on."""
    order = epoch_order(n, epoch, shuffle=shuffle, seed=seed)
    return deal(rest_of_epoch(order, consumed, world, drop_last=drop_last), world, rank)


def consumed_after(start: int, steps: int, global_batch: int, n: int) -> int:
    """Positions of the order taken after ``steps`` loader steps of ``global_batch`` samples that
    began at position ``start`` (positions past ``n`` are padding: capped at ``n``)."""
    return min(start + steps * global_batch, n)
