#!/usr/bin/env bash
# Issue 26's GPU checks in one call of the device tool (a lent H100/H200; its image has torch 2.11
# and every dependency, no network): the checkout imported as it is (no install), then the CUDA
# tests, bench_gpu and the frameworks on one GPU, each under a time limit. Logs under $OUT.
#   STEPS="tests bench frameworks unit" BENCH_ARGS="--sizes 2,8 --repeats 3 --sweep" bash benchmarks/gpu_session.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
site=$(mktemp -d)
ln -s "$PWD/core" "$site/bytecheckpoint"
export PYTHONPATH="$site:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, bytecheckpoint; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
df -h /tmp /dev/shm 2>/dev/null | tail -2
for step in ${STEPS:-tests bench frameworks}; do
  t0=$(date +%s)
  case $step in
    tests) timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_cuda.py 2>&1 \
             | tee "$OUT/gpu_tests.log" | tail -30 ;;
    bench) timeout ${BENCH_S:-280} python3 benchmarks/bench_gpu.py ${BENCH_ARGS:---sizes 2,8 --repeats 3 --sweep} \
             --json "$OUT/bench_gpu.json" > "$OUT/bench_gpu.log" 2>&1
           grep -v "^FIGURE" "$OUT/bench_gpu.log" | tail -25
           grep "^FIGURE" "$OUT/bench_gpu.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line[7:])
    print(f\"{r['figure'][:70]:70s} bcp {r['bcp']:.4f} peer {r['peer']:.4f} ratio {r['ratio']} target {r['target']}\")" ;;
    frameworks) timeout ${FRAMEWORKS_S:-200} python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_frameworks_cuda.py \
             2>&1 | tee "$OUT/gpu_frameworks.log" | tail -15 ;;
    diag) [ -f diag_order.py ] && timeout 60 python3 diag_order.py ;;
    unit) timeout ${UNIT_S:-150} python3 -m pytest -q -p no:cacheprovider -x tests/unit 2>&1 | tail -6 ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s"
done
