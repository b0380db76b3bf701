"""Plain values on load: each rank's object file read (`read_objects`), and the values that differ
between the ranks that saved them merged when loaded on another number of ranks.

Every rank writes its own plain values (its object file, with a crc32 in the metadata). At the
saved world size each rank reads its own. On another world size a rank used to read rank 0's, so a
value another rank held differently was silently lost (a per-rank dict's keys, a per-rank counter).
Here, when the metadata shows object files that differ (their crc32s: nothing read when all are
equal, the common case), every distinct file is read once and the values merged, key by key:

- equal on every rank that saved the key: that value;
- a dict on every such rank: the union of their keys, each merged the same way;
- otherwise the value of the saved rank this rank stands for (the data stream's rule: new rank r of
  W stands for saved ranks r*k .. r*k+k-1 when the saved world is k*W; on a scale-up, saved rank r
  for r below the saved world), else the lowest saved rank's, with a note naming the key and the
  ranks whose values were not taken.

`per_rank` gives each saved rank's values as it saved them (load_full(per_rank=True)).
Merging is pure; `read_objects` / `read_object_file` do the reading.
"""
from __future__ import annotations

import logging
import zlib
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..common.errors import CorruptCheckpointError, StateMismatchError
from ..format import codec
from ..format.metadata import Metadata
from ..storage import Storage

log = logging.getLogger("bytecheckpoint")


def files_differ(md: Metadata) -> bool:
    """Some rank's object file differs from another's (by crc32 and size)."""
    return len({(o.crc32, o.nbytes) for o in md.objects}) > 1


def stood_for(rank: int, world: int, saved_world: int) -> List[int]:
    """The saved ranks loading rank `rank` of `world` stands for."""
    if world < saved_world and saved_world % world == 0:
        k = saved_world // world
        return list(range(rank * k, rank * k + k))
    return [rank] if rank < saved_world else []


def read_files(md: Metadata, read: Callable[[int], Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """saved rank -> its plain values; each distinct file (by crc32 and size) read once."""
    by_content: Dict[Tuple[int, int], Dict[str, Any]] = {}
    out = {}
    for o in sorted(md.objects, key=lambda o: o.rank):
        sig = (o.crc32, o.nbytes)
        if sig not in by_content:
            by_content[sig] = read(o.rank)
        out[o.rank] = by_content[sig]
    return out


def merged(values: Mapping[int, Mapping[str, Any]], keys: Sequence[str], prefer: Sequence[int],
           notes: Optional[List[str]] = None) -> Dict[str, Any]:
    """The plain values `keys` (every key saved anywhere when empty) merged over the saved ranks'
    `values` (rank -> key -> value), preferring the ranks in `prefer` where values differ."""
    ranks = sorted(values)
    if not keys:
        keys = list(dict.fromkeys(k for r in ranks for k in values[r]))
    out = {}
    for key in keys:
        held = [(r, values[r][key]) for r in ranks if key in values[r]]
        if held:
            out[key] = _merge(key, held, prefer, notes if notes is not None else [])
    return out


def _merge(path: str, held: List[Tuple[int, Any]], prefer: Sequence[int], notes: List[str]) -> Any:
    first = held[0][1]
    if all(_equal(first, v) for _, v in held[1:]):
        return first
    if all(isinstance(v, dict) for _, v in held):
        keys = list(dict.fromkeys(k for _, v in _preferred_first(held, prefer) for k in v))
        return {k: _merge(f"{path}/{k}", [(r, v[k]) for r, v in held if k in v], prefer, notes) for k in keys}
    taken_rank, taken = _preferred_first(held, prefer)[0]
    others = [r for r, v in held if not _equal(v, taken)]
    notes.append(f"plain value {path!r} differs between the saved ranks: took saved rank {taken_rank}'s, not "
                 f"{_ranks(others)}'s (load_full(..., per_rank=True) returns every rank's)")
    return taken


def _preferred_first(held: List[Tuple[int, Any]], prefer: Sequence[int]) -> List[Tuple[int, Any]]:
    order = {r: i for i, r in enumerate(prefer)}
    return sorted(held, key=lambda rv: (order.get(rv[0], len(order)), rv[0]))


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a usable ==: different unless identical
        return a is b


def report(notes: List[str], rank: int) -> None:
    if notes:
        log.warning("bytecheckpoint (rank %d): %d plain value(s) differ between the saved ranks; %s%s", rank,
                    len(notes), "; ".join(notes[:3]), f" (and {len(notes) - 3} more)" if len(notes) > 3 else "")


def fill(template: Any, value: Any, path: str, strict: bool) -> Any:
    """`value` for a template's plain value: a dict never loses a key the template has. Strict: a
    template key the checkpoint lacks is an error (returned as the missing key paths); otherwise
    the template's entry stays."""
    missing: List[str] = []
    out = _fill(template, value, path, missing)
    if missing and strict:
        raise KeyError(missing)
    return out


def _fill(template: Any, value: Any, path: str, missing: List[str]) -> Any:
    if not (isinstance(template, dict) and isinstance(value, dict)):
        return value
    out = dict(value)
    for k, t in template.items():
        if k in value:
            out[k] = _fill(t, value[k], f"{path}/{k}", missing)
        else:
            missing.append(f"{path}/{k}")
            out[k] = t
    return out


# ---------------------------------------------------------------- reading

def read_objects(store: Storage, md: Metadata, rank: int, allow_pickle: bool, needed: Iterable[str] = (),
                 world: Optional[int] = None, notes: Optional[List[str]] = None) -> Dict[str, Any]:
    """Plain values saved by `rank` (or rank 0's when the checkpoint had fewer ranks), and those of
    `needed` that this file lacks from the rank that saved them (another pipeline stage's or
    expert's keys: metadata's object_owners, else rank 0). Loaded by `world` ranks other than the
    saved number, where the ranks' values differ: merged over every saved rank (py;
    what was not taken goes to `notes`)."""
    if md.foreign is not None:  # another format's plain values (core/foreign/): by key, not per rank
        keys = list(needed)
        return md.foreign.read(store, keys if keys else list(md.foreign.where), allow_pickle)
    if world is not None and world != md.world_size and files_differ(md):
        values = read_files(md, lambda r: read_object_file(store, md, r, allow_pickle))
        return merged(values, list(needed), stood_for(rank, world, md.world_size), notes)
    src = rank if rank < md.world_size else 0
    objects = read_object_file(store, md, src, allow_pickle)
    elsewhere: Dict[int, List[str]] = {}
    for key in needed:
        if key not in objects:
            owner = md.object_owners.get(key, 0)
            if owner != src:
                elsewhere.setdefault(owner, []).append(key)
    for owner, keys in sorted(elsewhere.items()):
        theirs = read_object_file(store, md, owner, allow_pickle, keys)
        objects.update({k: theirs[k] for k in keys if k in theirs})
    return objects


def read_object_file(store: Storage, md: Metadata, rank: int, allow_pickle: bool,
                      only: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    meta = next((o for o in md.objects if o.rank == rank), None)
    if meta is None:
        return {}
    raw = store.get(meta.path)
    if raw is None:
        raise CorruptCheckpointError(f"{store.url!r}: {meta.path} is missing; the checkpoint is damaged")
    if zlib.crc32(raw) != meta.crc32 or len(raw) != meta.nbytes:
        raise CorruptCheckpointError(f"{store.url!r}: {meta.path} fails its crc32 checksum; the checkpoint is "
                                     f"damaged")
    values = codec.loads_raw(raw)
    keys = values.keys() if only is None else [k for k in only if k in values]
    return {k: codec.decode(values[k], allow_pickle, k) for k in keys}


def filled(template: Any, value: Any, key: str, strict: bool) -> Any:
    """A loaded plain value never drops a key of the template's dict (rank_values.fill)."""
    try:
        return fill(template, value, key, strict)
    except KeyError as exc:
        missing = exc.args[0]
        raise StateMismatchError(f"plain value {key!r}: the checkpoint's dict has no {', '.join(repr(m) for m in missing[:20])} (the template "
                                 f"has them; nothing was removed from the template). Pass strict=False to keep the "
                                 f"template's entries for them") from None
