"""Hugging Face safetensors export (streaming) and import.

Export reads one tensor at a time (through the engine's own reader, so every stored chunk's
checksum is checked) and appends its bytes to the output file, so peak memory stays near the
largest tensor (plus the stored chunk being copied), never the model and not even one output
shard: the safetensors header is written first, from the checkpoint metadata alone (every
tensor's shape and dtype are known before a byte is read).
Shards are planned by huggingface_hub's own splitter, which works from sizes alone; the file
names and the index are the ones `transformers.save_pretrained` writes. Each output file is
byte-identical to what `safetensors.torch.save_file` writes for the same tensors (pinned by a
golden test).

Import maps a safetensors file (or a sharded set with its index) into memory (mmap, no copy)
and saves it as a bytecheckpoint checkpoint with the tensors under one key ('model'), so
`bcp.load(path, {"model": model})` loads it resharded into any layout and world size.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..common import dtypes
from ..common.errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, StateMismatchError
from ..format.metadata import Metadata, TensorMeta
from ..state.modules import saved_own_names
from .safetensors import (  # noqa: F401 - re-exported (cli, users)
    DEFAULT_MAX_SHARD_SIZE,
    FILE_PATTERN,
    FROM_ST,
    INDEX_FILE,
    SINGLE_FILE,
    ST_DTYPES,
    WEIGHT_FILE,
    STEntry,
    file_order,
    header_bytes,
    parse_dtype,
    parse_size,
    read_safetensors_mmap,
)

# ------------------------------------------------------------------ choosing what to export

def _children(node: Any) -> List[Tuple[str, Any]]:
    from ..format import codec
    if not (isinstance(node, dict) and len(node) == 1):
        return []
    kind, body = next(iter(node.items()))
    if kind == "dict":
        return [(str(codec.decode(k)), v) for k, v in body]
    if kind in ("list", "tuple"):
        return [(str(i), v) for i, v in enumerate(body)]
    return []


def _tensor_names(node: Any, name: str = "") -> List[Tuple[str, str]]:
    """(state_dict name, checkpoint key) for every tensor under a structure node, in saved order.
    A module's state dict is one level of names; deeper nesting is joined with '.'. Names are the
    module's own: a torch.compile wrapper's '_orig_mod.' (in checkpoints saved before it was left
    out, or in a framework's state dict of a compiled submodule) is left out (state/modules.py)."""
    found = _saved_names(node, name)
    own = saved_own_names(n for n, _ in found)
    return [(own[n], k) for n, k in found]


def _saved_names(node: Any, name: str) -> List[Tuple[str, str]]:
    if isinstance(node, dict) and len(node) == 1 and "tensor" in node:
        return [(name, node["tensor"])]
    out: List[Tuple[str, str]] = []
    for k, child in _children(node):
        out += _saved_names(child, f"{name}.{k}" if name else k)
    return out


def _is_state_dict(node: Any) -> bool:
    kids = _children(node)
    return bool(kids) and all(isinstance(c, dict) and "tensor" in c for _, c in kids)


def _describe_keys(md: Metadata) -> str:
    parts = []
    for k, node in _children(md.structure):
        n = len(_tensor_names(node))
        parts.append(f"{k!r} ({n} tensors)" if n else f"{k!r} (no tensors)")
    return ", ".join(parts) or "(none)"


def select_tensors(md: Metadata, key: Optional[str] = None, prefix: Optional[str] = None
                   ) -> Tuple[str, List[Tuple[str, TensorMeta]]]:
    """(the key chosen, [(state_dict name, tensor metadata)]) for the export.

    Without `key`: 'model' if the checkpoint has it, else the only top-level key that holds a
    module state dict (a flat dict of tensors, e.g. Lightning's 'state_dict'). `prefix` keeps
    the names that start with it and strips it (e.g. 'model.' for a LightningModule that holds
    its network as `self.model`).
    """
    from ..state.flatten import find_subtree
    top = dict(_children(md.structure))
    if key is None:
        if "model" in top:
            key = "model"
        else:
            candidates = [k for k, node in top.items() if _is_state_dict(node)]
            if len(candidates) != 1:
                why = "several" if candidates else "no"
                raise StateMismatchError(f"{why} top-level keys hold a module state dict; choose one with --key. "
                                         f"Top-level keys: {_describe_keys(md)}")
            key = candidates[0]
    node = find_subtree(md.structure, key.strip("/"))
    if node is None:
        raise StateMismatchError(f"key {key!r} is not in the checkpoint; top-level keys: {_describe_keys(md)}")
    names = _tensor_names(node)
    if not names:
        raise StateMismatchError(f"key {key!r} holds no tensors; top-level keys: {_describe_keys(md)}")
    if prefix:
        kept = [(n[len(prefix):], k) for n, k in names if n.startswith(prefix) and len(n) > len(prefix)]
        if not kept:
            sample = ", ".join(repr(n) for n, _ in names[:5])
            raise StateMismatchError(f"no tensor name under {key!r} starts with prefix {prefix!r}; names look like "
                                     f"{sample}")
        names = kept
    seen: Dict[str, str] = {}
    for n, k in names:
        if n in seen:
            raise StateMismatchError(f"two tensors of {key!r} export to the same name {n!r} ({seen[n]!r} and {k!r})")
        seen[n] = k
    return key, [(n, md.tensors[k]) for n, k in names]


# ------------------------------------------------------------------ export

@dataclass
class ExportResult:
    out: str
    key: str
    files: List[str]                       # file names inside `out`, in order
    tensors: int
    total_size: int                        # bytes of tensor data written
    index_file: Optional[str] = None
    pushed_to: Optional[str] = None
    copied: List[str] = field(default_factory=list)


def plan_shards(entries: Sequence[STEntry], max_shard_size: Any):
    """huggingface_hub's own size-based splitter (state-dict order, one oversize tensor per
    shard), fed with sizes instead of tensors: returns its StateDictSplit."""
    from huggingface_hub import split_state_dict_into_shards_factory
    by_name = {e.name: e for e in entries}
    return split_state_dict_into_shards_factory(
        by_name, get_storage_size=lambda e: e.nbytes, filename_pattern=FILE_PATTERN,
        max_shard_size=parse_size(max_shard_size))


def _prepare_out(out: str, overwrite: bool) -> None:
    if os.path.isfile(out):
        raise CheckpointExistsError(f"{out!r} is a file; give a directory for the export")
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise CheckpointExistsError(f"output directory {out!r} exists and is not empty; pass --overwrite "
                                        f"(overwrite=True) to replace its weights, or choose a new directory")
        for name in os.listdir(out):  # stale shards of an earlier export must not survive
            if name == INDEX_FILE or re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.tmp)?", name):
                os.remove(os.path.join(out, name))
    os.makedirs(out, exist_ok=True)


def _write_tensor(f: BinaryIO, store, workers, md: Metadata, meta: TensorMeta, out_dtype: str,
                  progress: Callable[[int], None]) -> None:
    """Append one tensor's bytes (row-major, little-endian); only this tensor is in memory."""
    from ..pipeline.load import read_full_tensors
    shape = tuple(meta.shape)
    if math.prod(shape) == 0:
        return
    if sum(math.prod(r.lengths) for r in meta.regions) != math.prod(shape):
        raise CheckpointError(f"tensor {meta.key!r}: its saved regions do not cover it exactly once; the checkpoint "
                              f"is damaged (run `bytecheckpoint verify`)")
    t = read_full_tensors(store, workers, md, [meta.key])[meta.key]
    if out_dtype != meta.dtype:
        t = t.to(dtypes.to_torch(out_dtype))
    raw = t.reshape(-1).view(torch.uint8).numpy()
    f.write(memoryview(raw))
    progress(raw.nbytes)
    del t, raw
    if meta.nbytes >= 1 << 20:
        _release_free_memory()


def _release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc). The chunk buffers of a read are freed on
    worker threads; without this, glibc keeps tens of MiB per arena around after each tensor of
    a few MiB to 32 MiB and the process grows by ~5x the largest tensor instead of ~1x."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


def export_safetensors(path, out, *, key: Optional[str] = None, prefix: Optional[str] = None,
                       max_shard_size: Any = DEFAULT_MAX_SHARD_SIZE, dtype: Optional[str] = None,
                       overwrite: bool = False, config_from: Optional[str] = None,
                       storage_options: Optional[Mapping[str, Any]] = None,
                       progress: Optional[Callable[[int, int, str], None]] = None, checkpointer=None) -> ExportResult:
    """Write the tensors saved under `key` as Hugging Face safetensors in directory `out`.

    One `model.safetensors`, or `model-0000k-of-0000n.safetensors` plus
    `model.safetensors.index.json` when the total exceeds `max_shard_size`. Names are the
    module's state_dict names. `dtype` ('bf16', 'fp16', ...) converts floating-point tensors
    only. `config_from` (a config.json, or a Hugging Face model folder whose non-weight files
    are all copied) makes the folder loadable by `from_pretrained`. Works on a checkpoint saved
    by any number of ranks in any layout; holds one tensor in memory at a time.
    """
    from ..checkpointer import default_checkpointer
    from ..pipeline.workers import Workers
    ckpt = checkpointer or default_checkpointer()
    max_bytes = parse_size(max_shard_size)
    out_dtype = parse_dtype(dtype)
    out = os.fspath(out)
    store = ckpt.storage(path, storage_options)
    md = ckpt.metadata(path, storage_options=storage_options)
    workers = Workers(ckpt.options.threads)
    key, chosen = select_tensors(md, key, prefix)
    metas: Dict[str, TensorMeta] = {}
    entries: List[STEntry] = []
    for name, meta in chosen:
        if meta.dtype not in ST_DTYPES:
            raise CheckpointError(f"tensor {meta.key!r} has dtype {meta.dtype}, which safetensors cannot store")
        target = out_dtype if out_dtype and meta.dtype in _FLOATS else meta.dtype
        metas[name] = meta
        entries.append(STEntry(name, ST_DTYPES[target], tuple(meta.shape)))
    split = plan_shards(entries, max_bytes)
    _prepare_out(out, overwrite)

    total = sum(e.nbytes for e in entries)
    done = [0]

    def advance(n: int, name: str) -> None:
        done[0] += n
        if progress:
            progress(done[0], total, name)

    by_name = {e.name: e for e in entries}
    files = list(split.filename_to_tensors)
    with workers:
        _write_files(out, files, split, by_name, store, workers, md, metas, advance)
    index = None
    if split.is_sharded:
        index = INDEX_FILE
        body = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        with open(os.path.join(out, INDEX_FILE) + ".tmp", "w") as f:
            json.dump(body, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(os.path.join(out, INDEX_FILE) + ".tmp", os.path.join(out, INDEX_FILE))
    copied = copy_config(config_from, out) if config_from else []
    return ExportResult(out, key, files, len(entries), total, index, copied=copied)


def _write_files(out, files, split, by_name, store, workers, md, metas, advance) -> None:
    for fname in files:
        ordered = file_order([by_name[n] for n in split.filename_to_tensors[fname]])
        final = os.path.join(out, fname)
        tmp = final + ".tmp"
        with open(tmp, "wb") as f:
            f.write(header_bytes(ordered, {"format": "pt"}))
            for e in ordered:
                _write_tensor(f, store, workers, md, metas[e.name], FROM_ST[e.dtype],
                              lambda n, name=e.name: advance(n, name))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)


_FLOATS = {"float16", "bfloat16", "float32", "float64"}


def copy_config(src: str, out: str) -> List[str]:
    """Copy a config.json, or every non-weight top-level file of a model folder, into `out`."""
    src = os.fspath(src)
    if os.path.isfile(src):
        shutil.copyfile(src, os.path.join(out, "config.json"))
        return ["config.json"]
    if not os.path.isdir(src):
        raise CheckpointNotFoundError(f"--config-from {src!r}: no such file or directory")
    copied = []
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if os.path.isfile(p) and not name.startswith(".") and not WEIGHT_FILE.fullmatch(name):
            shutil.copyfile(p, os.path.join(out, name))
            copied.append(name)
    if "config.json" not in copied:
        raise CheckpointNotFoundError(f"--config-from {src!r}: the folder has no config.json")
    return copied


def push_to_hub(folder: str, repo_id: str, *, private: Optional[bool] = None, token: Optional[str] = None,
                revision: Optional[str] = None, commit_message: Optional[str] = None) -> str:
    """Upload an exported folder to the Hugging Face Hub (creating the model repo if needed);
    returns the commit URL. Credentials: `token`, else HF_TOKEN / `hf auth login`."""
    from huggingface_hub import HfApi
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                             commit_message=commit_message or "Upload model exported by bytecheckpoint")
    return str(getattr(info, "commit_url", info))


# ------------------------------------------------------------------ import

def _safetensors_files(hf_dir: str) -> List[Tuple[str, Optional[List[str]]]]:
    """[(file path, names to take from it or None for all)] of a model folder or file."""
    if os.path.isfile(hf_dir):
        if hf_dir.endswith(".json"):
            return _from_index(hf_dir)
        return [(hf_dir, None)]
    if not os.path.isdir(hf_dir):
        raise CheckpointNotFoundError(f"{hf_dir!r}: no such file or directory")
    indexes = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors.index.json"))
    if INDEX_FILE in indexes:
        return _from_index(os.path.join(hf_dir, INDEX_FILE))
    singles = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if SINGLE_FILE in singles:
        return [(os.path.join(hf_dir, SINGLE_FILE), None)]
    if len(indexes) == 1:
        return _from_index(os.path.join(hf_dir, indexes[0]))
    if len(singles) == 1:
        return [(os.path.join(hf_dir, singles[0]), None)]
    if not singles:
        raise CheckpointNotFoundError(f"{hf_dir!r} holds no .safetensors file (pytorch_model.bin is not read: it "
                                      f"is a pickle; convert it to safetensors first)")
    raise CheckpointError(f"{hf_dir!r} holds several .safetensors files ({', '.join(singles[:6])}) but no "
                          f"{INDEX_FILE}; pass the file or the index to import")


def _from_index(index_path: str) -> List[Tuple[str, Optional[List[str]]]]:
    try:
        with open(index_path) as f:
            body = json.load(f)
    except (ValueError, UnicodeDecodeError):
        body = None
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: not a safetensors index (needs a 'weight_map' object)")
    base = os.path.dirname(index_path)
    files: Dict[str, List[str]] = {}
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or os.path.basename(fname) != fname:
            raise CheckpointError(f"{index_path}: tensor {name!r} maps to {fname!r}, not a file name in the folder")
        files.setdefault(fname, []).append(name)
    for fname in files:
        if not os.path.isfile(os.path.join(base, fname)):
            raise CheckpointNotFoundError(f"{index_path} names {fname}, which is missing")
    return [(os.path.join(base, f), names) for f, names in files.items()]


def load_hf_state_dict(hf_dir: str) -> Dict[str, torch.Tensor]:
    """All tensors of a model folder (single file or sharded with index), memory-mapped."""
    state: Dict[str, torch.Tensor] = {}
    for path, names in _safetensors_files(os.fspath(hf_dir)):
        tensors, _ = read_safetensors_mmap(path, names)
        for n, t in tensors.items():
            if n in state:
                raise CheckpointError(f"tensor {n!r} appears in two safetensors files of {hf_dir!r}")
            state[n] = t
    if not state:
        raise CheckpointError(f"{hf_dir!r}: the safetensors file(s) hold no tensors")
    return state


def import_safetensors(hf_dir, out, *, key: str = "model", dtype: Optional[str] = None, overwrite: bool = False,
                       storage_options: Optional[Mapping[str, Any]] = None):
    """Hugging Face safetensors (a file, a folder, or a sharded folder with its index) -> a
    bytecheckpoint checkpoint at `out` holding {key: state_dict}. Returns the SaveHandle.

    Load it into any layout / world size with `bcp.load(out, {key: model})`.
    """
    from ..api import save
    out_dtype = parse_dtype(dtype)
    if not key or "/" in key:
        raise ValueError(f"key {key!r} must be a non-empty name without '/'")
    out = os.fspath(out)
    state = load_hf_state_dict(os.fspath(hf_dir))
    if out_dtype:
        state = {n: t.to(dtypes.to_torch(out_dtype)) if t.is_floating_point() else t for n, t in state.items()}
    local = out[len("file://"):] if out.startswith("file://") else None if "://" in out else out
    if local is not None and os.path.exists(local):  # remote stores: save() refuses an existing checkpoint
        if os.path.isfile(local):
            raise CheckpointExistsError(f"{out!r} is a file; give a directory for the checkpoint")
        if os.listdir(local) and not overwrite:
            raise CheckpointExistsError(f"output {out!r} exists and is not empty; pass --overwrite (overwrite=True) "
                                        f"to replace it, or choose a new path")
    return save(out, {key: state}, overwrite=overwrite, storage_options=storage_options)
