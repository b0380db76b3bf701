"""DataLoaders that save and restore where the data stream stands (``state_dict`` /
``load_state_dict``: Lightning's loader protocol, and a stateful object for ``bcp.save``).

* ``StatefulLoaderMixin``: counts the batches the loader *handed out* (so workers' read-ahead
  never moves the position) and turns them into the sampler's ``DataPosition``.
* ``make_stateful(loader)``: switches an existing ``DataLoader`` whose sampler is an
  ``ElasticSampler`` to a stateful subclass of its own class (adapters use it on loaders a
  framework built).
* ``ElasticDataLoader``: the one-liner for plain PyTorch loops.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from .position import DataPosition, Verdict
from .sampler import ElasticSampler

log = logging.getLogger("bytecheckpoint.data")


class _Counting(Iterator):
    """The loader's iterator, counting the batches it hands out."""

    def __init__(self, it: Iterator, loader: "StatefulLoaderMixin") -> None:
        self._it, self._loader = it, loader

    def __iter__(self) -> "_Counting":
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self._loader._bcp_steps += 1
        return batch

    def __len__(self) -> int:
        return len(self._it)


class StatefulLoaderMixin(DataLoader):
    """Put before a DataLoader class whose sampler is an ``ElasticSampler``. Never instantiated
    alone: it derives from DataLoader so that ``(mixin, UserLoader)`` keeps the instance layout
    and an existing loader's ``__class__`` may be switched to it (``make_stateful``).

    ``data_order``: the ``Verdict`` of the last ``load_state_dict`` (None before one)."""

    _bcp_steps = 0
    data_order: Optional[Verdict] = None

    def __iter__(self) -> Iterator:
        self._bcp_steps = 0
        return _Counting(super().__iter__(), self)

    @property
    def elastic_sampler(self) -> ElasticSampler:
        sampler = self.sampler
        if not isinstance(sampler, ElasticSampler):
            raise TypeError(f"{type(self).__name__}: the sampler is a {type(sampler).__name__}, not an ElasticSampler; "
                            f"build the loader with sampler=bytecheckpoint.data.ElasticSampler(dataset, ...)")
        return sampler

    @property
    def epoch(self) -> int:
        return self.elastic_sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.elastic_sampler.set_epoch(epoch)

    def position(self) -> DataPosition:
        """Where the data stream stands now (global units; the same on every rank)."""
        return self.elastic_sampler.position(self._bcp_steps, self.batch_size or 1, drop_last_batch=self.drop_last)

    def state_dict(self) -> Dict[str, Any]:
        return self.position().to_state()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = DataPosition.from_state(state)
        self.data_order = self._on_resume(saved, self.elastic_sampler.resume(saved, self.batch_size or 1))

    def _on_resume(self, saved: DataPosition, result: Verdict) -> Verdict:
        """Report a resume (adapters override it to add what their framework makes of it)."""
        report(result)
        return result


def report(result: Verdict) -> None:
    """Log a resume's verdict once (on global rank 0): info when exact, a warning otherwise."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    log.log(logging.INFO if result.exact else logging.WARNING, result.line)


_CLASSES: Dict[tuple, type] = {}
_BASE = "_bcp_loader_base"  # class attribute of a switched class: the loader's own class


def stateful_class(base: type, mixin: type = StatefulLoaderMixin) -> type:
    """``base`` with ``mixin`` in front (cached; named like ``base``)."""
    if issubclass(base, mixin):
        return base
    key = (mixin, base)
    if key not in _CLASSES:
        _CLASSES[key] = type(base.__name__, (mixin, base), {"__module__": base.__module__, _BASE: base,
                                                            "__qualname__": base.__qualname__, "__reduce_ex__": _reduce})
    return _CLASSES[key]


def _reduce(self: DataLoader, protocol: int) -> tuple:
    """Pickling a switched loader: its class is found by name as ``base``, not the switched class
    (pickle refuses); rebuilt as the same switched class (lightning_bytecheckpoint/_class_switch's way)."""
    cls = type(self)
    state = self.__getstate__() if hasattr(self, "__getstate__") else self.__dict__
    return _rebuild, (cls.__dict__[_BASE], cls.__bases__[0]), state


def _rebuild(base: type, mixin: type) -> DataLoader:
    obj = base.__new__(base)
    obj.__class__ = stateful_class(base, mixin)
    return obj


def make_stateful(loader: DataLoader, mixin: type = StatefulLoaderMixin) -> DataLoader:
    """Switch ``loader`` (its sampler an ``ElasticSampler``) to a stateful subclass of its class,
    in place; returns it."""
    if not isinstance(loader.sampler, ElasticSampler):
        raise TypeError(f"make_stateful: the loader's sampler is a {type(loader.sampler).__name__}; build the loader "
                        f"with sampler=bytecheckpoint.data.ElasticSampler(dataset, ...)")
    loader.__class__ = stateful_class(type(loader), mixin)
    return loader


class ElasticDataLoader(StatefulLoaderMixin):
    """A ``DataLoader`` over an ``ElasticSampler`` that saves and restores its position::

        loader = bcp.data.ElasticDataLoader(ds, batch_size=G // world, shuffle=True, seed=0)
        state = {"model": model, "optimizer": opt, "data": loader}
        bcp.load(path, state)            # on any process count; loader.data_order says how it resumes
        for epoch in range(loader.epoch, epochs):
            loader.set_epoch(epoch)
            for batch in loader: ...     # bcp.save(path, state) records where the stream stands

    ``num_replicas`` / ``rank``: the data-parallel size and rank (default: torch.distributed's,
    or 1 and 0 without a process group). ``drop_last_sampler``: DistributedSampler's
    ``drop_last``; ``drop_last`` (the loader's) drops the epoch's last partial batch. Other
    keyword arguments go to ``DataLoader`` (``sampler`` / ``batch_sampler`` are refused).
    """

    def __init__(self, dataset: Any, batch_size: int = 1, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None, drop_last_sampler: bool = False,
                 **kwargs: Any) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError("ElasticDataLoader: an IterableDataset has no reshardable position (its order is its "
                            "own); use a map-style dataset (__getitem__ and __len__)")
        for name in ("sampler", "batch_sampler"):
            if kwargs.get(name) is not None:
                raise TypeError(f"ElasticDataLoader builds its own ElasticSampler: remove {name}= (use a DataLoader "
                                f"with sampler=bytecheckpoint.data.ElasticSampler(...) and make_stateful to combine)")
        dist = torch.distributed
        grouped = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if grouped else 1
        if rank is None:
            rank = dist.get_rank() if grouped else 0
        sampler = ElasticSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last_sampler)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
