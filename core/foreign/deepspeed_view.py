"""A DeepSpeed folder (deepspeed.py) seen in the form our DeepSpeed engine handler saves
(core/state/deepspeed_engine.py), so `bcp.load(folder, {"engine": engine})` restores a DeepSpeed
engine of any world size and ZeRO stage from DeepSpeed's own checkpoint. Pure: renames the
plain view's tensors (their regions unchanged) and values under the template's engine key:

    <key>/<name>/fp32 | exp_avg | exp_avg_sq | step    model/<name>, optimizer/state/<name>/...
    <key>/<name>/lp                                     the bf16/fp16 weights (ZeRO-1/2 folders)
    <key>/__module__/<name>                             buffers, frozen parameters
    <key>/__param_groups__, <key>/__engine__            hyper-parameters per group, counters
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Mapping

from ..format.metadata import Metadata
from .dcp import structure
from .deepspeed import DeepSpeedObjects

_ENGINE_CLASS = "DeepSpeedEngine"


def engine_keys(state: Mapping[str, Any]):
    """The template's top-level keys holding a DeepSpeed engine."""
    return [k for k, v in state.items() if any(c.__name__ == _ENGINE_CLASS for c in type(v).__mro__)]


def fit(md: Metadata, state: Any) -> Metadata:
    """The DeepSpeed folder `md` in the form `state` asks for: the engine form when `state` holds
    a DeepSpeed engine at a top-level key, else unchanged."""
    objects = md.foreign
    if not isinstance(objects, DeepSpeedObjects) or objects.engine is None or not isinstance(state, Mapping):
        return md
    keys = engine_keys(state)
    return engine_view(md, keys[0]) if len(keys) == 1 else md


def engine_view(md: Metadata, key: str) -> Metadata:
    objects: DeepSpeedObjects = md.foreign
    parts = objects.engine
    tensors, paths = {}, {}

    def put(new: str, meta) -> None:
        tensors[new] = replace(meta, key=new)
        paths[new] = (key,) + tuple(new[len(key) + 1:].split("/"))
    for name in parts.params:
        put(f"{key}/{name}/fp32", md.tensors[f"model/{name}"])
        prefix = f"optimizer/state/{name}/"
        for k in [k for k in md.tensors if k.startswith(prefix)]:
            put(f"{key}/{name}/{k[len(prefix):]}", md.tensors[k])
        if name in parts.lp:
            put(f"{key}/{name}/lp", parts.lp[name])
    for name in parts.module_names:
        put(f"{key}/__module__/{name}", md.tensors[f"model/{name}"])
    values: Dict[str, Any] = {k: v for k, v in objects.values.items()
                              if not k.startswith("optimizer/") and k != "deepspeed"}
    counters = objects.values["deepspeed"]
    values[f"{key}/__param_groups__"] = parts.groups
    values[f"{key}/__engine__"] = {k: counters.get(k) for k in ("global_steps", "global_samples", "skipped_steps")}
    values["deepspeed"] = counters
    for k in values:
        paths[k] = (key, k[len(key) + 1:]) if k.startswith(f"{key}/") else (k,)
    view = DeepSpeedObjects(values, objects.model_file, None)
    tree = structure(paths, set(tensors))
    if not parts.module_names:  # the engine form always has its module dict, empty or not
        from ..format import codec
        for k, node in tree["dict"]:
            if codec.decode(k) == key:
                node["dict"].append([codec.encode("__module__"), {"dict": []}])
    return replace(md, tensors=tensors, structure=tree, foreign=view)
