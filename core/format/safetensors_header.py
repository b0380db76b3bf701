"""The safetensors header, as Hugging Face defines it and `safetensors.torch.save_file` writes it, byte
for byte: dtype tags, the order tensors are laid out in, the header bytes. Pack files of format 6
(storage/packs.py) begin with it; the export (tools/) writes it."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..common import dtypes
from ..common.dtypes import itemsize as dtype_itemsize

# bytecheckpoint dtype name -> safetensors dtype tag
ST_DTYPES = dtypes.SAFETENSORS
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
# safetensors writes tensors ordered by dtype (this rank, descending), then by name.
_ST_ORDER = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16",
             "I32", "U32", "F32", "C64", "F64", "I64", "U64"]
_ST_RANK = {t: i for i, t in enumerate(_ST_ORDER)}


@dataclass(frozen=True)
class STEntry:
    """One tensor of an output file: its name, safetensors dtype tag, shape, byte size."""
    name: str
    dtype: str
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_itemsize(FROM_ST[self.dtype])


def file_order(entries: Sequence[STEntry]) -> List[STEntry]:
    """The order safetensors itself lays tensors out in (largest dtype first, then by name)."""
    return sorted(entries, key=lambda e: (-_ST_RANK[e.dtype], e.name))


def header_bytes(entries: Sequence[STEntry], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """8-byte little-endian length + JSON header padded with spaces to a multiple of 8, for
    `entries` laid out in the given order."""
    body: Dict[str, Any] = {}
    if metadata:
        body["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    for e in entries:
        body[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
