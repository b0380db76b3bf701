#!/bin/bash
# Lightning's own checkpoint tests (../shared/framework_suites/lightning, tag 2.6.5) with
# ByteCheckpointIO injected into every Trainer, as ../shared/framework_suites/lightning/run.sh runs
# them, plus this project's by-design list (tests/frameworks/lightning_by_design.txt) and a longer
# per-test limit (ddp_spawn tests take 60-100 s on 2 loaded cores). Fetches nothing: the test-only
# packages come from `make install` (the [frameworks] extra). Exit 0 = all pass.
#   --shipped: the same tests without the plugin (the baseline counts).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
suite=${LIGHTNING_SUITE:-$root/../shared/framework_suites/lightning}
py=$root/.venv/bin/python
[[ -d $suite ]] || { echo "no suite at $suite"; exit 2; }
suite=$(cd "$suite" && pwd)   # absolute: the tests run from inside it
inject=(-p inject -p shim)
[[ ${1:-} == --shipped ]] && inject=()
des=()
for list in "$suite/by_design.txt" "$root/tests/frameworks/lightning_by_design.txt"; do
  while read -r t; do [[ -n $t && $t != "#"* ]] && des+=(--deselect "$t"); done < "$list"
done
cd "$suite/tests" || exit 2
out=$(PYTHONPATH="$suite/tests:$suite" OMP_NUM_THREADS=1 timeout 3000 "$py" -m pytest -q -p no:cacheprovider \
  "${inject[@]}" --timeout=300 -k "not gpu and not cuda and not tpu" "${des[@]}" \
  tests_pytorch/checkpointing --ignore=tests_pytorch/checkpointing/test_legacy_checkpoints.py \
  tests_pytorch/trainer/connectors/test_checkpoint_connector.py tests_pytorch/plugins/test_checkpoint_io_plugin.py \
  tests_pytorch/trainer/test_trainer.py tests_pytorch/models/test_restore.py 2>&1); code=$?
echo "$out" | grep -E "^(FAILED|ERROR) " | head -40
echo "$out" | tail -1
exit $code
