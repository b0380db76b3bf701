"""Adapting a strategy object in place, for the Trainer and the Fabric adapters alike: its class is
switched to a subclass of its own class that also carries an adapter mixin (same name and module,
so Lightning's messages and logs read as usual), and back. The subclass remembers the original."""
from __future__ import annotations

import functools
from typing import Any, Tuple

ADAPTED = "_bytecheckpoint_base"  # class attribute of adapted classes: the original class


def base_of(obj: Any) -> type:
    """The class ``obj`` had before any switch."""
    return getattr(type(obj), ADAPTED, type(obj))


def is_adapted(obj: Any) -> bool:
    return getattr(type(obj), ADAPTED, None) is not None


@functools.lru_cache(maxsize=None)
def adapted_class(base: type, mixin: type) -> type:
    return type(base.__name__, (mixin, base), {ADAPTED: base, "__module__": base.__module__,
                                              "__qualname__": base.__qualname__})


def switch(obj: Any, mixin: type) -> None:
    obj.__class__ = adapted_class(base_of(obj), mixin)


def unswitch(obj: Any) -> None:
    if is_adapted(obj):
        obj.__class__ = base_of(obj)


def rebuild(base: type, mixin: type) -> Any:
    """Unpickling (ddp_spawn pickles the trainer): a bare object of the adapted class."""
    obj = base.__new__(base)
    obj.__class__ = adapted_class(base, mixin)
    return obj


def reduce(obj: Any, mixin: type) -> Tuple[Any, ...]:
    """``__reduce_ex__`` of an adapted object: rebuilt as the same adapted class."""
    return rebuild, (base_of(obj), mixin), obj.__getstate__()
