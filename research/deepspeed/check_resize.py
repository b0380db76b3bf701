"""World-size change.

save:  torchrun --nproc_per_node 2 check_resize.py save OUT [STAGE(default 2)] [bf16]
       ZeRO-2, 2 steps; rank 0 writes OUT/full.pt (reassembled full tensors of flat_state),
       all ranks engine.save_checkpoint(OUT/ds, tag="step2") for ds_to_universal.
load:  torchrun --nproc_per_node N check_resize.py load OUT STAGE [bf16] [nouniv]
       X: fresh engine, load OUT/full.pt by slicing into flat_state views + after_load.
       Y: fresh engine, DeepSpeed's load_checkpoint(OUT/univ) with "load_universal": true.
       Checks X bit-exact vs full.pt (reassembled + safe_get_full_*), Y vs full.pt, then one step
       on X and Y with the same data and compares everything.
"""
import os
import sys
import time

import common as C
import ds_state
import torch
import torch.distributed as tdist

mode, out = sys.argv[1], sys.argv[2]
bf16 = "bf16" in sys.argv
C.init_dist()
fails = []


def check(cond, what):
    if not cond:
        fails.append(what)
        C.log("FAIL", what)


def finish(tag):
    allf = [None] * C.world()
    tdist.all_gather_object(allf, fails)
    if C.rank() == 0:
        bad = [f for fs in allf for f in fs]
        print(f"RESULT {tag}: {'PASS' if not bad else 'FAIL ' + str(bad[:8])}", flush=True)
    tdist.barrier()


if mode == "save":
    src_stage = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else 2
    A = C.make_engine(src_stage, bf16, seed=0)
    for s in range(2):
        C.train_step(A, s, bf16)
    stA = ds_state.flat_state(A)
    full = C.gather_full(stA)
    if C.rank() == 0:
        os.makedirs(out, exist_ok=True)
        torch.save({"full": full, "param_groups": stA[ds_state.PARAM_GROUPS_KEY],
                    "engine": stA[ds_state.ENGINE_KEY]}, os.path.join(out, "full.pt"))
    t = time.time()
    A.save_checkpoint(os.path.join(out, "ds"), tag="step2")
    C.log0(f"engine.save_checkpoint {time.time() - t:.2f}s")
    finish(f"save ws={C.world()}")
    sys.exit(0)

stage = int(sys.argv[3])
use_univ = "nouniv" not in sys.argv
tag = f"load ws={C.world()} stage{stage}{' bf16' if bf16 else ''}"
saved = torch.load(os.path.join(out, "full.pt"), weights_only=False)
full = saved["full"]

# ---- X: our path
X = C.make_engine(stage, bf16, seed=5)
C.train_step(X, 9, bf16)  # a used engine
t = time.time()
stX = ds_state.flat_state(X)
missing = set(k for k, _ in ds_state.iter_shards(stX)) ^ set(full)
check(not missing, f"key mismatch {sorted(missing)[:5]}")
C.load_into(stX, full)
ds_state.after_load(X, {ds_state.PARAM_GROUPS_KEY: saved["param_groups"], ds_state.ENGINE_KEY: saved["engine"]})
C.log0(f"[{tag}] X load+after_load {time.time() - t:.3f}s")
fx = C.gather_full(ds_state.flat_state(X))
for k in full:
    check(C.same(fx[k], full[k]), f"X reassembled {k} != saved")
    ref = C.safe_full(X, k)
    if ref is not None:
        check(C.same(ref.reshape(full[k].shape).cpu(), full[k]), f"X safe_get {k} != saved")
C.log0(f"[{tag}] X bit-exact vs saved: {not fails}")

# ---- Y: DeepSpeed universal checkpoint
Y = None
if use_univ:
    Y = C.make_engine(stage, bf16, seed=6, universal=True)
    t = time.time()
    try:
        path, _ = Y.load_checkpoint(os.path.join(out, "univ"))
        C.log0(f"[{tag}] Y load_checkpoint(universal) {time.time() - t:.2f}s -> {path}")
        fy = C.gather_full(ds_state.flat_state(Y))
        ydiff = [k for k in full if not C.same(fy[k], full[k])]
        C.log0(f"[{tag}] Y (universal) differs from saved in {len(ydiff)} entries: {ydiff[:6]}")
    except Exception as e:  # noqa: BLE001
        C.log0(f"[{tag}] universal load FAILED: {type(e).__name__}: {str(e)[:300]}")
        if C.rank() == 0:
            import traceback; traceback.print_exc()
        Y = None

# ---- one more step
lx = C.train_step(X, 2, bf16)
fx2 = C.gather_full(ds_state.flat_state(X))
if Y is not None:
    ly = C.train_step(Y, 2, bf16)
    fy2 = C.gather_full(ds_state.flat_state(Y))
    d = [k for k in fx2 if not C.same(fx2[k], fy2[k])]
    check(lx == ly, f"loss X {lx} != Y {ly}")
    check(not d, f"after step X != Y in {d[:6]}")
    mx, my = C.full_module_params(X), C.full_module_params(Y)
    check(all(C.same(mx[k], my[k]) for k in mx), "module params X != Y after step")
    C.log0(f"[{tag}] after one step X==Y: {not d and lx == ly} (loss {lx} / {ly})")
finish(tag)
