"""The safetensors file format, as Hugging Face defines it: dtype tags, the header (written
byte-identically to `safetensors.torch.save_file`, read with its limits checked), memory-mapped
reading, and the size / dtype spellings the CLI takes. tools/export.py streams checkpoints through it."""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..common import dtypes
from ..common.dtypes import itemsize as dtype_itemsize
from ..common.errors import CheckpointError

# ------------------------------------------------------------------ format constants

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FILE_PATTERN = "model{suffix}.safetensors"      # huggingface_hub / transformers naming
DEFAULT_MAX_SHARD_SIZE = "5GB"
MAX_HEADER_BYTES = 100_000_000                 # safetensors' own limit

# bytecheckpoint dtype name -> safetensors dtype tag
ST_DTYPES = dtypes.SAFETENSORS
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
# safetensors writes tensors ordered by dtype (this rank, descending), then by name.
_ST_ORDER = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16",
             "I32", "U32", "F32", "C64", "F64", "I64", "U64"]
_ST_RANK = {t: i for i, t in enumerate(_ST_ORDER)}

_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16", "float16": "float16",
    "half": "float16", "fp32": "float32", "f32": "float32", "float32": "float32", "float": "float32",
    "fp64": "float64", "f64": "float64", "float64": "float64", "double": "float64",
}

# Files of a Hugging Face model folder that are weights (never copied by --config-from).
WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.index\.json$")


# ------------------------------------------------------------------ small parsers

def parse_size(text: Any) -> int:
    """'5GB' (huggingface_hub's units: KB, MB, GB, TB, powers of 1000), '500MiB' (KiB, MiB, GiB,
    TiB, powers of 1024) or a plain number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        s = str(text).strip()
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", s, re.IGNORECASE)
        if m is None:
            raise ValueError(f"size {text!r} is not understood; write e.g. 5GB, 500MB, 2GiB or a number of bytes")
        value, unit = float(m.group(1)), (m.group(2) or "B").upper()
        power = "BKMGT".index(unit[0])
        size = int(value * ((1024 if "I" in unit else 1000) ** power))
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def parse_dtype(text: Optional[str]) -> Optional[str]:
    """'bf16' -> 'bfloat16' (floating-point dtypes only), None -> None."""
    if text is None:
        return None
    name = _DTYPE_ALIASES.get(str(text).strip().lower().removeprefix("torch."))
    if name is None:
        raise ValueError(f"dtype {text!r} is not supported for conversion; use one of bf16, fp16, fp32, fp64")
    return name


# ------------------------------------------------------------------ safetensors header

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


def read_header(path: str) -> Tuple[int, Dict[str, Any], Dict[str, str]]:
    """(data start, {name: entry}, __metadata__) of a safetensors file, validated."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n} is impossible for a file of "
                                  f"{size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    start, limit = 8 + n, size - 8 - n
    for name, e in header.items():
        ok = (isinstance(e, dict) and e.get("dtype") in FROM_ST and isinstance(e.get("shape"), list)
              and all(isinstance(s, int) and s >= 0 for s in e["shape"])
              and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
              and all(isinstance(o, int) for o in e["data_offsets"]))
        if not ok:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {e!r:.200}")
        b, end = e["data_offsets"]
        expected = math.prod(e["shape"]) * dtype_itemsize(FROM_ST[e["dtype"]])
        if not (0 <= b <= end <= limit) or end - b != expected:
            raise CheckpointError(f"{path}: tensor {name!r} has data offsets {e['data_offsets']} that do not fit "
                                  f"its shape {e['shape']} and dtype {e['dtype']} or the file; the file is damaged")
    return start, header, meta


def read_safetensors_mmap(path: str, names: Optional[Sequence[str]] = None
                          ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Tensors of one file as views of a private (copy-on-write) memory map: nothing is read
    until used, and nothing is copied unless an entry is misaligned for its dtype."""
    start, header, meta = read_header(path)
    if names is not None:
        missing = [n for n in names if n not in header]
        if missing:
            raise CheckpointError(f"{path}: the index lists {missing[:5]} but the file does not hold them")
    wanted = list(header) if names is None else list(names)
    out: Dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if os.path.getsize(path) else None
    for name in sorted(wanted, key=lambda n: header[n]["data_offsets"][0]):
        e = header[name]
        dt = dtypes.to_torch(FROM_ST[e["dtype"]])
        b, end = e["data_offsets"]
        if end == b:
            out[name] = torch.empty(e["shape"], dtype=dt)
            continue
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=end - b, offset=start + b)
        if (start + b) % dtype_itemsize(FROM_ST[e["dtype"]]):
            raw = raw.clone()
        out[name] = raw.view(dt).reshape(e["shape"])
    return out, meta
