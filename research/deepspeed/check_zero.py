"""torchrun --standalone --nproc_per_node 2 check_zero.py STAGE [bf16] [persist0]

Trains 2 steps, builds flat_state, reassembles it across ranks, compares bit-exactly with
deepspeed.utils.safe_get_full_*; then loads the full values into a fresh engine's zeroed views,
after_load, and checks the values and one more step against the original engine.
Also: the same without after_load (to show whether it is needed).
"""
import sys
import time

import common as C
import ds_state
import torch

stage = int(sys.argv[1])
bf16 = "bf16" in sys.argv[2:]
persist = 0 if "persist0" in sys.argv[2:] else None
tag = ("pre0-" if "pre=0" in sys.argv else "") + f"stage{stage}{'-bf16' if bf16 else '-fp32'}{'-persist0' if persist == 0 else ''}"
t_init = C.init_dist()
C.log0(f"[{tag}] import torch {C.T_TORCH - C.T0:.2f}s, import deepspeed {C.T_DS - C.T_TORCH:.2f}s, "
       f"init_distributed {t_init:.2f}s")
fails = []


def check(cond, what):
    if not cond:
        fails.append(what)
        C.log("FAIL", what)


t = time.time()
A = C.make_engine(stage, bf16, seed=0, persist=persist)
C.log0(f"[{tag}] deepspeed.initialize {time.time() - t:.2f}s, optimizer {type(A.optimizer).__name__}, "
       f"zero_stage={ds_state.zero_stage(A)}")
for s in range(2):
    C.train_step(A, s, bf16)

stA = ds_state.flat_state(A)

# --- the views really are DeepSpeed's buffers (no copies)
opt = A.optimizer
kind = ds_state._ds_kind(opt)
bufs = set()
if kind == "z3":
    flats = list(opt.fp32_partitioned_groups_flat)
    bufs |= {t.untyped_storage().data_ptr() for t in opt.fp16_partitioned_groups_flat}
else:
    flats = [f for _, f in ds_state._ds_z12_groups(opt)]
    bufs |= {p.data.untyped_storage().data_ptr() for g, _ in ds_state._ds_z12_groups(opt) for p in g}
for f in flats:
    bufs.add(f.untyped_storage().data_ptr())
    for v in opt.optimizer.state[f].values():
        bufs.add(v.untyped_storage().data_ptr())
from ds_state import FlatShard  # noqa: E402
for key, v in ds_state.iter_shards(stA):
    t = v.local if isinstance(v, FlatShard) else v
    if t.numel():
        check(t.untyped_storage().data_ptr() in bufs, f"{key} is not a view of a DeepSpeed buffer")
if kind == "z3":  # cross-check our offsets against DeepSpeed's private grad_position
    for params, flat, _ in ds_state._ds_z3_subgroups(opt):
        off = 0
        for p in params:
            gi, doff, n = opt.grad_position[opt.get_param_id(p)]
            check(doff == off and n == p.partition_numel(), f"z3 offset mismatch {p.ds_id}")
            off += p.partition_numel()
    check(all(p.ds_tensor.untyped_storage().data_ptr() in bufs for p in A.module.parameters()),
          "ds_tensor not a view of fp16_partitioned_groups_flat")

steps = {k: float(v) for k, v in ds_state.iter_shards(stA) if k.endswith(".step")}
C.log0(f"[{tag}] step values per param: {sorted(set(steps.values()))} "
       f"(dtype {next(v for k, v in ds_state.iter_shards(stA) if k.endswith('.step')).dtype}); "
       f"distinct step tensors: {len({id(v) for k, v in ds_state.iter_shards(stA) if k.endswith('.step')})}; "
       f"param_groups[0] keys: {sorted(stA[ds_state.PARAM_GROUPS_KEY][0])}")
if C.rank() == 0:
    for k, v in list(ds_state.iter_shards(stA))[:8]:
        if isinstance(v, FlatShard):
            print(f"   {k}: FlatShard(local {tuple(v.local.shape)} {v.local.dtype}, global {v.global_shape}, "
                  f"start {v.start})", flush=True)
        else:
            print(f"   {k}: tensor {tuple(v.shape)} {v.dtype}", flush=True)

fullA = C.gather_full(stA)
modA = C.full_module_params(A)
n_cmp = 0
for key in fullA:
    ref = C.safe_full(A, key)
    if ref is not None:
        check(C.same(ref.reshape(fullA[key].shape).cpu(), fullA[key]), f"A: {key} != safe_get_full")
        n_cmp += 1
    elif key.endswith(".lp"):
        check(C.same(modA[key[:-3]], fullA[key].reshape(modA[key[:-3]].shape)), f"A: {key} != module param")
        n_cmp += 1
C.log0(f"[{tag}] reassembled {len(fullA)} entries, compared {n_cmp} bit-exactly")


PRE = int(next((a[4:] for a in sys.argv if a.startswith("pre=")), "1"))


def restore(seed, do_after_load):
    B = C.make_engine(stage, bf16, seed=seed, persist=persist)
    for s in range(PRE):  # a used engine (state, gathered persistent params) is the harder case
        C.train_step(B, 7 + s, bf16)
    stB = ds_state.flat_state(B)
    C.zero_views(stB)
    C.load_into(stB, fullA)
    lp_ok_before = all(C.same(v, modA[k]) for k, v in C.full_module_params(B).items())
    if do_after_load:
        ds_state.after_load(B, {ds_state.PARAM_GROUPS_KEY: stA[ds_state.PARAM_GROUPS_KEY],
                                ds_state.ENGINE_KEY: stA[ds_state.ENGINE_KEY]})
    return B, lp_ok_before


B, lp_before = restore(1, True)
C.log0(f"[{tag}] module weights already right before after_load: {lp_before}")
for key in fullA:
    ref = C.safe_full(B, key)
    if ref is not None:
        check(C.same(ref.reshape(fullA[key].shape).cpu(), fullA[key]), f"B: {key} != saved")
fullB = C.gather_full(ds_state.flat_state(B))
for key in fullA:
    check(C.same(fullA[key], fullB[key]), f"B: reassembled {key} != saved")
for k, v in C.full_module_params(B).items():
    check(C.same(v, modA[k]), f"B: module param {k} != A after after_load")
check(B.global_steps == A.global_steps, "global_steps")

# --- one more step on both
lA = C.train_step(A, 2, bf16)
lB = C.train_step(B, 2, bf16)
check(lA == lB, f"loss after restore {lA} != {lB}")
fa2, fb2 = C.gather_full(ds_state.flat_state(A)), C.gather_full(ds_state.flat_state(B))
for key in fa2:
    check(C.same(fa2[key], fb2[key]), f"after step: {key} differs")
ma, mb = C.full_module_params(A), C.full_module_params(B)
for k in ma:
    check(C.same(ma[k], mb[k]), f"after step: module {k} differs")

# --- is after_load needed? restore without it and step
Cn, lp_before2 = restore(2, False)
lC = C.train_step(Cn, 2, bf16)  # A already did step 2: compare with its post-step state
fc = C.gather_full(ds_state.flat_state(Cn))
without = all(C.same(fa2[k], fc[k]) for k in fa2 if not k.endswith(".step")) and lC == lA
C.log0(f"[{tag}] without after_load the next step matches: {without} (loss {lC} vs {lA})")

import torch.distributed as tdist  # noqa: E402
allf = [None] * C.world()
tdist.all_gather_object(allf, fails)
if C.rank() == 0:
    bad = [f for fs in allf for f in fs]
    print(f"RESULT {tag}: {'PASS' if not bad else 'FAIL ' + str(bad[:10])} (after_load needed: {not without})",
          flush=True)
tdist.barrier()
