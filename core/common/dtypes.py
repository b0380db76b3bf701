"""The dtype vocabulary every layer shares: names in the metadata, their sizes, their torch
dtypes, their zarr v3 and safetensors names. A leaf: imports nothing of ours."""
from __future__ import annotations

from typing import Dict

import torch

from .errors import CheckpointError

# Our dtype names (torch's, without "torch.") in the order tables list them. zarr v3 /
# tensorstore use the same names.
NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16",
         "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
         "float8_e5m2fnuz")
ZARR: Dict[str, str] = {n: n for n in NAMES}

ITEMSIZE: Dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4,
    "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}

# our name -> safetensors dtype tag (complex128 has none)
SAFETENSORS: Dict[str, str] = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32", "complex64": "C64",
    "float64": "F64", "int64": "I64", "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
}

_TORCH: Dict[str, torch.dtype] = {n: getattr(torch, n) for n in NAMES if hasattr(torch, n)}

# dtypes numpy cannot hold, viewed as a same-width integer type for byte-level work
NUMPY_STAND_IN: Dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if _name in _TORCH:
        NUMPY_STAND_IN[_TORCH[_name]] = torch.uint8


def itemsize(name: str) -> int:
    return ITEMSIZE.get(name, 1)


def to_torch(name: str) -> torch.dtype:
    try:
        return _TORCH[name]
    except KeyError:
        raise CheckpointError(f"dtype {name!r} is not known to torch {torch.__version__}; known: "
                              f"{sorted(_TORCH)}") from None


def name_of(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ZARR:
        raise CheckpointError(f"dtype {dtype} is not supported; supported: {sorted(ZARR)}")
    return name
