"""Accelerate's own checkpoint tests, as shipped and with `attach(accelerator)` injected.

    .venv/bin/python tests/frameworks/run_accelerate.py [--suite DIR] [--injected-only]
    make test-frameworks-accelerate

DIR (default ../shared/framework_suites/accelerate, next to the checkout) holds Accelerate's
tests/ (1.15) and inject.py, a pytest plugin that calls attach() on every Accelerator it creates.
Runs tests/test_state_checkpointing.py and tests/test_accelerator.py on CPU twice, without and with
the plugin, prints both counts and how many Accelerators were attached, and exits non-zero if a
test passes as shipped but fails injected (unless listed in BY_DESIGN below with the reason).
Fetches nothing: the test dependencies must already be installed (the message says how).
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
FILES = ("tests/test_state_checkpointing.py", "tests/test_accelerator.py")
NEEDED = ("parameterized", "torchdata", "pytest_timeout", "psutil")

#: test id -> why it differs with attach by design (none today).
BY_DESIGN: dict = {}


def run(suite: str, inject: bool) -> tuple:
    log = tempfile.NamedTemporaryFile(prefix="inject_", suffix=".log", delete=False).name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([suite, REPO]), ACCELERATE_USE_CPU="1", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", INJECT_LOG=log)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--timeout=180", *FILES]
    if inject:
        cmd[3:3] = ["-p", "inject"]
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
    p.add_argument("--suite", default=os.path.join(os.path.dirname(REPO), "shared", "framework_suites", "accelerate"))
    p.add_argument("--injected-only", action="store_true")
    args = p.parse_args()
    suite = os.path.abspath(args.suite)
    if not all(os.path.exists(os.path.join(suite, f)) for f in (*FILES, "inject.py")):
        print(f"no Accelerate suite at {suite} (tests/ and inject.py); pass --suite DIR (make ACCELERATE_SUITE=DIR)")
        return 2
    missing = [m for m in NEEDED if subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True).returncode]
    if missing:
        pkgs = " ".join(m.replace("_", "-") for m in missing)
        print(f"missing test dependencies {missing}; install them once (this target fetches nothing):\n"
              f"  {sys.executable} -m pip install {pkgs} torch==$({sys.executable} -c "
              "'import torch; print(torch.__version__.split(\"+\")[0])')")
        return 2
    results = {}
    for inject in ((True,) if args.injected_only else (False, True)):
        results[inject] = run(suite, inject)
        counts, failed, attached, out = results[inject]
        label = "with attach" if inject else "as shipped"
        print(f"{label:>12}: {counts}" + (f", {attached} Accelerators attached" if inject else ""), flush=True)
        for t in failed:
            print(f"    FAILED {t}" + (f"  (by design: {BY_DESIGN[t]})" if t in BY_DESIGN else ""))
    _, failed, attached, out = results[True]
    shipped_failed = set(results[False][1]) if False in results else set()
    regressions = [t for t in failed if t not in shipped_failed and t not in BY_DESIGN]
    if attached == 0:
        print("inject did not attach any Accelerator: the run proves nothing")
        return 1
    if regressions:
        print(out[-6000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
