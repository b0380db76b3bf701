"""DeepSpeed ZeRO 1/2/3 checkpoint folders (`engine.save_checkpoint`) read as ours.

A folder holds one model-states file (ZeRO-3: one per rank) with the parameter names and shapes
(`param_shapes`), the buffers and the engine's counters, and one optimizer-states file per rank
with that rank's partition of the flat fp32 master weights and of the Adam moments. Every
parameter's elements are located in the partitions by DeepSpeed's own layout (the one its
`zero_to_fp32` uses: ZeRO-1/2 cut each group's flat vector into equal rank ranges, ZeRO-3 cut each
parameter), and each rank's run of a parameter becomes flat-range regions read in place from the
archive (torch_pickle locates every tensor's bytes; nothing is unpickled for real). So the one load
path reshards it onto any layout with zero-redundancy reads, as it does our own FlatShards.

The checkpoint reads as

    model/<name>                       fp32 master weights; buffers and frozen parameters as saved
    optimizer/state/<name>/<key>       exp_avg, exp_avg_sq, step (the optimizer's by-name form)
    optimizer/param_groups/<name>      the hyper-parameters of <name>'s group
    deepspeed                          {global_steps, global_samples, skipped_steps, zero_stage, ...,
                                        lr_scheduler: the engine's scheduler state, param_groups:
                                        the groups in DCP's name-keyed list form}
    <key>                              every client_state key given to save_checkpoint

so `bcp.load(folder, {"model": model, "optimizer": optimizer})` resumes a plain, DDP or FSDP2 model
(docs/switching.md). Its partitions carry no per-parameter checksum: a load does not check them,
`verify` checks every record's crc32. Not read (refused by name): model/tensor or pipeline
parallel folders (mp_rank_01, layer_*), ZeRO-3 frozen parameters, elastic ZeRO-1/2 optimizer
states, optimizer states that are not flat per group.
"""
from __future__ import annotations

import io
import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..common import dtypes
from ..common.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ..format.metadata import Metadata
from ..format.records import ArrayMeta, RegionMeta, TensorMeta
from ..geometry.regions import flat_range_to_boxes
from ..storage import Storage
from ..storage.chunks import chunk_name
from . import torch_pickle, torch_zip
from .dcp import READ_THREADS, structure

LATEST = "latest"
_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_LAYER = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
# model-states keys DeepSpeed writes itself; every other key is the caller's client_state
_ENGINE_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info"}
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size", "ds_version",
             "ds_config", "lr_scheduler", "data_sampler")


def tag_folder(store: Storage, keys: Sequence[str]) -> Optional[str]:
    """The prefix of the DeepSpeed tag folder at `store` ("" for the tag folder itself, "<tag>/"
    for a save_dir whose `latest` names it), None when it is not a DeepSpeed checkpoint."""
    if any(_MODEL.match(k) or _OPTIM.match(k) for k in keys):
        return ""
    if LATEST not in keys:
        return None
    raw = store.get(LATEST)
    tag = raw.decode("utf-8", "replace").strip() if raw else ""
    if not tag or not any(k.startswith(tag + "/") and _MODEL.match(k[len(tag) + 1:]) for k in keys):
        if any(_MODEL.match(k.rsplit("/", 1)[-1]) for k in keys):
            raise IncompleteCheckpointError(f"{store.url!r}: its DeepSpeed `latest` names tag {tag!r}, which holds no "
                                            f"model states; the save did not finish or the folder was changed")
        return None
    return tag + "/"


# ---------------------------------------------------------------- reading the archives' values

class _Parsed:
    def __init__(self, key: str, value: Any):
        self.key, self.value = key, value


def _parse(store: Storage, keys: Sequence[str]) -> List[_Parsed]:
    def one(key: str) -> _Parsed:
        size = store.size(key)
        if size is None:
            raise IncompleteCheckpointError(f"{store.where(key)} is missing")
        tail_at = max(0, size - torch_zip.TAIL_BYTES * 8)

        def fetch(a: int, b: int) -> bytes:
            got = store.read_range(key, a, b).result()
            return got.numpy().tobytes() if isinstance(got, torch.Tensor) else bytes(got or b"")
        blob = torch_zip.Blob(size, {tail_at: fetch(tail_at, size)}, fetch, store.where(key))
        return _Parsed(key, torch_pickle.load(blob))
    with ThreadPoolExecutor(READ_THREADS) as pool:
        return list(pool.map(one, keys))


def _field(parsed: _Parsed, value: Any, name: str) -> Any:
    if not isinstance(value, dict) or name not in value:
        raise CheckpointError(f"{parsed.key}: no {name!r} in this DeepSpeed file; bytecheckpoint reads DeepSpeed "
                              f"0.10-0.19 ZeRO checkpoints (docs/switching.md)")
    return value[name]


def _stage(value: Any) -> int:
    if isinstance(value, torch_pickle.Opaque) and value.args:  # ZeroStageEnum(n)
        value = value.args[0]
    return int(value)


# ---------------------------------------------------------------- DeepSpeed's layout -> ours

class _Builder:
    """Tensors, their regions and arrays, one flat run at a time."""

    def __init__(self) -> None:
        self.files: Dict[str, int] = {}
        self.arrays: Dict[str, ArrayMeta] = {}
        self.regions: Dict[str, List[RegionMeta]] = {}
        self.tensors: Dict[str, Tuple[str, Tuple[int, ...], str]] = {}
        self.writers: Dict[str, set] = {}
        self.hyper: Dict[str, Any] = {}   # parameter name -> its group's hyper-parameters

    def tensor(self, key: str, dtype: torch.dtype, shape: Tuple[int, ...], layout: str) -> None:
        self.tensors.setdefault(key, (dtypes.name_of(dtype), tuple(int(n) for n in shape), layout))

    def run(self, key: str, file: str, rank: int, at: int, start: int, stop: int) -> None:
        """Elements [start, stop) of tensor `key` lie in `file` from byte `at` on, in order."""
        dtype, shape, _ = self.tensors[key]
        isz = dtypes.itemsize(dtype)
        index = self.files.setdefault(file, len(self.files))
        for offs, lens in flat_range_to_boxes(shape, start, stop):
            path = f"ds/{len(self.arrays)}"
            name = chunk_name((0,) * len(lens))
            self.arrays[path] = ArrayMeta(path, lens, lens, dtype, {}, 0, {name: (index, at & 0xFFFFFFFF, at >> 32)},
                                          (), unchecked=True)
            self.regions.setdefault(key, []).append(RegionMeta(offs, lens, path, (0,) * len(lens), rank))
            self.writers.setdefault(key, set()).add(rank)
            at += math.prod(lens) * isz

    def whole(self, key: str, ref: torch_pickle.TensorRef, file: str, layout: str = "replicated") -> None:
        self.tensor(key, ref.dtype, ref.shape, layout)
        self.run(key, file, 0, ref.start, 0, ref.numel)

    def alias(self, key: str, source: str) -> None:
        self.tensors[key] = self.tensors[source]
        self.regions[key] = self.regions.get(source, [])
        self.writers[key] = self.writers.get(source, set())

    def done(self) -> Tuple[Dict[str, TensorMeta], Dict[str, ArrayMeta], Tuple[str, ...]]:
        packs = tuple(self.files)
        arrays = {p: ArrayMeta(a.path, a.shape, a.chunks, a.dtype, {}, 0, a.locations, packs, unchecked=True)
                  for p, a in self.arrays.items()}
        tensors = {}
        for key, (dtype, shape, layout) in self.tensors.items():
            holders = max(len(self.writers.get(key, ())), 1)
            tensors[key] = TensorMeta(key, dtype, shape, layout, holders, tuple(self.regions.get(key, ())))
        return tensors, arrays, packs


def read_metadata(store: Storage) -> Optional[Metadata]:
    keys = store.list()
    prefix = tag_folder(store, keys)
    if prefix is None:
        return None
    names = [k[len(prefix):] for k in keys if k.startswith(prefix) and "/" not in k[len(prefix):]]
    where = store.url.rstrip("/") + ("/" + prefix.rstrip("/") if prefix else "")
    if any(_LAYER.match(n) for n in names) or any(m and int(m.group(2)) > 0 for m in map(_MODEL.match, names)):
        raise CheckpointError(f"{where!r} is a pipeline- or tensor-parallel DeepSpeed checkpoint (layer_* or "
                              f"mp_rank_01 files), which bytecheckpoint does not read yet; resume it with DeepSpeed at "
                              f"its layout, then save with bytecheckpoint")
    optim = sorted((n for n in names if _OPTIM.match(n)), key=lambda n: int(_OPTIM.match(n).group(1)))
    models = sorted((n for n in names if _MODEL.match(n)), key=lambda n: int(_MODEL.match(n).group(1) or 0))
    if not models:
        raise IncompleteCheckpointError(f"{where!r} holds DeepSpeed optimizer states but no model states file: the "
                                        f"save did not finish")
    if not optim:
        raise CheckpointError(f"{where!r} is a DeepSpeed checkpoint without ZeRO optimizer states (ZeRO stage 0, or "
                              f"saved without its optimizer), which bytecheckpoint does not read yet")
    parsed = _parse(store, [prefix + models[0]] + [prefix + n for n in optim])
    model, ranks = parsed[0], parsed[1:]
    osds = [_field(p, p.value, "optimizer_state_dict") for p in ranks]
    stage = _stage(_field(ranks[0], osds[0], "zero_stage"))
    count = _field(ranks[0], osds[0], "partition_count")
    world = max(count) if isinstance(count, (list, tuple)) else int(count)
    if world != len(ranks):
        raise IncompleteCheckpointError(
            f"{where!r}: DeepSpeed partitioned this checkpoint over {world} ranks but {len(ranks)} optimizer-states "
            f"files are there ({optim}); the save did not finish or files were removed")
    b = _Builder()
    groups = _params(b, model, ranks, osds, stage, world, where)
    params = [name for names in groups for name in names]   # trainable, each once (tied aliases are not)
    aliases = set(model.value.get("shared_params") or {})
    _buffers(b, model, stage, where)
    module_names = [k[len("model/"):] for k in b.tensors if k.startswith("model/") and k[6:] not in set(params)
                    and k[6:] not in aliases]
    _low_precision(b, model, params)
    tensors, arrays, packs = b.done()
    lp = {k[len("lp/"):]: tensors.pop(k) for k in [k for k in tensors if k.startswith("lp/")]}
    mv = model.value
    # the optimizer's groups as DCP's name-keyed form lists them (positions for a torch optimizer)
    by_names = [{**b.hyper[names[0]], "params": names} for names in groups if names]
    values = {"deepspeed": {**{k: mv.get(k) for k in _COUNTERS if k in mv}, "zero_stage": stage,
                            "param_groups": by_names}}
    values.update({k: v for k, v in mv.items() if isinstance(k, str) and k not in _ENGINE_KEYS})
    paths = {key: tuple(key.split("/", 3)) if key.startswith("optimizer/") else tuple(key.split("/", 1))
             for key in tensors}
    paths.update({key: (key,) for key in values})
    for name, group in b.hyper.items():
        paths[f"optimizer/param_groups/{name}"] = ("optimizer", "param_groups", name)
        values[f"optimizer/param_groups/{name}"] = group
    info = {"format": "deepspeed", "zero_stage": stage, "ds_version": mv.get("ds_version"),
            "step": mv.get("global_steps")}
    return Metadata(version=0, save_id=f"deepspeed:{prefix.rstrip('/') or where.rsplit('/', 1)[-1]}",
                    world_size=world, tensors=tensors, arrays=arrays, objects=(),
                    structure=structure(paths, set(tensors)), info=info, packs=packs,
                    foreign=DeepSpeedObjects(values, prefix + models[0],
                                             EngineParts(params, module_names, lp, _base_groups(osds[0], stage))))


def _params(b: _Builder, model: _Parsed, ranks: List[_Parsed], osds: List[Any], stage: int, world: int,
            where: str) -> List[List[str]]:
    shapes = _field(model, model.value, "param_shapes")
    shapes = shapes if isinstance(shapes, list) else [shapes]
    flat_key, base_key = ("single_partition_of_fp32_groups", "base_optimizer_state") if stage <= 2 else \
        ("fp32_flat_groups", "optimizer_state_dict")
    flats = [_field(p, o, flat_key) for p, o in zip(ranks, osds)]
    bases = [_field(p, o, base_key) for p, o in zip(ranks, osds)]
    if not all(isinstance(x, dict) and isinstance(x.get("state"), dict) for x in bases):
        raise CheckpointError(f"{where!r}: the DeepSpeed optimizer states are not one torch state dict per rank "
                              f"(elastic ZeRO checkpoints?), which bytecheckpoint does not read yet")
    nflat = len(flats[0])
    sizes = [[f.numel for f in fl] for fl in flats]
    if any(len(fl) != nflat for fl in flats):
        raise CorruptCheckpointError(f"{where!r}: the ranks hold different numbers of fp32 groups ({sizes})")
    paddings = osds[0].get("param_alignment_paddings") if stage <= 2 else None
    # each parameter: (name, shape, the flat group it lives in, runs [(rank, group, pos in group, start, stop)])
    placed: List[Tuple[str, Tuple[int, ...], int, List[Tuple[int, int, int, int, int]]]] = []
    if stage <= 2:
        if len(shapes) != nflat:
            raise CorruptCheckpointError(f"{where!r}: {len(shapes)} parameter groups but {nflat} fp32 partitions")
        for g, group in enumerate(shapes):
            # the group's flat vector is the ranks' partitions back to back (zero_to_fp32 concatenates
            # them; bf16 runs partition unevenly)
            bounds = [0]
            for r in range(world):
                bounds.append(bounds[-1] + sizes[r][g])
            off = 0
            for i, (name, shape) in enumerate(group.items()):
                n = math.prod(shape)
                runs = [(r, g, lo - bounds[r], lo - off, hi - off) for r in range(world)
                        for lo, hi in [(max(off, bounds[r]), min(off + n, bounds[r + 1]))] if lo < hi]
                placed.append((name, tuple(shape), g, runs))
                off += n + (paddings[g][i] if paddings else 0)
            if off > bounds[-1] or bounds[-1] - off >= 2 * world:
                raise CorruptCheckpointError(f"{where!r}: group {g}'s parameters take {off} elements, its partitions "
                                             f"{bounds[-1]}; the model states do not match the optimizer states")
    else:
        starts = [0]
        for n in sizes[0]:
            starts.append(starts[-1] + n)
        pos = 0
        for g, group in enumerate(shapes):
            for name, shape in group.items():
                n = math.prod(shape)
                per = -(-n // world)
                runs = []
                for r in range(world):
                    lo, hi = r * per, min(n, (r + 1) * per)
                    for grp, at, a, z in _split(starts, pos, lo, hi):
                        runs.append((r, grp, at, a, z))
                placed.append((name, tuple(shape), runs[0][1] if runs else 0, runs))
                pos += per
        if pos != starts[-1]:
            raise CorruptCheckpointError(f"{where!r}: the parameters take {pos} elements of each rank's partition, "
                                         f"which holds {starts[-1]}; the model states do not match the optimizer states")
    group_of = _hyper_groups(bases[0], shapes, nflat, stage, where)
    for name, shape, g, runs in placed:
        b.tensor(f"model/{name}", flats[0][g].dtype, shape, "flat")
        for r, grp, at, start, stop in runs:
            ref = flats[r][grp]
            b.run(f"model/{name}", ranks[r].key, r, ref.start + at * dtypes.itemsize(dtypes.name_of(ref.dtype)),
                  start, stop)
        state = bases[0]["state"].get(g, {})
        for k, v in state.items():
            key = f"optimizer/state/{name}/{k}"
            if isinstance(v, torch_pickle.TensorRef) and v.numel == sizes[0][g] and v.shape != ():
                b.tensor(key, v.dtype, shape, "flat")
                for r, grp, at, start, stop in runs:
                    ref = bases[r]["state"][grp][k]
                    b.run(key, ranks[r].key, r, ref.start + at * dtypes.itemsize(dtypes.name_of(ref.dtype)),
                          start, stop)
            elif isinstance(v, torch_pickle.TensorRef) and v.numel == 1:
                b.whole(key, v, ranks[0].key)
            else:
                raise CheckpointError(f"{where!r}: optimizer state {k!r} of group {g} is not one value per element "
                                      f"of the partition nor a scalar; bytecheckpoint does not read it yet")
        b.hyper[name] = group_of(g, name)
    for alias, source in (model.value.get("shared_params") or {}).items():
        if f"model/{source}" in b.tensors:
            b.alias(f"model/{alias}", f"model/{source}")
    return [list(group) for group in shapes]


def _split(starts: List[int], pos: int, lo: int, hi: int):
    """A rank's run [lo, hi) of a parameter at `pos` of its concatenated flat groups, cut at group
    boundaries: (group, position in group, start, stop)."""
    at = pos
    while lo < hi:
        g = max(i for i in range(len(starts) - 1) if starts[i] <= at) if at < starts[-1] else -1
        if g < 0:
            raise CorruptCheckpointError(f"a parameter's partition reaches past its rank's fp32 groups")
        take = min(hi - lo, starts[g + 1] - at)
        yield g, at - starts[g], lo, lo + take
        lo, at = lo + take, at + take


def _hyper_groups(base: Dict[str, Any], shapes: List[Dict[str, Any]], nflat: int, stage: int, where: str):
    groups = base.get("param_groups") or []
    per_param_group = {name: i for i, group in enumerate(shapes) for name in group}

    def of(g: int, name: str) -> Dict[str, Any]:
        if len(groups) == nflat:
            group = groups[g]
        elif len(groups) == len(shapes):
            group = groups[per_param_group[name]]
        else:
            raise CheckpointError(f"{where!r}: {len(groups)} optimizer param groups for {len(shapes)} parameter "
                                  f"groups and {nflat} flat groups; bytecheckpoint cannot tell {name!r}'s")
        return {k: v for k, v in group.items() if k not in ("params", "param_names")}
    return of


def _buffers(b: _Builder, model: _Parsed, stage: int, where: str) -> None:
    module = model.value.get("module") or {}
    for name in model.value.get("buffer_names") or []:
        ref = module.get(name)
        if isinstance(ref, torch_pickle.TensorRef):
            b.whole(f"model/{name}", ref, model.key)
    frozen = model.value.get("frozen_param_shapes") or {}
    if frozen and stage >= 3:
        raise CheckpointError(f"{where!r}: a ZeRO-3 checkpoint with frozen parameters ({sorted(frozen)[:3]}...), "
                              f"which bytecheckpoint does not read yet")
    fragments = model.value.get("frozen_param_fragments") or {}
    for name in frozen:
        ref = fragments.get(name, module.get(name))
        if not isinstance(ref, torch_pickle.TensorRef):
            raise CorruptCheckpointError(f"{where!r}: frozen parameter {name!r} is not in the model states")
        b.whole(f"model/{name}", ref, model.key)


def _low_precision(b: _Builder, model: _Parsed, params: List[str]) -> None:
    """ZeRO-1/2 model states hold every parameter's bf16/fp16 weights whole: kept aside (`lp/<name>`)
    for a DeepSpeed engine's own low-precision copy (deepspeed_view.py)."""
    module = model.value.get("module") or {}
    for name in params:
        ref = module.get(name)
        if isinstance(ref, torch_pickle.TensorRef) and ref.dtype != torch.float32 and \
                ref.shape == b.tensors[f"model/{name}"][1]:
            b.whole(f"lp/{name}", ref, model.key)


def _base_groups(osd: Dict[str, Any], stage: int) -> List[Dict[str, Any]]:
    base = osd.get("base_optimizer_state" if stage <= 2 else "optimizer_state_dict") or {}
    return [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in base.get("param_groups") or []]


class EngineParts:
    """What a DeepSpeed engine's own state form needs beyond the plain view (deepspeed_view.py)."""

    def __init__(self, params: List[str], module_names: List[str], lp: Dict[str, TensorMeta],
                 groups: List[Dict[str, Any]]):
        self.params, self.module_names, self.lp, self.groups = params, module_names, lp, groups


# ---------------------------------------------------------------- plain values

class DeepSpeedObjects:
    """The plain values of a DeepSpeed folder (Metadata.foreign): parsed with the metadata; a
    value holding tensors reads their bytes; one holding objects of other classes needs
    allow_pickle=True (then the model-states file is unpickled for real)."""

    def __init__(self, values: Dict[str, Any], model_file: str, engine: Optional[EngineParts] = None):
        self.values, self.model_file, self.engine = values, model_file, engine
        self.where = dict.fromkeys(values, model_file)

    def read(self, store: Storage, keys: Sequence[str], allow_pickle: bool) -> Dict[str, Any]:
        out, full = {}, None
        for key in keys:
            if key not in self.values:
                continue
            value = self.values[key]
            opaque = [v for v in torch_pickle.walk(value) if isinstance(v, torch_pickle.Opaque)]
            if opaque and not allow_pickle:
                raise CheckpointError(f"{store.where(self.model_file)}: value {key!r} of this DeepSpeed checkpoint "
                                      f"holds a {opaque[0].name} object, which is only read by unpickling the file. If "
                                      f"you trust the checkpoint, load with allow_pickle=True")
            if opaque:
                if full is None:
                    full = torch.load(io.BytesIO(store.get(self.model_file)), map_location="cpu", weights_only=False)
                out[key] = _from_full(full, key, value)
            else:
                out[key] = _materialize(store, self.model_file, value)
        return out

    def problems(self, store: Storage) -> List[str]:
        """verify: every archive of the folder is whole (each record's crc32)."""
        import zipfile
        out = []
        for file in sorted(set(self._files(store))):
            try:
                bad = zipfile.ZipFile(io.BytesIO(store.get(file) or b"")).testzip()
                if bad is not None:
                    out.append(f"{file}: record {bad} fails its crc32")
            except zipfile.BadZipFile as exc:
                out.append(f"{file}: {exc}")
        return out

    def _files(self, store: Storage) -> List[str]:
        folder = self.model_file.rsplit("/", 1)[0] + "/" if "/" in self.model_file else ""
        return [k for k in store.list(folder) if "/" not in k[len(folder):] and
                (_MODEL.match(k[len(folder):]) or _OPTIM.match(k[len(folder):]))]


def _from_full(full: Dict[str, Any], key: str, parsed: Any) -> Any:
    if key == "deepspeed":  # the parsed dict, its counters (the scheduler's state) unpickled for real
        return {**parsed, **{k: full[k] for k in _COUNTERS if k in full}}
    if key.startswith("optimizer/param_groups/"):
        raise CheckpointError(f"{key}: hyper-parameters holding objects of other classes are not read")
    return full[key]


def _materialize(store: Storage, file: str, value: Any) -> Any:
    if isinstance(value, torch_pickle.TensorRef):
        got = store.read_range(file, value.start, value.start + value.nbytes).result()
        raw = got.numpy().tobytes() if isinstance(got, torch.Tensor) else bytes(got)
        return torch.frombuffer(bytearray(raw), dtype=value.dtype).reshape(value.shape).clone() if raw else \
            torch.empty(value.shape, dtype=value.dtype)
    if isinstance(value, dict):
        return {k: _materialize(store, file, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_materialize(store, file, v) for v in value]
    if type(value) is tuple:
        return tuple(_materialize(store, file, v) for v in value)
    return value
