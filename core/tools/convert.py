"""Leaving: any checkpoint the engine reads (ours, PyTorch DCP) written as a PyTorch DCP directory
or one torch.save file, keyed as a framework writes it (`bytecheckpoint convert`, docs/switching.md).

The saved state is rebuilt as the nested dict a framework would hand to dcp.save, with every tensor a
placeholder (`Lazy`); a layout (torchtitan, lightning) re-keys it; its leaves, by DCP's own traversal
rule, go to the DCP writer (dcp_writer.py), whose writers each read, write and free one tensor at a
time, so memory holds a tensor per writer, not the model. `.metadata` is written last: a converted
directory is complete or absent.
torch.save needs the whole dict in memory at once (one pickle), as any .ckpt file does.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..common.errors import CheckpointError, CheckpointExistsError
from ..collectives.comm import LOCAL, Comm
from ..format.metadata import Metadata
from ..pipeline.load import read_full_tensors
from ..pipeline.plain_values import read_objects
from ..pipeline.workers import Workers
from ..state.flatten import build_from_structure, structure_leaves
from ..state.optimizer_form import keyed_by_names, names_to_positions
from ..storage import Storage
from . import dcp_writer

LAYOUTS = ("plain", "torchtitan", "lightning", "accelerate")
TARGETS = ("dcp", "torch")


@dataclass
class ConvertResult:
    target: str
    layout: str
    tensors: int = 0
    values: int = 0
    nbytes: int = 0
    files: List[str] = field(default_factory=list)


class Lazy:
    """A saved tensor not read yet: `load()` reads it whole (one tensor's memory)."""

    def __init__(self, key: str, reader: Callable[[str], torch.Tensor], nbytes: int = 0):
        self.key, self._reader, self.nbytes = key, reader, nbytes

    def load(self) -> torch.Tensor:
        return self._reader(self.key)


def saved_state(store: Storage, md: Metadata, workers: Workers, allow_pickle: bool) -> Dict[str, Any]:
    """The saved state as nested dicts/lists: plain values read, tensors as Lazy placeholders."""
    leaves = structure_leaves(md.structure)
    objects = read_objects(store, md, 0, allow_pickle, [k for k, kind in leaves.items() if kind == "object"])

    def read(key: str) -> torch.Tensor:
        return read_full_tensors(store, workers, md, [key])[key]
    tensors = {k: Lazy(k, read, md.tensors[k].nbytes) for k, kind in leaves.items() if kind == "tensor"}
    state = build_from_structure(md.structure, tensors, objects)
    if not isinstance(state, dict):
        raise CheckpointError("convert: the saved state is not a dict")
    return state


# ---------------------------------------------------------------- layouts: our saved form -> a framework's

def plain_layout(state: Dict[str, Any]) -> Dict[str, Any]:
    """The saved nesting, with every optimizer in the form of torch's get_optimizer_state_dict
    (what dcp.load expects): `param_groups` a list of groups listing their parameters' names
    (parameters whose saved hyper-parameters are equal form one group, in first-seen order)."""
    return {k: _dcp_optimizer(v) if _our_optimizer(v) else v for k, v in state.items()}


def _our_optimizer(v: Any) -> bool:
    return isinstance(v, dict) and set(v) == {"state", "param_groups"} and isinstance(v["param_groups"], dict)


def _dcp_optimizer(value: Dict[str, Any]) -> Dict[str, Any]:
    groups: List[Dict[str, Any]] = []
    for name, hyper in value["param_groups"].items():
        group = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hyper), None)
        if group is None:
            group = {**hyper, "params": []}
            groups.append(group)
        group["params"].append(name)
    return {"state": value["state"], "param_groups": groups}


def torchtitan_layout(state: Dict[str, Any]) -> Dict[str, Any]:
    """ByteCheckpointManager's saved form -> what torchtitan's own (DCP) CheckpointManager writes: model
    FQNs at the top level, the optimizer as its flat `state.<fqn>.<name>` / `param_groups.<fqn>.<key>`
    dict, each DP rank's data position as `dataloader.dp_rank_<r>` bytes."""
    if "model" not in state:
        raise CheckpointError("convert --layout torchtitan: no 'model' key (not saved by ByteCheckpointManager)")
    out: Dict[str, Any] = dict(state["model"])
    for key, value in state.items():
        if key == "model":
            continue
        if key == "optimizer" and isinstance(value, dict) and "state" in value:
            flat = {f"state.{fqn}.{name}": v for fqn, st in value["state"].items() for name, v in st.items()}
            groups = value.get("param_groups", {})
            if isinstance(groups, list):  # torch's positional form: names in `params`
                groups = {fqn: g for g in groups for fqn in g["params"]}
            flat.update({f"param_groups.{fqn}.{k}": v for fqn, g in groups.items() for k, v in g.items()
                         if k not in ("params", "param_names")})
            out[key] = flat
        elif key == "dataloader" and isinstance(value, dict) and "positions" in value:
            rows, lengths = value["positions"].load(), value["lengths"].load()
            out[key] = {**{f"dp_rank_{r}": bytes(rows[r, :int(lengths[r])].numpy().tobytes())
                           for r in range(rows.shape[0])}, "world_size": int(rows.shape[0])}
        else:
            out[key] = value
    return out


def lightning_layout(state: Dict[str, Any]) -> Dict[str, Any]:
    """ByteCheckpointIO's saved form -> Lightning's checkpoint dict (its record dropped, optimizer
    states keyed by position as a torch optimizer's state_dict() is). The plugin's data position
    (its stateful train loader's, in the fit loop) is dropped: stock loaders keep none, and Lightning
    refuses a checkpoint with more loader states than stateful loaders."""
    out = {k: v for k, v in state.items() if k != "bytecheckpoint_lightning"}
    fit = out.get("loops", {}).get("fit_loop", {}) if isinstance(out.get("loops"), dict) else {}
    if isinstance(fit, dict) and isinstance(fit.get("state_dict"), dict) and fit["state_dict"].get("combined_loader"):
        fit["state_dict"]["combined_loader"] = []
    optimizers = out.get("optimizer_states")
    if isinstance(optimizers, list):
        out["optimizer_states"] = [names_to_positions(o) if keyed_by_names(o) else o for o in optimizers]
    return out


def accelerate_layout(state: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """accelerate_bytecheckpoint.attach's saved form -> what Accelerate's FSDP SHARDED_STATE_DICT
    save_state writes, one DCP directory per object: `pytorch_model_fsdp_<i>/` ({"model": state
    dict}) and `optimizer_<i>/` ({"optimizer": parameter-name-keyed state})."""
    out: Dict[str, Dict[str, Any]] = {}
    for key, value in state.items():
        model, optimizer = re.fullmatch(r"model(?:_(\d+))?", key), re.fullmatch(r"optimizer(?:_(\d+))?", key)
        if model and isinstance(value, dict):
            out[f"pytorch_model_fsdp_{int(model.group(1) or 0)}"] = {"model": value}
        elif optimizer and _our_optimizer(value):
            out[f"optimizer_{int(optimizer.group(1) or 0)}"] = {"optimizer": _dcp_optimizer(value)}
    if "pytorch_model_fsdp_0" not in out:
        raise CheckpointError("convert --layout accelerate: no 'model' key (not saved by accelerate_bytecheckpoint's "
                              "attach; pass its save_state folder's bytecheckpoint/ subfolder)")
    return out


_LAYOUT_FNS = {"plain": plain_layout, "torchtitan": torchtitan_layout, "lightning": lightning_layout,
               "accelerate": accelerate_layout}
ACCELERATE_SUBDIR = "bytecheckpoint"   # accelerate_bytecheckpoint's folder inside a save_state folder


# ---------------------------------------------------------------- writers

def dcp_leaves(state: Dict[str, Any]) -> List[Tuple[Tuple[Any, ...], Any]]:
    """(path, value) of every leaf DCP would store, by torch.distributed.checkpoint._traverse's rule:
    mappings are walked (keys as str); a list is walked only if it holds a tensor or a walkable
    mapping/list; every other value is one leaf."""
    def tensorish(v: Any) -> bool:
        return isinstance(v, (torch.Tensor, Lazy))

    def terminal(v: Any) -> bool:
        if isinstance(v, dict):
            return False
        if not isinstance(v, list):
            return True
        return not any(isinstance(e, (dict, list)) and not terminal(e) or tensorish(e) for e in v)

    out: List[Tuple[Tuple[Any, ...], Any]] = []

    def walk(path: Tuple[Any, ...], v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(path + (str(k),), x)
        elif terminal(v):
            out.append((path, v))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(path + (i,), x)
    for key, value in state.items():
        walk((str(key),), value)
    return out


def write_dcp(state: Dict[str, Any], dst: str, progress: Optional[Callable[[int, int], None]] = None,
              writers: int = 4, read_many: Optional[Callable[[List[str]], Dict[str, torch.Tensor]]] = None,
              comm: Optional[Comm] = None) -> ConvertResult:
    """The state as a DCP directory (tools/dcp_writer.py: several writers, each a batch of tensors in
    memory; `read_many` reads a batch of saved tensors at once). Under a process group every rank
    writes its share; the coordinator writes `.metadata` once all have (collective)."""
    comm = comm if comm is not None else Comm(LOCAL)

    def leaf(path: Tuple[Any, ...], value: Any) -> dcp_writer.Leaf:
        if isinstance(value, Lazy):
            return dcp_writer.Leaf(path, True, value.load, value.key, value.nbytes)
        return dcp_writer.Leaf(path, isinstance(value, torch.Tensor), lambda: value)
    leaves = [leaf(p, v) for p, v in dcp_leaves(state)]
    placed = comm.run(lambda: dcp_writer.write_share(leaves, dst, comm.rank, comm.world_size, writers, progress,
                                                     read_many), "converting")
    shares = comm.gather(placed)

    def commit():
        return dcp_writer.write_metadata(leaves, {n: p for share in shares for n, p in share.items()}, dst)
    tensors, values, nbytes, files = comm.run_on_coordinator(commit, "writing the DCP .metadata")
    return ConvertResult("dcp", "", tensors, values, nbytes, files)


def write_torch(state: Dict[str, Any], dst: str) -> ConvertResult:
    result = ConvertResult("torch", "", files=[os.path.basename(dst)])

    def materialize(v: Any) -> Any:
        if isinstance(v, Lazy):
            t = v.load()
            result.tensors += 1
            result.nbytes += t.numel() * t.element_size()
            return t
        if isinstance(v, dict):
            return {k: materialize(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(materialize(x) for x in v)
        return v
    full = materialize(state)
    tmp = dst + ".tmp"
    torch.save(full, tmp)
    os.replace(tmp, dst)
    return result


def _accelerate_siblings(src: str, dst: str) -> List[str]:
    """The files Accelerate wrote itself beside attach's folder (RNG states, schedulers, registered
    objects), copied so the converted folder is a whole save_state folder."""
    import shutil
    src = src.rstrip("/")
    if "://" in src or os.path.basename(src) != ACCELERATE_SUBDIR:
        return []
    parent, copied = os.path.dirname(src), []
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if name != ACCELERATE_SUBDIR and os.path.isfile(path):
            shutil.copy2(path, os.path.join(dst, name))
            copied.append(name)
    return copied


def convert(store: Storage, md: Metadata, dst: str, *, to: str, layout: str = "plain", threads: int = 4,
            allow_pickle: bool = False, overwrite: bool = False,
            progress: Optional[Callable[[int, int], None]] = None, comm: Optional[Comm] = None) -> ConvertResult:
    """Write the checkpoint (`store`, `md`) to the local path `dst` as `to` ("dcp": a directory,
    "torch": one file), keyed as `layout` writes it. With `comm` (a process group, e.g. under
    torchrun) every rank converts its share of a DCP output, into the same directory."""
    if to not in TARGETS:
        raise CheckpointError(f"convert: --to must be one of {TARGETS}, got {to!r} (safetensors: bytecheckpoint "
                              f"export)")
    if layout not in LAYOUTS:
        raise CheckpointError(f"convert: --layout must be one of {LAYOUTS}, got {layout!r}")
    if "://" in dst:
        raise CheckpointError(f"convert: the output must be a local path, got {dst!r}")
    if layout == "accelerate" and to != "dcp":
        raise CheckpointError("convert --layout accelerate writes Accelerate's FSDP sharded folders: use --to dcp")
    comm = comm if comm is not None else Comm(LOCAL)

    def prepare() -> None:
        if os.path.exists(dst) and not overwrite and (to == "torch" or os.listdir(dst)):
            raise CheckpointExistsError(f"convert: {dst!r} exists; pass --overwrite or another path")
        if to == "dcp":
            os.makedirs(dst, exist_ok=True)
            if os.path.exists(os.path.join(dst, ".metadata")):  # overwriting: never complete until the new one
                os.remove(os.path.join(dst, ".metadata"))
        else:
            os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    comm.run_on_coordinator(prepare, f"preparing {dst}")
    with Workers(threads) as workers:
        state = _LAYOUT_FNS[layout](saved_state(store, md, workers, allow_pickle))
        # a writer per core: each reads its batch and crc32s and writes it, mostly outside the GIL
        writers = max(1, min(threads, os.cpu_count() or 1))

        def read_many(keys):
            return read_full_tensors(store, workers, md, keys)
        if layout == "accelerate":
            result = ConvertResult("dcp", layout)
            for sub, part in state.items():
                comm.run_on_coordinator(lambda: os.makedirs(os.path.join(dst, sub), exist_ok=True), "preparing")
                done = write_dcp(part, os.path.join(dst, sub), progress, writers, read_many, comm)
                result.tensors, result.values = result.tensors + done.tensors, result.values + done.values
                result.nbytes += done.nbytes
                result.files += [f"{sub}/{f}" for f in done.files]
            result.files += comm.run_on_coordinator(lambda: _accelerate_siblings(store.url, dst), "copying")
        elif to == "dcp":
            result = write_dcp(state, dst, progress, writers, read_many, comm)
        else:  # one pickle of the whole dict: the coordinator writes it
            result = comm.run_on_coordinator(lambda: write_torch(state, dst), f"writing {dst}")
    result.layout = layout
    return result
