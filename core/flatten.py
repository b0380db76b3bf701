"""State flattening: user state (Modules, Optimizers, DTensors, Shards, Stateful objects, nested
containers, plain values) -> flat tensor entries and plain values, and back.

One handler per value type, found through a registry by the value's type (MRO order), the
torchsnapshot way: adding a type means registering a handler, not growing an if/elif chain.

A key is the path of dict keys / list indices joined by '/', e.g. 'model/layer.0.weight'.
The nesting itself is recorded as a `structure` tree (plain JSON) so that a checkpoint can be
read back without a template (`load_full`, export).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import torch
from torch import nn

from . import codec, fsdp1
from .errors import CheckpointError, StateMismatchError
from .regions import flat_range_to_boxes
from .shards import FlatShard, Shard


@dataclass
class Piece:
    """A box of a global tensor held locally; `tensor` has shape `lengths`."""
    offsets: Tuple[int, ...]
    lengths: Tuple[int, ...]
    tensor: torch.Tensor


@dataclass
class TensorEntry:
    key: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    layout: str                      # replicated | sharded | flat
    pieces: List[Piece] = field(default_factory=list)
    grid: Optional[Tuple[Tuple[int, ...], ...]] = None  # DTensor: (mesh shape, sharded dim or -1 per mesh dim, coordinate)


@dataclass
class Flat:
    """What a walk over the state produced."""
    tensors: Dict[str, TensorEntry] = field(default_factory=dict)
    objects: Dict[str, Any] = field(default_factory=dict)            # save: key -> value
    setters: Dict[str, Callable[[Any], None]] = field(default_factory=dict)  # load: key -> assign
    subtrees: Dict[str, Callable[[Any], None]] = field(default_factory=dict)  # load: prefix -> consume full value
    finalizers: List[Callable[[], None]] = field(default_factory=list)
    structure: Any = None


# ------------------------------------------------------------------ registry

class Handler:
    """How one value type is saved (`save`) and loaded in place (`load`)."""

    def save(self, value: Any, key: str, walk: "Walker") -> Any:  # returns a structure node
        raise NotImplementedError

    def load(self, value: Any, key: str, walk: "Walker", assign: Callable[[Any], None]) -> None:
        raise NotImplementedError


class TypeRegistry:
    """Value type -> Handler, looked up along the value's MRO (most specific first)."""

    def __init__(self) -> None:
        self._handlers: Dict[Type, Handler] = {}

    def register(self, typ: Type, handler: Handler, *, override: bool = False) -> None:
        """Add a handler for `typ`; replacing an existing one needs override=True."""
        if not isinstance(typ, type):
            raise TypeError(f"register: expected a type, got {typ!r}")
        if not isinstance(handler, Handler):
            raise TypeError(f"register: handler for {typ.__name__} must be a bytecheckpoint Handler instance, "
                            f"got {type(handler).__name__}")
        existing = self._handlers.get(typ)
        if existing is not None and not override:
            raise CheckpointError(f"a handler for {typ.__module__}.{typ.__qualname__} is already registered "
                                  f"({type(existing).__name__}); pass override=True to replace it")
        self._handlers[typ] = handler

    def handler_for(self, value: Any) -> Handler:
        for klass in type(value).__mro__:
            h = self._handlers.get(klass)
            if h is not None:
                return h
        if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            return _STATEFUL
        return _OBJECT

    def __contains__(self, typ: Type) -> bool:
        return typ in self._handlers


#: The handlers of every value type the engine knows (extend with REGISTRY.register).
REGISTRY = TypeRegistry()


def register(typ: Type) -> Callable[[Type[Handler]], Type[Handler]]:
    """Class decorator for the built-in handlers: registers one instance of the class for `typ`."""
    def deco(cls: Type[Handler]) -> Type[Handler]:
        REGISTRY.register(typ, cls())
        return cls
    return deco


def handler_for(value: Any) -> Handler:
    return REGISTRY.handler_for(value)


def join(prefix: str, k: Any) -> str:
    return f"{prefix}/{k}" if prefix else str(k)


class Walker:
    def __init__(self, state: Any, for_load: bool, saved: Any = None, fsdp1_route: str = "flat"):
        self.flat = Flat()
        self.for_load = for_load
        self.saved = saved  # load: the checkpoint's structure tree (what was saved), if known
        self.fsdp1_route = fsdp1_route  # how FSDP1 models are read/written (see fsdp1.py)
        self.param_owner = _param_owners(state)

    def save(self, value: Any, key: str) -> Any:
        return handler_for(value).save(value, key, self)

    def load(self, value: Any, key: str, assign: Callable[[Any], None]) -> None:
        handler_for(value).load(value, key, self, assign)

    def add_tensor(self, entry: TensorEntry) -> None:
        if entry.key in self.flat.tensors:
            raise CheckpointError(f"key {entry.key!r} appears twice in the state (two dict keys that print the "
                                  f"same, e.g. 1 and '1'); rename one")
        self.flat.tensors[entry.key] = entry


def flatten_for_save(state: Any, fsdp1_route: str = "flat") -> Flat:
    _check_top(state)
    w = Walker(state, for_load=False, fsdp1_route=fsdp1_route)
    w.flat.structure = w.save(state, "")
    return w.flat


def flatten_for_load(state: Any, saved_structure: Any = None, fsdp1_route: str = "flat") -> Flat:
    _check_top(state)
    w = Walker(state, for_load=True, saved=saved_structure, fsdp1_route=fsdp1_route)
    w.load(state, "", lambda v: None)
    return w.flat


def _check_top(state: Any) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict (e.g. {{'model': model, 'optimizer': optim}}), "
                        f"got {type(state).__name__}")


# ------------------------------------------------------------------ containers

def is_plain(value: Any, depth: int = 0) -> bool:
    """True for containers of plain values only (no tensors, modules or stateful objects)."""
    if depth > 64:
        return False
    if isinstance(value, dict):
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(is_plain(v, depth + 1) for v in value)
    return handler_for(value) is _OBJECT


class ContainerHandler(Handler):
    """Containers of plain values only are stored as one value; others are walked."""

    def save(self, value, key, walk):
        if key and is_plain(value):
            return _OBJECT.save(value, key, walk)
        return self.save_items(value, key, walk)

    def load(self, value, key, walk, assign):
        if key and is_plain(value):
            return _OBJECT.load(value, key, walk, assign)
        self.load_items(value, key, walk, assign)


@register(dict)
class DictHandler(ContainerHandler):
    def save_items(self, value, key, walk):
        return {"dict": [[codec.encode(k), walk.save(v, join(key, k))] for k, v in value.items()]}

    def load_items(self, value, key, walk, assign):
        for k, v in list(value.items()):
            walk.load(v, join(key, k), _setitem(value, k))


@register(list)
class ListHandler(ContainerHandler):
    def save_items(self, value, key, walk):
        return {"list": [walk.save(v, join(key, i)) for i, v in enumerate(value)]}

    def load_items(self, value, key, walk, assign):
        for i, v in enumerate(value):
            walk.load(v, join(key, i), _setitem(value, i))


@register(tuple)
class TupleHandler(ContainerHandler):
    def save_items(self, value, key, walk):
        return {"tuple": [walk.save(v, join(key, i)) for i, v in enumerate(value)]}

    def load_items(self, value, key, walk, assign):
        items = list(value)
        for i, v in enumerate(items):
            walk.load(v, join(key, i), _setitem(items, i))
        walk.flat.finalizers.append(lambda: assign(type(value)(items) if type(value) is tuple else value))


def _setitem(container: Any, k: Any) -> Callable[[Any], None]:
    def assign(v: Any) -> None:
        container[k] = v
    return assign


# ------------------------------------------------------------------ tensors

@register(torch.Tensor)
class TensorHandler(Handler):
    """A plain tensor is replicated: every rank holds all of it; it is written once."""

    def save(self, value, key, walk):
        walk.add_tensor(_entry(key, value, tuple(value.shape), "replicated", [((0,) * value.dim(), value)]))
        return {"tensor": key}

    def load(self, value, key, walk, assign):
        walk.add_tensor(_entry(key, value, tuple(value.shape), "replicated", [((0,) * value.dim(), value)]))


@register(Shard)
class ShardHandler(Handler):
    def save(self, value, key, walk):
        walk.add_tensor(_entry(key, value.local, value.global_shape, "sharded", [(value.offsets, value.local)]))
        return {"tensor": key}

    def load(self, value, key, walk, assign):
        self.save(value, key, walk)


@register(FlatShard)
class FlatShardHandler(Handler):
    """Decomposed into boxes, each a contiguous run of the flat local buffer (no communication)."""

    def save(self, value, key, walk):
        flat = value.local.reshape(-1)
        pieces, pos = [], 0
        for offs, lens in flat_range_to_boxes(value.global_shape, value.start, value.stop):
            n = math.prod(lens)
            pieces.append((offs, flat[pos:pos + n].view(lens)))
            pos += n
        walk.add_tensor(_entry(key, value.local, value.global_shape, "flat", pieces))
        return {"tensor": key}

    def load(self, value, key, walk, assign):
        self.save(value, key, walk)


def _entry(key: str, like: torch.Tensor, shape, layout: str, pieces, grid=None) -> TensorEntry:
    return TensorEntry(key, like.dtype, tuple(int(s) for s in shape), layout,
                       [Piece(tuple(int(o) for o in offs), tuple(t.shape), t) for offs, t in pieces], grid)


# ------------------------------------------------------------------ modules, optimizers, stateful

@register(nn.Module)
class ModuleHandler(Handler):
    def save(self, value, key, walk):
        if fsdp1.holds_fsdp1(value):
            return fsdp1.save_module(value, key, walk)
        return walk.save(dict(value.state_dict()), key)

    def load(self, value, key, walk, assign):
        if fsdp1.holds_fsdp1(value):
            return fsdp1.load_module(value, key, walk)
        sd = value.state_dict()
        walk.load(sd, key, lambda v: None)
        walk.flat.finalizers.append(lambda: value.load_state_dict(sd))


@register(torch.optim.Optimizer)
class OptimizerHandler(Handler):
    """Keyed by parameter name (via the module in the same state that owns the parameters), so
    optimizer state reshards with the model; without such a module, falls back to index keys."""

    def save(self, value, key, walk):
        model = _owner_module(value, walk.param_owner)
        if model is None:
            return _STATEFUL.save(value, key, walk)
        if fsdp1.uses_flat_route(model, walk.fsdp1_route):
            return fsdp1.save_optimizer(value, model, key, walk)
        return walk.save(_named_optimizer_state(model, value), key)

    def load(self, value, key, walk, assign):
        model = _owner_module(value, walk.param_owner)
        if model is None:
            return _STATEFUL.load(value, key, walk, assign)
        if fsdp1.uses_flat_route(model, walk.fsdp1_route):
            return fsdp1.load_optimizer(value, model, key, walk)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        # A state dict of plain values only is loaded whole (assign); otherwise in place.
        loaded = {}
        if _saved_without_state(walk.saved, key):
            # Saved before its first step: the loaded optimizer has no state either, exactly as saved.
            loaded["osd"] = _named_optimizer_state(model, value, with_state=False)
            walk.load(loaded["osd"], key, lambda v: loaded.__setitem__("osd", v))
            walk.flat.finalizers.append(lambda: _load_groups_only(value, loaded["osd"]))
            return
        loaded["osd"] = get_optimizer_state_dict(model, value)  # creates state for a fresh target: the template
        walk.load(loaded["osd"], key, lambda v: loaded.__setitem__("osd", v))
        walk.flat.finalizers.append(lambda: set_optimizer_state_dict(model, value, loaded["osd"]))


def _named_optimizer_state(model: nn.Module, optim: torch.optim.Optimizer, with_state: bool = True) -> Dict:
    """torch's parameter-name-keyed optimizer state dict, without side effects. For an optimizer
    with no state yet torch would run a zero-lr step() to create it (a checkpoint must never change
    training): a lone empty placeholder entry makes it skip that, and the state is put back."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    first = next((p for g in optim.param_groups for p in g["params"]), None)
    if (with_state and optim.state) or first is None:
        return get_optimizer_state_dict(model, optim)
    kept = dict(optim.state)
    optim.state.clear()
    optim.state[first] = {}
    try:
        osd = get_optimizer_state_dict(model, optim)
    finally:
        optim.state.clear()
        optim.state.update(kept)
    osd["state"] = {}
    return osd


def _saved_without_state(saved: Any, key: str) -> bool:
    """The checkpoint holds this optimizer's state as plain values only (no tensors): it was saved
    before its first step (the whole state dict, or its "state" entry, is one plain value)."""
    if saved is None:
        return False
    whole, state = find_subtree(saved, key), find_subtree(saved, join(key, "state"))
    return any(isinstance(n, dict) and ("object" in n or n == {"dict": []}) for n in (whole, state))


def _load_groups_only(optim: torch.optim.Optimizer, osd: Dict) -> None:
    """Hyper-parameters from the checkpoint's param groups, no state (what a fresh save holds)."""
    optim.state.clear()
    saved = osd.get("param_groups", [])
    if len(saved) != len(optim.param_groups):
        raise StateMismatchError(f"optimizer: the checkpoint has {len(saved)} param groups, the optimizer "
                                 f"{len(optim.param_groups)}; build it with the same groups")
    for group, values in zip(optim.param_groups, saved):
        group.update({k: v for k, v in values.items() if k != "params"})


class StatefulHandler(Handler):
    """Objects with state_dict()/load_state_dict(): loaded from the full saved value."""

    def save(self, value, key, walk):
        return walk.save(value.state_dict(), key)

    def load(self, value, key, walk, assign):
        walk.flat.subtrees[key] = value.load_state_dict


class ObjectHandler(Handler):
    """Plain values: stored per rank in the safe encoding (see codec.py)."""

    def save(self, value, key, walk):
        if key in walk.flat.objects:
            raise CheckpointError(f"key {key!r} appears twice in the state; rename one")
        walk.flat.objects[key] = value
        return {"object": key}

    def load(self, value, key, walk, assign):
        walk.flat.setters[key] = assign


_STATEFUL = StatefulHandler()
_OBJECT = ObjectHandler()


def _param_owners(state: Any) -> Dict[int, nn.Module]:
    """id(parameter) -> the top-level module (found anywhere in the state) that owns it."""
    owners: Dict[int, nn.Module] = {}

    def visit(v: Any, depth: int) -> None:
        if depth > 4:
            return
        if isinstance(v, nn.Module):
            for p in v.parameters():
                owners.setdefault(id(p), v)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x, depth + 1)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x, depth + 1)
    visit(state, 0)
    return owners


def _owner_module(optim: torch.optim.Optimizer, owners: Dict[int, nn.Module]) -> Optional[nn.Module]:
    found = {id(owners.get(id(p))) : owners.get(id(p)) for g in optim.param_groups for p in g["params"]}
    if len(found) == 1 and None not in found.values():
        return next(iter(found.values()))
    return None


# ------------------------------------------------------------------ structure -> value

def build_from_structure(node: Any, tensors: Dict[str, torch.Tensor], objects: Dict[str, Any]) -> Any:
    """Rebuild a nested value from a structure node with full tensors and decoded objects."""
    if not isinstance(node, dict) or len(node) != 1:
        raise CheckpointError(f"malformed structure node {node!r:.80}")
    kind, body = next(iter(node.items()))
    if kind == "dict":
        return {codec._hashable(codec.decode(k)): build_from_structure(v, tensors, objects) for k, v in body}
    if kind == "list":
        return [build_from_structure(v, tensors, objects) for v in body]
    if kind == "tuple":
        return tuple(build_from_structure(v, tensors, objects) for v in body)
    if kind == "tensor":
        return tensors[body]
    if kind == "object":
        return objects[body]
    raise CheckpointError(f"unknown structure node kind {kind!r:.40}")


def top_level_placeholders(root: Any) -> Dict[Any, None]:
    """A load template that receives every top-level value of a saved state whole."""
    if not (isinstance(root, dict) and len(root) == 1 and "dict" in root):
        raise CheckpointError("the checkpoint's saved state is not a dict; load it with load_full")
    return {codec._hashable(codec.decode(k)): None for k, _ in root["dict"]}


def structure_leaves(node: Any, out: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """key -> 'tensor' | 'object' for every leaf of a structure tree."""
    out = {} if out is None else out
    if isinstance(node, dict) and len(node) == 1:
        kind, body = next(iter(node.items()))
        if kind == "dict":
            for _, v in body:
                structure_leaves(v, out)
        elif kind in ("list", "tuple"):
            for v in body:
                structure_leaves(v, out)
        elif kind in ("tensor", "object") and isinstance(body, str):
            out[body] = kind
    return out


def find_subtree(node: Any, prefix: str, key: str = "") -> Any:
    """The structure node saved at key path `prefix`, or None."""
    if key == prefix:
        return node
    if not (isinstance(node, dict) and len(node) == 1):
        return None
    kind, body = next(iter(node.items()))
    if kind == "dict":
        children = [(join(key, codec.decode(k)), v) for k, v in body]
    elif kind in ("list", "tuple"):
        children = [(join(key, i), v) for i, v in enumerate(body)]
    else:
        return None
    for child_key, child in children:
        if prefix == child_key or prefix.startswith(child_key + "/"):
            return find_subtree(child, prefix, child_key)
    return None


from . import dist_handlers  # noqa: E402,F401 - registers the DTensor, ShardedTensor and DDP handlers
