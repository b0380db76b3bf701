"""The structure of a save as the union of every rank's (pure; the coordinator merges at plan time).

Ranks may hold different keys: pipeline stages and experts hold other parameters, so their model
and optimizer entries differ. The checkpoint's structure is the union of what every rank saved,
and `object_owners` says which rank's object file holds a plain value that rank 0 did not save
(a loading rank reads its own file, or rank 0's, and looks up the others there). Ranks whose
structures are identical (every data-parallel replica) send only a digest.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..common.errors import ShardLayoutError
from ..format import codec
from .flatten import find_subtree, join, structure_leaves


@dataclass(frozen=True)
class SavedStructure:
    """What metadata.json records of the state's nesting: the union tree and object owners."""
    tree: Any
    object_owners: Mapping[str, int] = field(default_factory=dict)


def digest(tree: Any) -> str:
    return hashlib.sha1(json.dumps(tree, separators=(",", ":")).encode()).hexdigest()


def senders(digests: Sequence[str]) -> List[int]:
    """The ranks whose structure the coordinator (rank 0) needs: the first of each digest other
    than rank 0's."""
    seen = {digests[0]}
    out = []
    for r, d in enumerate(digests):
        if d not in seen:
            seen.add(d)
            out.append(r)
    return out


def merge(trees: Mapping[int, Any]) -> SavedStructure:
    """The union of rank -> structure tree (rank 0's must be there; ranks absent hold a tree equal
    to one present). Keys keep rank 0's order, then each further rank's new keys in order. A key
    that is a tensor on one rank and a plain value (or container) on another is refused, naming
    both ranks."""
    ranks = sorted(trees)
    if not ranks or ranks[0] != 0:
        raise ValueError("merge: rank 0's structure is required")
    tree = trees[0]
    held = {k for k, kind in structure_leaves(tree).items() if kind == "object"}
    owners: Dict[str, int] = {}
    for r in ranks[1:]:
        tree = _union(tree, trees[r], "", r, trees)
        for k, kind in structure_leaves(trees[r]).items():
            if kind == "object" and k not in held and k not in owners:
                owners[k] = r
    return SavedStructure(tree, owners)


def _kind(node: Any) -> str:
    return next(iter(node)) if isinstance(node, dict) and len(node) == 1 else "?"


def _union(a: Any, b: Any, path: str, rank: int, trees: Mapping[int, Any]) -> Any:
    ka, kb = _kind(a), _kind(b)
    if ka != kb:
        raise _conflict(path, rank, kb, trees)
    if ka == "dict":
        index = {_ident(k): i for i, (k, _) in enumerate(a["dict"])}
        items = [list(kv) for kv in a["dict"]]
        for k, v in b["dict"]:
            i = index.get(_ident(k))
            if i is None:
                index[_ident(k)] = len(items)
                items.append([k, v])
            else:
                items[i][1] = _union(items[i][1], v, join(path, codec.decode(k)), rank, trees)
        return {"dict": items}
    if ka in ("list", "tuple"):
        xa, xb = a[ka], b[ka]
        common = [_union(x, y, join(path, i), rank, trees) for i, (x, y) in enumerate(zip(xa, xb))]
        return {ka: common + list(xa[len(xb):]) + list(xb[len(xa):])}
    return a  # a leaf: its body is its key path, the same on every rank


def _ident(encoded_key: Any) -> str:
    return json.dumps(encoded_key, sort_keys=True)


def _conflict(path: str, rank: int, kind: str, trees: Mapping[int, Any]) -> ShardLayoutError:
    other, other_kind = 0, "?"
    for r in sorted(trees):
        if r >= rank:
            break
        k = _kind_at(trees[r], path)
        if k is not None and k != kind:
            other, other_kind = r, k
            break
    what = {"object": "a plain value", "tensor": "a tensor", "dict": "a dict", "list": "a list",
            "tuple": "a tuple"}
    return ShardLayoutError(
        f"key {path or '<root>'!r}: rank {other} saves {what.get(other_kind, other_kind)} there but rank {rank} "
        f"{what.get(kind, kind)}; every rank that saves a key must save the same kind of value (a container "
        f"of plain values only is stored as one plain value: give it the same contents' kinds on every rank)")


def _kind_at(tree: Any, path: str) -> Optional[str]:
    node = find_subtree(tree, path)
    return _kind(node) if node is not None else None
