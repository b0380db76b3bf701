"""`make demo` leaves the checkout clean: its results, picture and the example scripts' work
directories land under runs/ (gitignored), and the README's committed docs/demo.png changes only
through `make demo-picture`. Checked in a temporary git repository holding this checkout's
Makefile, .gitignore, examples/ and docs/demo.png, with the real Makefile targets and demo.py; only
the training itself (minutes) is replaced by a stand-in that writes what the example scripts write
into the --workdir demo.py gives them. A few seconds."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

# Runs demo.py's main with each framework's example replaced by a stand-in: what the example scripts
# write (their work directory wiped and filled: log, checkpoints, export, jobs.log), and results with
# the fields the demo's table and picture read.
DRIVER = r'''
import json, sys
from pathlib import Path
examples = Path(sys.argv[1]).resolve().parent
sys.path.insert(0, str(examples))
import demo

RESULT = {"checkpoint_io": "bytecheckpoint", "stall_s": [0.3, 0.2, 0.1], "killed_at": 3, "resumed_from": 2,
          "recovery_s": 9.0, "resume_s": 5.0, "load_s": 0.5, "eval_at_save": 0.4, "eval_after_resume": 0.4,
          "data_order": "data order: exact (epoch 0)", "first_loss": 1.4, "loss_before": 0.5, "loss_after": 0.4,
          "final": {"eval_loss": 0.4, "accuracy": 0.9, "step": 6}, "reloaded": {"loss": 0.4}}
LOG = [{"phase": p, "event": "loss", "step": s, "loss": 1.0 / s} for p, s in (("train", 1), ("train", 2), ("resume", 3))]


def stand_in(argv):
    work = Path(argv[argv.index("--workdir") + 1])
    work.mkdir(parents=True, exist_ok=True)
    (work / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LOG))
    (work / "jobs.log").write_text("...\n")
    for sub in ("checkpoints/step=2.ckpt/bytecheckpoint", "hf_export"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    (work / "hf_export" / "model.safetensors").write_bytes(b"0" * 64)
    return dict(RESULT, export_dir=str(work / "hf_export"))


for module, _, _ in demo.FRAMEWORKS.values():
    module.main = stand_in
sys.exit(demo.main(sys.argv[2:]))
'''


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _make(repo: Path, target: str, driver: Path) -> None:
    # PY runs the driver in front of examples/demo.py; -o: the venv stamp counts as made (no install)
    cmd = ["make", "-C", str(repo), "-o", ".venv/.installed", target, f"PY={sys.executable} {driver}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture
def copy(tmp_path):
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.skip("needs git and make")
    pytest.importorskip("matplotlib")
    repo = tmp_path / "checkout"
    for rel in ("Makefile", ".gitignore", "docs/demo.png", *(str(p.relative_to(REPO)) for p in (REPO / "examples").glob("*.py"))):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, repo / rel)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "copy")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    return repo, driver


def test_make_demo_leaves_the_checkout_clean_and_demo_picture_alone_redraws_the_readme_picture(copy):
    repo, driver = copy
    picture = (repo / "docs" / "demo.png").read_bytes()
    _make(repo, "demo", driver)
    assert _git(repo, "status", "--porcelain") == ""
    assert (repo / "docs" / "demo.png").read_bytes() == picture
    results = json.loads((repo / "runs" / "demo" / "results.json").read_text())
    assert set(results) >= {"lightning", "accelerate", "seconds"}
    assert (repo / "runs" / "demo" / "demo.png").stat().st_size > 10_000
    assert (repo / "runs" / "demo" / "lightning" / "hf_export" / "model.safetensors").exists()
    # the README's picture: only the explicit target redraws it, from the last demo's results
    _make(repo, "demo-picture", driver)
    assert _git(repo, "status", "--porcelain").split() == ["M", "docs/demo.png"]
    assert (repo / "docs" / "demo.png").read_bytes() != picture


def test_example_scripts_default_to_work_directories_under_runs():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import accelerate_finetune
        import demo
        import lightning_finetune
    finally:
        sys.path.remove(str(REPO / "examples"))
    for module in (lightning_finetune, accelerate_finetune):
        assert Path(module.parse_args([]).workdir).parts[0] == "runs"
    args = demo.parse_args([])
    assert Path(args.workdir) == REPO / "runs" / "demo" and args.plot is None   # -> runs/demo/demo.png
