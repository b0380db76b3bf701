"""transformers' own checkpoint tests, as shipped and with `transformers_bytecheckpoint.attach`
injected into every Trainer.

    .venv/bin/python tests/frameworks/run_transformers.py [--suite DIR] [--injected-only] [--sync]
                                                          [--metrics both|on|off]
    make test-frameworks-transformers

DIR holds transformers' tests/trainer/test_trainer_checkpointing.py, test_trainer_resume.py and
trainer_test_utils.py (with empty tests/__init__.py and tests/trainer/__init__.py, as upstream);
default: $TRANSFORMERS_SUITE, else ../shared/framework_suites/transformers, else
tests/frameworks/transformers/upstream. Where they come from: tests/frameworks/transformers/ORIGIN.md.
The plugin tests/frameworks/transformers/inject.py attaches every Trainer (async saves; --sync:
synchronous); shim.py lets only the suite's own reads of a checkpoint folder's stock files read
what bytecheckpoint/ holds, as the Lightning suite's shim does. Every run is offline (HF_HUB_OFFLINE=1, CPU).
The injected suite runs twice (--metrics both, the default): with the adapter's checkpoint/... metrics
logged (its default) and with BCP_LOG_METRICS=0; each prints its counts. Exits non-zero if a test that
passes as shipped fails injected, unless BY_DESIGN below lists it with the reason (BY_DESIGN_METRICS:
only in the run with metrics on), or if nothing was attached.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PLUGIN_DIR = os.path.join(HERE, "transformers")
FILES = ("tests/trainer/test_trainer_checkpointing.py", "tests/trainer/test_trainer_resume.py")
NEEDED = ("pytest_timeout",)

#: test id -> why it differs with attach, by design (none now). The injected run also loads shim.py,
#: which lets the suite's own os.path.isfile / exists / safetensors.torch.load_file of a checkpoint
#: folder's stock optimizer/scheduler/RNG files read what bytecheckpoint/ holds (without it 6 more
#: differ: test_save_checkpoints, test_save_best_checkpoint, test_load_best_model_with_save,
#: test_load_best_model_with_save_best, test_resume_batch_order, test_resume_from_interrupted_training).
#: The four tests listed here until issue 33 (test_resume_training_with_checkpoint,
#: test_resume_training_with_shard_checkpoint, test_load_best_model_at_end,
#: test_load_best_model_from_safetensors) pass since a checkpoint folder has its model.safetensors
#: (a hard link to the checkpoint's safetensors pack, transformers_bytecheckpoint/_views.py).
BY_DESIGN: dict = {}

#: test id -> why it differs with attach when the adapter logs its checkpoint/... metrics (on unless
#: BCP_LOG_METRICS=0): none. Until issue 41 the metrics went into `state.log_history` and five resume tests
#: (test_can_resume_training, test_resume_training_with_checkpoint, ..._with_shard_checkpoint,
#: ..._with_frozen_params, ..._with_gradient_accumulation), which compare log_history entry by entry, were
#: listed here; the metrics now go to the Trainer's callbacks only (report_to, console), not log_history.
BY_DESIGN_METRICS: dict = {}


def by_design_for(metrics: bool) -> dict:
    """The by-design differences of an injected run with the metrics logged or not."""
    return {**BY_DESIGN, **(BY_DESIGN_METRICS if metrics else {})}


def default_suite() -> str:
    for candidate in (os.environ.get("TRANSFORMERS_SUITE"),
                      os.path.join(os.path.dirname(REPO), "shared", "framework_suites", "transformers"),
                      os.path.join(PLUGIN_DIR, "upstream")):
        if candidate and all(os.path.exists(os.path.join(candidate, f)) for f in FILES):
            return candidate
    return os.path.join(PLUGIN_DIR, "upstream")


def run(suite: str, inject: bool, sync: bool, metrics: bool = True) -> tuple:
    log = tempfile.NamedTemporaryFile(prefix="inject_", suffix=".log", delete=False).name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([suite, REPO, PLUGIN_DIR]), CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", INJECT_LOG=log, INJECT_ASYNC="0" if sync else "1",
               BCP_TRANSFORMERS_SUITE="1", BCP_LOG_METRICS="1" if metrics else "0")
    # -c /dev/null --rootdir=SUITE: the suite runs under its own (default) pytest settings, not the project's
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-c", os.devnull,
           f"--rootdir={suite}", "--timeout=300", *FILES]
    if inject:
        cmd[3:3] = ["-p", "inject", "-p", "shim"]
    proc = subprocess.run(cmd, cwd=suite, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1500)
    out = proc.stdout
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)))
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", out.splitlines()[-1])}
    with open(log) as f:
        attached = sum(1 for line in f if "] attached " in line)
    os.unlink(log)
    return counts, failed, attached, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default=None)
    p.add_argument("--injected-only", action="store_true")
    p.add_argument("--sync", action="store_true", help="inject attach(trainer, async_save=False)")
    p.add_argument("--metrics", choices=("both", "on", "off"), default="both",
                   help="the injected runs: with the checkpoint/... metrics logged (on), BCP_LOG_METRICS=0 (off), or both")
    args = p.parse_args()
    suite = os.path.abspath(args.suite or default_suite())
    if not all(os.path.exists(os.path.join(suite, f)) for f in FILES):
        print(f"no transformers suite at {suite} ({', '.join(FILES)} and trainer_test_utils.py); see "
              f"tests/frameworks/transformers/ORIGIN.md; pass --suite DIR (make TRANSFORMERS_SUITE=DIR)")
        return 2
    missing = [m for m in NEEDED if subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True).returncode]
    if missing:
        print(f"missing test dependencies {missing}: {sys.executable} -m pip install "
              f"{' '.join(m.replace('_', '-') for m in missing)} (this target fetches nothing)")
        return 2
    runs = [("as shipped", False, True)] if not args.injected_only else []
    runs += [("with attach" + (" (sync)" if args.sync else " (async)") + (", metrics on" if m else ", BCP_LOG_METRICS=0"),
              True, m) for m in {"both": (True, False), "on": (True,), "off": (False,)}[args.metrics]]
    results = {}
    for label, inject, metrics in runs:
        results[label] = counts, failed, attached, out = run(suite, inject, args.sync, metrics)
        by_design = by_design_for(metrics) if inject else {}
        print(f"{label:>36}: {counts}" + (f", {attached} Trainers attached" if inject else ""), flush=True)
        for t in failed:
            print(f"    FAILED {t}" + (f"  (by design: {by_design[t]})" if t in by_design else ""))
    shipped_failed = set(results["as shipped"][1]) if "as shipped" in results else set()
    code = 0
    for label, inject, metrics in runs:
        if not inject:
            continue
        _, failed, attached, out = results[label]
        by_design = by_design_for(metrics)
        regressions = [t for t in failed if t not in shipped_failed and t not in by_design]
        if args.injected_only:  # nothing to compare with: the failures above are listed, not judged
            print(f"({label}, --injected-only: {len([t for t in failed if t not in by_design])} failure(s) not by "
                  "design; run without it to compare with the shipped run)")
            regressions = []
        if attached == 0:
            print(f"{label}: inject did not attach any Trainer: the run proves nothing")
            code = 1
        if regressions:
            print(f"{label}: regressions (pass as shipped, fail with attach):\n  " + "\n  ".join(regressions))
            print(out[-6000:])
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
