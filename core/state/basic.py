"""The built-in handlers of plain Python and torch values: containers (dict, list, tuple),
tensors (replicated), Shard / FlatShard (a rank's part), objects with state_dict(), and plain
values (stored per rank in the safe encoding, format/codec.py). Registered by state/registry.py."""
from __future__ import annotations

import math
from typing import Any, Callable

from ..common.errors import CheckpointError
from ..format import codec
from ..geometry.regions import flat_range_to_boxes
from .flatten import Handler, TypeRegistry, join, tensor_entry


def is_plain(value: Any, registry: TypeRegistry, depth: int = 0) -> bool:
    """True for containers of plain values only (no tensors, modules or stateful objects)."""
    if depth > 64:
        return False
    if isinstance(value, dict):
        return all(is_plain(k, registry, depth + 1) and is_plain(v, registry, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(is_plain(v, registry, depth + 1) for v in value)
    return registry.handler_for(value) is registry.plain


class ContainerHandler(Handler):
    """Containers of plain values only are stored as one value; others are walked."""

    def save(self, value, key, walk):
        if key and is_plain(value, walk.registry):
            return walk.registry.plain.save(value, key, walk)
        return self.save_items(value, key, walk)

    def load(self, value, key, walk, assign):
        if key and is_plain(value, walk.registry):
            return walk.registry.plain.load(value, key, walk, assign)
        self.load_items(value, key, walk, assign)


class DictHandler(ContainerHandler):
    def save_items(self, value, key, walk):
        return {"dict": [[codec.encode(k), walk.save(v, join(key, k))] for k, v in value.items()]}

    def load_items(self, value, key, walk, assign):
        for k, v in list(value.items()):
            walk.load(v, join(key, k), item_setter(value, k))


class ListHandler(ContainerHandler):
    def save_items(self, value, key, walk):
        return {"list": [walk.save(v, join(key, i)) for i, v in enumerate(value)]}

    def load_items(self, value, key, walk, assign):
        for i, v in enumerate(value):
            walk.load(v, join(key, i), item_setter(value, i))


class TupleHandler(ContainerHandler):
    def save_items(self, value, key, walk):
        return {"tuple": [walk.save(v, join(key, i)) for i, v in enumerate(value)]}

    def load_items(self, value, key, walk, assign):
        items = list(value)
        for i, v in enumerate(items):
            walk.load(v, join(key, i), item_setter(items, i))
        walk.flat.finalizers.append(lambda: assign(type(value)(items) if type(value) is tuple else value))


def item_setter(container: Any, k: Any) -> Callable[[Any], None]:
    def assign(v: Any) -> None:
        container[k] = v
    return assign


# ------------------------------------------------------------------ tensors

class TensorHandler(Handler):
    """A plain tensor is replicated: every rank holds all of it; it is written once."""

    def save(self, value, key, walk):
        walk.add_tensor(tensor_entry(key, value, tuple(value.shape), "replicated", [((0,) * value.dim(), value)]))
        return {"tensor": key}

    def load(self, value, key, walk, assign):
        walk.add_tensor(tensor_entry(key, value, tuple(value.shape), "replicated", [((0,) * value.dim(), value)]))


class ShardHandler(Handler):
    def save(self, value, key, walk):
        walk.add_tensor(tensor_entry(key, value.local, value.global_shape, "sharded", [(value.offsets, value.local)]))
        return {"tensor": key}

    def load(self, value, key, walk, assign):
        self.save(value, key, walk)


class FlatShardHandler(Handler):
    """Decomposed into boxes, each a contiguous run of the flat local buffer (no communication)."""

    def save(self, value, key, walk):
        flat = value.local.reshape(-1)
        pieces, pos = [], 0
        for offs, lens in flat_range_to_boxes(value.global_shape, value.start, value.stop):
            n = math.prod(lens)
            pieces.append((offs, flat[pos:pos + n].view(lens)))
            pos += n
        walk.add_tensor(tensor_entry(key, value.local, value.global_shape, "flat", pieces))
        return {"tensor": key}

    def load(self, value, key, walk, assign):
        self.save(value, key, walk)


# ------------------------------------------------------------------ stateful objects, plain values

class StatefulHandler(Handler):
    """Objects with state_dict()/load_state_dict(): loaded from the full saved value."""

    def save(self, value, key, walk):
        return walk.save(value.state_dict(), key)

    def load(self, value, key, walk, assign):
        walk.flat.subtrees[key] = value.load_state_dict


class ObjectHandler(Handler):
    """Plain values: stored per rank in the safe encoding (see format/codec.py)."""

    def save(self, value, key, walk):
        if key in walk.flat.objects:
            raise CheckpointError(f"key {key!r} appears twice in the state; rename one")
        walk.flat.objects[key] = value
        return {"object": key}

    def load(self, value, key, walk, assign):
        walk.flat.setters[key] = assign
        walk.flat.templates[key] = value
