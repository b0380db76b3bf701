"""Safe encoding of non-tensor values (step counters, RNG states, hyper-parameters).

Plain Python values, numpy arrays and a few torch value types become tagged JSON; nothing is
executed on decode. Anything else is pickled on save, and decoding a pickle needs an explicit
`allow_pickle=True`, because unpickling runs arbitrary code.
"""
from __future__ import annotations

import base64
import json
import math
import pickle
from typing import Any

import numpy as np
import torch

from ..common.errors import CheckpointError


class PickleNotAllowedError(CheckpointError):
    pass


def encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if -(1 << 63) <= value < (1 << 63) else {"__bigint__": str(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if type(value) is list:
        return [encode(v) for v in value]
    if type(value) is tuple:
        return {"__tuple__": [encode(v) for v in value]}
    if type(value) is dict:
        return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biufc":
        arr = np.ascontiguousarray(value)
        return {"__ndarray__": [arr.dtype.str, list(arr.shape), base64.b64encode(arr.tobytes()).decode(),
                                isinstance(value, np.generic)]}
    if isinstance(value, torch.dtype):
        return {"__torch_dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"__torch_device__": str(value)}
    if isinstance(value, torch.Size):
        return {"__torch_size__": list(value)}
    return {"__pickle__": base64.b64encode(pickle.dumps(value)).decode(), "type": type(value).__qualname__}


def decode(data: Any, allow_pickle: bool = False, key: str = "") -> Any:
    if data is None or isinstance(data, (bool, str, int, float)):
        return data
    if isinstance(data, list):
        return [decode(v, allow_pickle, key) for v in data]
    if not isinstance(data, dict) or len(data) == 0:
        raise CheckpointError(f"value {key!r}: unrecognised encoding {data!r:.80}")
    tag = next(iter(data))
    body = data[tag]
    if tag == "__dict__":
        return {_hashable(decode(k, allow_pickle, key)): decode(v, allow_pickle, key) for k, v in body}
    if tag == "__tuple__":
        return tuple(decode(v, allow_pickle, key) for v in body)
    if tag == "__bytes__":
        return base64.b64decode(body)
    if tag == "__bigint__":
        return int(body)
    if tag == "__float__":
        return float(body)
    if tag == "__ndarray__":
        dtype, shape, raw, scalar = body
        dt = np.dtype(dtype)
        if dt.kind not in "biufc":
            raise CheckpointError(f"value {key!r}: refusing numpy dtype {dtype!r}")
        arr = np.frombuffer(base64.b64decode(raw), dtype=dt).reshape(shape).copy()
        return arr[()] if scalar else arr
    if tag == "__torch_dtype__":
        dt = getattr(torch, body, None)
        if not isinstance(dt, torch.dtype):
            raise CheckpointError(f"value {key!r}: unknown torch dtype {body!r}")
        return dt
    if tag == "__torch_device__":
        return torch.device(body)
    if tag == "__torch_size__":
        return torch.Size(body)
    if tag == "__pickle__":
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"value {key!r} is a pickled {data.get('type', 'object')}; unpickling runs code from the "
                f"checkpoint, so it is refused by default. Pass allow_pickle=True to load() if you trust "
                f"this checkpoint")
        return pickle.loads(base64.b64decode(body))
    raise CheckpointError(f"value {key!r}: unknown encoding tag {tag!r:.40}")


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def dumps(values: dict) -> bytes:
    # one encoding per distinct container object: an optimizer's group hyper-parameters are one
    # dict stored under every parameter name of the group (state/optimizer_form.py)
    memo: dict = {}

    def once(v: Any) -> Any:
        if type(v) not in (dict, list, tuple):
            return encode(v)
        if id(v) not in memo:
            memo[id(v)] = encode(v)
        return memo[id(v)]
    return json.dumps({k: once(v) for k, v in values.items()}, separators=(",", ":")).encode()


def loads_raw(raw: bytes) -> dict:
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise CheckpointError("object file is not a JSON object; the checkpoint is damaged")
    return data
