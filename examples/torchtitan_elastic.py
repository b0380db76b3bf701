"""torchtitan's Trainer with ByteCheckpointManager under torchrun's elastic agent: a node is lost and the
survivor resumes at a smaller data-parallel degree with the global batch kept.

    python examples/torchtitan_elastic.py [--workdir DIR]      (pip install -e '.[torchtitan]')

What a user changes in a torchtitan config is one line (docs/torchtitan.md):

    from torchtitan_bytecheckpoint import ByteCheckpointManager
    config.checkpoint = ByteCheckpointManager.Config(interval=2, async_mode="async", ...)

and every node runs the same `torchrun --nnodes=1:2 --nproc-per-node=... --rdzv-backend=c10d
--max-restarts=3 <train script>`. Here two torchrun agents on this machine are the two nodes (one CPU
process each, gloo), training torchtitan's llama3 debug model at FSDP 2 with a global batch of 4. Before
step 5 the node of rank 0 is SIGKILLed; torchrun restarts the survivor on a world of 1, torchtitan's
Trainer loads step 4 through the manager (no conversion, no flag) and trains steps 5-6 in 2 gradient-
accumulation micro-batches on the same samples the uninterrupted run trains on. Printed: each step's
loss beside the uninterrupted run's, and the time from the loss of the node to the first step.

CPU only: torchtitan 0.3 assumes a GPU, so this runs it through the test shims of
tests/torchtitan/shims.py (each names the line it works around; a GPU run needs none of them).
The same scenario is the test tests/torchtitan/test_torchtitan_elastic.py (make test-torchtitan).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "torchtitan"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=None, help="where the runs write (default: a temporary folder)")
    args = p.parse_args()
    import elastic_run
    from elastic_harness import after, of

    workdir = args.workdir or tempfile.mkdtemp(prefix="bcp_torchtitan_elastic_")
    print(f"== torchtitan llama3 debug model, 2 nodes under torchrun, node of rank 0 lost before step 5 ({workdir})")
    out = elastic_run.lose_a_node(workdir, steps=6, kill_before=5)
    events, full = out["events"], out["full"]
    resumed = of(after(events, out["t_kill"]), "resumed", world=1)
    print(f"resumed on 1 process from step {resumed[0]['step'] if resumed else '?'}")
    print(f"{'step':>4}  {'world':>5}  {'micro-batches':>13}  {'loss':>9}  {'uninterrupted':>13}  same samples")
    for e in sorted(of(events, "step"), key=lambda e: (e["step"], e["t"])):
        if e["world"] == 2 and e["rank"] != 0:
            continue
        ref = full[0]["losses"][e["step"]]
        rows = full[0]["batches"][e["step"]] + (full[1]["batches"][e["step"]] if e["world"] == 1 else [])
        print(f"{e['step']:>4}  {e['world']:>5}  {e['accumulation']:>13}  {e['loss']:>9.5f}  {ref:>13.5f}  "
              f"{'yes' if e['batches'] == rows else 'NO'}")
    print(f"node lost -> first step on 1 process: {out['node_lost_to_first_step_s']:.1f} s")


if __name__ == "__main__":
    main()
