"""One module whose parameter names are several modules' (model parts'), for naming an optimizer
that spans them (state/parts.py says what parts are)."""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

from torch import nn

from . import fsdp1


class Namespaces:
    """One module whose parameter names are the union of several modules' (each module's subtree
    grafted into it), so DCP's optimizer state dict names an optimizer spanning model parts. Built
    once per list of parts (kept weakly) and reused: DCP's names are cached per module."""

    def __init__(self) -> None:
        self._made: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def of(self, modules: Sequence[nn.Module]) -> Optional[nn.Module]:
        """The namespace module of `modules` (in a fixed order), or None when their names collide."""
        modules = sorted(modules, key=id)
        cached = self._made.get(modules[0])
        if cached is not None and len(cached[0]) == len(modules) and all(
                r() is m for r, m in zip(cached[0], modules)):
            return cached[1]
        merged = graft(modules)
        if merged is not None:
            self._made[modules[0]] = (tuple(weakref.ref(m) for m in modules), merged)
        return merged


class _Namespace(nn.Module):
    """A module tree node that two or more parts both have (e.g. `layers`)."""


def graft(modules: Sequence[nn.Module]) -> Optional[nn.Module]:
    """A module holding every module's parameters under their own names; None where two hold the
    same name or one is FSDP1 (its flat parameters name nothing). The parts are not changed:
    their submodules are shared, not moved."""
    if any(fsdp1.holds_fsdp1(m) for m in modules):
        return None
    root = _Namespace()
    for m in modules:
        if not _graft(root, m):
            return None
    return root


def _graft(dst: nn.Module, src: nn.Module) -> bool:
    for name, p in src._parameters.items():
        if p is None:
            continue
        if name in dst._parameters or name in dst._modules:
            return False
        dst._parameters[name] = p
    for name, child in src._modules.items():
        if child is None:
            continue
        if name in dst._parameters:
            return False
        existing = dst._modules.get(name)
        if existing is None:
            dst._modules[name] = child
            continue
        if not isinstance(existing, _Namespace):
            node = _Namespace()
            if not _graft(node, existing):
                return False
            dst._modules[name] = existing = node
        if not _graft(existing, child):
            return False
    return True
