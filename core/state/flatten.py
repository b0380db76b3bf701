"""State flattening: user state (Modules, Optimizers, DTensors, Shards, Stateful objects, nested
containers, plain values) -> flat tensor entries and plain values, and back.

One handler per value type, found through a registry by the value's type (MRO order), the
torchsnapshot way: adding a type means registering a handler, not growing an if/elif chain.
This module is the framework (records, Handler, TypeRegistry, Walker, the structure tree); the
built-in handlers live in handlers_*.py / state/distributed.py and are registered by state/registry.py.

A key is the path of dict keys / list indices joined by '/', e.g. 'model/layer.0.weight'.
The nesting itself is recorded as a `structure` tree (plain JSON) so that a checkpoint can be
read back without a template (`load_full`, export).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import torch
from torch import nn

from ..common.errors import CheckpointError
from ..format import codec


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


class ModuleView:
    """A module's tensors under other names, or a subset of them (e.g. a PEFT adapter of a model):
    saved as the flat dict `state_dict()` returns (its values the module's own tensors, or tensors
    made from them); loaded in place into a fresh `state_dict()`, then `load_state_dict(that dict)`.
    It counts as `module` where an optimizer's state is named by parameter (state/modules.py)."""

    def __init__(self, module: nn.Module, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], Any]):
        if not isinstance(module, nn.Module):
            raise TypeError(f"ModuleView: module must be a torch.nn.Module, got {type(module).__name__}")
        self.module, self.state_dict, self.load_state_dict = module, state_dict, load_state_dict

    def __repr__(self) -> str:
        return f"ModuleView({type(self.module).__name__})"


@dataclass
class Flat:
    """What a walk over the state produced."""
    tensors: Dict[str, TensorEntry] = field(default_factory=dict)
    objects: Dict[str, Any] = field(default_factory=dict)            # save: key -> value
    setters: Dict[str, Callable[[Any], None]] = field(default_factory=dict)  # load: key -> assign
    templates: Dict[str, Any] = field(default_factory=dict)  # load: key -> the template's plain value
    subtrees: Dict[str, Callable[[Any], None]] = field(default_factory=dict)  # load: prefix -> consume full value
    finalizers: List[Callable[[], None]] = field(default_factory=list)
    after: List[Callable[[], None]] = field(default_factory=list)  # load: after every finalizer (LR schedulers)
    structure: Any = None
    notes: Dict[str, str] = field(default_factory=dict)  # load: key -> how a value was prepared (LoadStats)
    undo: List[Callable[[], None]] = field(default_factory=list)  # load: take back what preparing made, on failure


# ------------------------------------------------------------------ registry

class Handler:
    """How one value type is saved (`save`) and loaded in place (`load`)."""

    def save(self, value: Any, key: str, walk: "Walker") -> Any:  # returns a structure node
        raise NotImplementedError

    def load(self, value: Any, key: str, walk: "Walker", assign: Callable[[Any], None]) -> None:
        raise NotImplementedError


class TypeRegistry:
    """Value type -> Handler, looked up along the value's MRO (most specific first). A value of no
    registered type goes to `stateful` when it has state_dict()/load_state_dict(), else to
    `plain` (stored as a value)."""

    def __init__(self, stateful: Handler, plain: Handler) -> None:
        self._handlers: Dict[Type, Handler] = {}
        self._by_name: Dict[str, Handler] = {}
        self.stateful, self.plain = stateful, plain

    def register_by_name(self, qualified_name: str, handler: Handler) -> None:
        """A handler for a class named "module.QualName", matched without importing its module
        (an optional framework, e.g. deepspeed.runtime.engine.DeepSpeedEngine)."""
        if not isinstance(handler, Handler):
            raise TypeError(f"register_by_name: handler must be a bytecheckpoint Handler, got {type(handler).__name__}")
        self._by_name[qualified_name] = handler

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
            if h is None and self._by_name:
                h = self._by_name.get(f"{klass.__module__}.{klass.__qualname__}")
            if h is not None:
                return h
        if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            return self.stateful
        return self.plain

    def __contains__(self, typ: Type) -> bool:
        return typ in self._handlers


def join(prefix: str, k: Any) -> str:
    return f"{prefix}/{k}" if prefix else str(k)


class Walker:
    def __init__(self, state: Any, registry: TypeRegistry, for_load: bool, saved: Any = None,
                 fsdp1_route: str = "flat", on_tensor: Optional[Callable[[TensorEntry], None]] = None):
        self.flat = Flat()
        self.on_tensor = on_tensor  # save: called with each tensor entry as the walk finds it
        self.registry = registry
        self.for_load = for_load
        self.saved = saved  # load: the checkpoint's structure tree (what was saved), if known
        self.fsdp1_route = fsdp1_route  # how FSDP1 models are read/written (see state/fsdp1.py)
        self.param_owner = _param_owners(state)
        self.optimizers = _optimizers(state)  # ids of the optimizers in the state

    def save(self, value: Any, key: str) -> Any:
        return self.registry.handler_for(value).save(value, key, self)

    def load(self, value: Any, key: str, assign: Callable[[Any], None]) -> None:
        self.registry.handler_for(value).load(value, key, self, assign)

    def add_tensor(self, entry: TensorEntry) -> None:
        if entry.key in self.flat.tensors:
            raise CheckpointError(f"key {entry.key!r} appears twice in the state (two dict keys that print the "
                                  f"same, e.g. 1 and '1'); rename one")
        self.flat.tensors[entry.key] = entry
        if self.on_tensor is not None:
            self.on_tensor(entry)


def flatten_for_save(state: Any, registry: TypeRegistry, fsdp1_route: str = "flat",
                     on_tensor: Optional[Callable[[TensorEntry], None]] = None) -> Flat:
    _check_top(state)
    w = Walker(state, registry, for_load=False, fsdp1_route=fsdp1_route, on_tensor=on_tensor)
    with torch.no_grad():  # the walk only reads: no autograd views (DTensor.to_local is then its local tensor)
        w.flat.structure = w.save(state, "")
    return w.flat


def flatten_for_load(state: Any, registry: TypeRegistry, saved_structure: Any = None,
                     fsdp1_route: str = "flat") -> Flat:
    _check_top(state)
    w = Walker(state, registry, for_load=True, saved=saved_structure, fsdp1_route=fsdp1_route)
    w.load(state, "", lambda v: None)
    return w.flat


def _check_top(state: Any) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict (e.g. {{'model': model, 'optimizer': optim}}), "
                        f"got {type(state).__name__}")


def tensor_entry(key: str, like: torch.Tensor, shape, layout: str, pieces, grid=None) -> TensorEntry:
    return TensorEntry(key, like.dtype, tuple(int(s) for s in shape), layout,
                       [Piece(tuple(int(o) for o in offs), tuple(t.shape), t) for offs, t in pieces], grid)


def each_leaf(state: Any, fn: Callable[[Any], None], depth: int = 0) -> None:
    """fn(value) for the values in `state`'s dicts, lists and tuples, down to 4 levels (where the walk
    looks for the modules, and async staging for the optimizers, that a state holds)."""
    if isinstance(state, dict):
        values: Any = state.values()
    elif isinstance(state, (list, tuple)):
        values = state
    else:
        fn(state)
        return
    if depth >= 4:
        return
    for x in values:
        if isinstance(x, (dict, list, tuple)):
            each_leaf(x, fn, depth + 1)
        else:
            fn(x)


def _optimizers(state: Any) -> set:
    found: set = set()
    each_leaf(state, lambda v: found.add(id(v)) if isinstance(v, torch.optim.Optimizer) else None)
    return found


def _param_owners(state: Any) -> Dict[int, nn.Module]:
    """id(parameter) -> the top-level module (found anywhere in the state) that owns it."""
    owners: Dict[int, nn.Module] = {}

    def visit(v: Any) -> None:
        if isinstance(v, (nn.Module, ModuleView)):
            module = v.module if isinstance(v, ModuleView) else v
            for p in module.parameters():
                owners.setdefault(id(p), module)
    each_leaf(state, visit)
    return owners


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
