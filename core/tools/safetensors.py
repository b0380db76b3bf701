"""The safetensors file format, as Hugging Face defines it: dtype tags, the header (written
byte-identically to `safetensors.torch.save_file`, read with its limits checked), memory-mapped
reading, and the size / dtype spellings the CLI takes. tools/export.py streams checkpoints through it."""
from __future__ import annotations

import errno
import json
import math
import mmap
import os
import re
import shutil
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..common import dtypes
from ..common.dtypes import itemsize as dtype_itemsize
from ..common.errors import CheckpointError
from ..format.safetensors_header import FROM_ST, ST_DTYPES, STEntry, file_order, header_bytes  # noqa: F401 - re-exported

# ------------------------------------------------------------------ format constants

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FILE_PATTERN = "model{suffix}.safetensors"      # huggingface_hub / transformers naming
DEFAULT_MAX_SHARD_SIZE = "5GB"
MAX_HEADER_BYTES = 100_000_000                 # safetensors' own limit

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


# ------------------------------------------------------------------ views of safetensors packs (format 6)

_LINK_ERRORS = (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK, errno.EACCES)


def link_views(root: str, md: Any, key_path: str, folder: str, *, weights_name: str = SINGLE_FILE) -> List[str]:
    """Show the tensors a checkpoint saved under `key_path` with `save(..., safetensors=[key_path])` as
    Hugging Face weights in `folder`, without a second copy: its safetensors packs (format 6) are hard
    linked there, one pack as `weights_name`, several as `<stem>-0000i-of-0000n.safetensors` with
    `<weights_name>.index.json` (the names `save_pretrained` writes). `root`: the checkpoint's local
    directory; `md`: its Metadata. Each name is replaced atomically; files of the same family left
    from an earlier save are removed (nothing else in `folder` is touched). Where the file system
    refuses a link (another device, no permission), the pack is copied instead. Linked packs are made
    read-only: a program writing into `folder` through one of these names fails instead of damaging
    the checkpoint. Returns the file names written, in order."""
    packs = md.safetensors.get(key_path.strip("/")) if getattr(md, "safetensors", None) else None
    if not packs:
        raise CheckpointError(
            f"{key_path!r} has no safetensors files in this checkpoint: save it with safetensors=[{key_path!r}] "
            f"(its tensors must each be held whole by a process, with dtypes safetensors has)")
    if not weights_name.endswith(".safetensors"):
        raise ValueError(f"weights_name must end with .safetensors, got {weights_name!r}")
    stem = weights_name[:-len(".safetensors")]
    sources = [os.path.join(root, md.packs[i]) for i in packs]
    n = len(sources)
    names = [weights_name] if n == 1 else [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    os.makedirs(folder, exist_ok=True)
    for src, name in zip(sources, names):
        _link_or_copy(src, os.path.join(folder, name))
    index = f"{weights_name}.index.json"
    written = list(names)
    if n > 1:
        weight_map: Dict[str, str] = {}
        total = 0
        for src, name in zip(sources, names):
            _, header, _ = read_header(src)
            weight_map.update({k: name for k in header})
            total += sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
        body = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                          indent=2, sort_keys=True) + "\n"
        with open(os.path.join(folder, index + ".tmp"), "w") as f:
            f.write(body)
        os.replace(os.path.join(folder, index + ".tmp"), os.path.join(folder, index))
        written.append(index)
    family = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.safetensors|{re.escape(index)}")
    for name in os.listdir(folder):
        if family.fullmatch(name) and name not in written:
            os.remove(os.path.join(folder, name))
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def _link_or_copy(src: str, dst: str) -> None:
    tmp = f"{dst}.{os.getpid()}.tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    try:
        os.chmod(src, 0o444)
    except OSError as exc:  # a file system without modes (some FUSE / SMB mounts): link it all the same
        if exc.errno not in _LINK_ERRORS + (errno.EROFS,):
            raise
    try:
        os.link(src, tmp)
    except OSError as exc:
        if exc.errno not in _LINK_ERRORS:
            raise
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
