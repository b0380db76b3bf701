"""A whole `torch.save` archive's values read without executing it: its `data.pkl` unpickled with
every tensor replaced by a reference to its bytes in the archive, and every class that is not a
plain container replaced by an inert stand-in (`Opaque`, naming the class). Nothing the file names
is imported or called, so a forged archive cannot run code; values that hold stand-ins are read
for real only when the caller allows pickles (DeepSpeed's folders: core/foreign/deepspeed.py).

Tensor bytes are located from the archive's central directory (torch_zip), so a multi-GB archive
costs its directory and its data.pkl to parse, not its size.
"""
from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from ..common.errors import CorruptCheckpointError
from . import torch_zip


class Opaque:
    """A stand-in for an object of a class this reader does not admit (`name`: module.qualname):
    its constructor arguments and state are kept as data, nothing of the class runs."""
    name = "?"
    args: tuple = ()            # class defaults: pickle's NEWOBJ creates instances without __init__
    kwargs: dict = {}
    state: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.name} (not unpickled)>"


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the archive: `nbytes` bytes from archive offset `start`, C order."""
    storage: str
    start: int
    nbytes: int
    dtype: torch.dtype
    shape: Tuple[int, ...]
    crc32: int         # of the whole storage record (the tensor may be part of it)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _opaque(module: str, name: str):
    return type(name, (Opaque,), {"name": f"{module}.{name}"})


class _Storage:
    def __init__(self, key: str, dtype: Optional[torch.dtype]):
        self.key, self.dtype = key, dtype


class _Raw:
    """A tensor as data.pkl describes it, before its record is located."""

    def __init__(self, storage: _Storage, offset: int, shape, stride, dtype: Optional[torch.dtype]):
        self.storage, self.offset, self.shape, self.stride = storage, int(offset), tuple(shape), tuple(stride)
        self.dtype = dtype if dtype is not None else storage.dtype


class _OrderedDict(dict):
    """collections.OrderedDict as a plain dict; the attributes a state dict carries (`_metadata`) dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


def _rebuild_v2(storage, offset, size, stride, *rest):
    return _Raw(storage, offset, size, stride, None)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, *rest):
    return _Raw(storage, offset, size, stride, dtype)


def _rebuild_parameter(data, *rest):
    return data


def _rebuild_from_type(func, new_type, args, state=None):
    """A tensor subclass (nn.Parameter saved with its type): the plain tensor it wraps."""
    if func in (_rebuild_v2, _rebuild_v3, _rebuild_parameter):
        return func(*args)
    return _opaque("torch._tensor", "_rebuild_from_type_v2")(func, new_type, args, state)


def _reconstructor(cls, base, state=None):
    return cls(state) if isinstance(cls, type) and issubclass(cls, Opaque) else Opaque(cls, base, state)


_SAFE_BUILTINS = {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex, "bytearray": bytearray,
                  "range": range}


class _StatePickle(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch._utils":
            fn = {"_rebuild_tensor_v2": _rebuild_v2, "_rebuild_tensor_v3": _rebuild_v3,
                  "_rebuild_parameter": _rebuild_parameter, "_rebuild_parameter_with_state": _rebuild_parameter}
            if name in fn:
                return fn[name]
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type
        if module == "collections" and name == "OrderedDict":
            return _OrderedDict
        if module == "torch" and name == "Size":
            return tuple
        found = torch_zip.storage_or_dtype(module, name)
        if found is not None:
            return found
        if module in ("builtins", "__builtin__") and name in _SAFE_BUILTINS:  # protocol 2 says __builtin__
            return _SAFE_BUILTINS[name]
        if module == "copyreg" and name == "_reconstructor":
            return _reconstructor
        return _opaque(module, name)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected storage reference {pid!r:.80}")
        kind = pid[1]
        return _Storage(str(pid[2]), kind[1] if isinstance(kind, tuple) else None)


def walk(value: Any) -> Iterator[Any]:
    """Every value nested in `value` (dicts' keys and values, sequences, stand-ins' data)."""
    stack = [value]
    while stack:
        v = stack.pop()
        yield v
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif isinstance(v, Opaque):
            stack.extend(v.args)
            stack.append(v.state)


def load(blob: torch_zip.Blob) -> Any:
    """The archive's value with TensorRefs for tensors and Opaque stand-ins for other classes."""
    recs, cd_offset = torch_zip.records(blob)
    ends = {r.name: e for r, e in zip(recs, [r.header for r in recs[1:]] + [cd_offset])}
    by_name = {r.name: r for r in recs}
    pkl = [r for r in recs if r.name.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise blob.corrupt("no data.pkl record")
    prefix = pkl[0].name[:-len("data.pkl")]
    start = torch_zip.data_start(blob, pkl[0], ends[pkl[0].name])
    try:
        value = _StatePickle(io.BytesIO(blob.get(start, start + pkl[0].size))).load()
    except Exception as exc:  # a malformed pickle, whatever the failure: one clear error naming the file
        raise blob.corrupt(f"its data.pkl cannot be parsed: {type(exc).__name__}: {exc}") from None
    located: Dict[str, Tuple[int, int, int]] = {}

    def ref(raw: _Raw) -> TensorRef:
        key = raw.storage.key
        if key not in located:
            rec = by_name.get(f"{prefix}data/{key}")
            if rec is None:
                raise blob.corrupt(f"storage {key} has no record")
            located[key] = (torch_zip.data_start(blob, rec, ends[rec.name]), rec.size, rec.crc32)
        at, size, crc = located[key]
        if not isinstance(raw.dtype, torch.dtype):
            raise blob.corrupt(f"storage {key} has an unknown type")
        itemsize = torch.empty((), dtype=raw.dtype).element_size()
        numel = math.prod(raw.shape)
        if numel > 1 and raw.stride != torch_zip.contiguous_strides(raw.shape):
            raise CorruptCheckpointError(f"{blob.where}: a tensor of shape {list(raw.shape)} is stored with strides "
                                         f"{list(raw.stride)} (not C order); bytecheckpoint cannot map it in place")
        lo, hi = raw.offset * itemsize, (raw.offset + numel) * itemsize
        if hi > size:
            raise blob.corrupt(f"a tensor reaches past its storage record ({hi} > {size} bytes)")
        return TensorRef(key, at + lo, hi - lo, raw.dtype, raw.shape, crc)
    return _map(value, ref)


def _map(value: Any, fn: Callable[[_Raw], TensorRef]) -> Any:
    if isinstance(value, _Raw):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_map(v, fn) for v in value)
    if isinstance(value, Opaque):  # the per-class stand-in types become the one picklable Opaque
        out = Opaque(*(_map(v, fn) for v in value.args), **value.kwargs)
        out.name, out.state = value.name, _map(value.state, fn)
        return out
    return value
