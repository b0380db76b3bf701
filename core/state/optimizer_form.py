"""The optimizer's saved form: everything keyed by parameter name, so any partition of the
parameters (pipeline stages, experts, model parts) loads into any other.

    <key>/state/<name>/<state key>    a tensor (or plain value) per parameter, as torch keeps it
    <key>/param_groups/<name>         the hyper-parameters of the group that held <name>

torch's own state dict keys groups by position (`param_groups[i]` with a list of parameters): a
rank that holds another stage holds other groups, so positions mean nothing across partitions.
Per name, the union over the ranks that saved is the whole optimizer, a group rule (no weight decay
on biases, another lr on the embedding) survives a re-split, and a parameter no rank saved is a
missing key the strict check names. DCP calls this `flatten_optimizer_state_dict`.

Checkpoints saved before this form (`param_groups` a list) load as before (modules.py).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..common.errors import StateMismatchError
from ..format import codec
from .basic import item_setter
from .flatten import find_subtree, join

STATE, GROUPS = "state", "param_groups"
_NOT_HYPER = ("params", "param_names")   # per-group lists of members, not hyper-parameters


def hyper_parameters(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


def save(osd: Dict[str, Any], key: str, walk) -> Any:
    """The structure node of a parameter-name-keyed optimizer state dict (torch's form, as
    DCP's get_optimizer_state_dict returns it) in the by-name form above. Both containers are
    dict nodes even when empty, so the nodes of ranks holding other parameters merge by name."""
    state_key, groups_key = join(key, STATE), join(key, GROUPS)
    state = [[codec.encode(name), walk.save(value, join(state_key, name))] for name, value in osd[STATE].items()]
    groups = []
    for group in osd[GROUPS]:
        hyper = hyper_parameters(group)
        for name in group["params"]:
            groups.append([codec.encode(name), walk.registry.plain.save(hyper, join(groups_key, name), walk)])
    return {"dict": [[codec.encode(STATE), {"dict": state}], [codec.encode(GROUPS), {"dict": groups}]]}


def merge(nodes: List[Any]) -> Any:
    """One by-name node of several optimizers' (model parts': their names are disjoint)."""
    state: List[Any] = []
    groups: List[Any] = []
    for node in nodes:
        children = dict((codec.decode(k), v) for k, v in node["dict"])
        state += children[STATE]["dict"]
        groups += children[GROUPS]["dict"]
    return {"dict": [[codec.encode(STATE), {"dict": state}], [codec.encode(GROUPS), {"dict": groups}]]}


def saved_by_name(saved: Any, key: str) -> bool:
    """The checkpoint holds the optimizer at `key` in the by-name form (param_groups a dict node)."""
    node = find_subtree(saved, join(key, GROUPS))
    return isinstance(node, dict) and "dict" in node


class ByNameLoad:
    """Loading a by-name optimizer into a live one's torch-form state dict `osd` (its state
    tensors loaded in place, plain values assigned); `result()` is `osd` with its groups' saved
    hyper-parameters, for set_optimizer_state_dict."""

    def __init__(self, osd: Dict[str, Any], key: str, walk, with_state: bool = True) -> None:
        self.osd, self.key = osd, key
        self.hyper: Dict[str, Any] = {}
        if with_state:
            state_key = join(key, STATE)
            for name, value in list(osd[STATE].items()):
                walk.load(value, join(state_key, name), item_setter(osd[STATE], name))
        groups_key = join(key, GROUPS)
        for group in osd[GROUPS]:
            for name in group["params"]:
                walk.registry.plain.load(None, join(groups_key, name), walk, item_setter(self.hyper, name))

    def result(self) -> Dict[str, Any]:
        groups = []
        for i, group in enumerate(self.osd[GROUPS]):
            groups.append({**group_values(i, group, self.hyper, self.key), "params": list(group["params"])})
        return {**self.osd, GROUPS: groups}


def group_values(index: int, group: Dict[str, Any], loaded: Dict[str, Any], key: str) -> Dict[str, Any]:
    """The hyper-parameters a live group takes: those saved for its parameters (which must agree:
    torch keeps one value per group), else (strict=False, none saved) its own."""
    first: Optional[str] = None
    values: Optional[Dict[str, Any]] = None
    for name in group["params"]:
        if name not in loaded:
            continue
        if values is None:
            first, values = name, loaded[name]
            continue
        differ = sorted(k for k in set(values) | set(loaded[name]) if values.get(k) != loaded[name].get(k))
        if differ:
            k = differ[0]
            raise StateMismatchError(
                f"optimizer {key!r}: param group {index} holds {first!r} and {name!r}, which the checkpoint "
                f"saved with different {k!r} ({values.get(k)!r} and {loaded[name].get(k)!r}); build the "
                f"optimizer with the groups it was saved with (e.g. the same no-decay rule)")
    if values is None:
        return hyper_parameters(group)
    return dict(values)


def names_to_positions(osd: Dict[str, Any]) -> Dict[str, Any]:
    """A parameter-name-keyed optimizer state dict (torch.distributed.checkpoint's form) keyed by
    position instead, as ``torch.optim.Optimizer.state_dict()`` keys it: position = index of the
    parameter in the param groups' ``params`` lists, in order. Values are not copied."""
    position = {name: i for i, name in enumerate(n for g in osd[GROUPS] for n in g["params"])}
    return {
        **{k: v for k, v in osd.items() if k not in (STATE, GROUPS)},
        STATE: {position[name]: s for name, s in osd[STATE].items()},
        GROUPS: [{**g, "params": [position[n] for n in g["params"]]} for g in osd[GROUPS]],
    }


def keyed_by_names(osd: Any) -> bool:
    """A torch-form optimizer state dict whose groups list parameter names (DCP's), not positions."""
    groups = osd.get(GROUPS) if isinstance(osd, dict) else None
    return bool(groups) and any(isinstance(p, str) for g in groups for p in g.get("params", ()))
