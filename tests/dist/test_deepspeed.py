"""DeepSpeed ZeRO 1/2/3 engines saved from each rank's own partition (no all-gather) and resumed
on another process count and ZeRO stage, compared with DeepSpeed itself (tests/scenarios_deepspeed.py):
its full view of fp32 master weights and Adam moments at save time (bit-exact after every load),
the next step of the uninterrupted run and of a resume through its own save_checkpoint /
load_checkpoint (same world size). CPU, gloo, DS_ACCELERATOR=cpu."""
import os

import pytest

pytest.importorskip("deepspeed")

from launcher import run_ranks  # noqa: E402

ENV = {"DS_ACCELERATOR": "cpu"}


def _save(tmp_path, stage, world=2, bf16=False, with_ds=False):
    path, oracle = str(tmp_path / f"bcp{stage}"), str(tmp_path / f"oracle{stage}.pt")
    ds_dir = str(tmp_path / f"ds{stage}") if with_ds else ""
    run_ranks("scenarios_deepspeed:save", world, {"path": path, "stage": stage, "oracle": oracle, "bf16": bf16,
                                                  "ds_dir": ds_dir}, timeout=240, extra_env=ENV)
    return path, oracle, ds_dir


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])  # ZeRO-2: the next tests too
def test_same_world_resume_matches_deepspeeds_own(tmp_path, stage):
    path, oracle, ds_dir = _save(tmp_path, stage, with_ds=True)
    outs = run_ranks("scenarios_deepspeed:load", 2, {"path": path, "stage": stage, "oracle": oracle,
                                                     "next_step": True, "ds_dir": ds_dir}, timeout=240, extra_env=ENV)
    assert all("LOADED" in o for o in outs)
    files = [f for d, _, fs in os.walk(path) for f in fs if os.sep + "stats" not in d]  # stats/: records
    assert len(files) <= 2 * 2 + 1, files   # a pack and a values file per rank, and metadata.json


def _zero2_saved_on_2_resumes(tmp_path, legs):
    path, oracle, _ = _save(tmp_path, 2)
    for world, stage in legs:
        outs = run_ranks("scenarios_deepspeed:load", world, {"path": path, "stage": stage, "oracle": oracle},
                         timeout=240, extra_env=ENV)
        assert all("LOADED" in o for o in outs), (world, stage)


@pytest.mark.timeout(900)
def test_zero2_saved_on_2_resumes_on_1_and_as_zero3_on_3(tmp_path):
    _zero2_saved_on_2_resumes(tmp_path, ((1, 2), (3, 3)))


@pytest.mark.slow  # make test: the legs above; ZeRO-1 on 1 from ZeRO-3 below
@pytest.mark.timeout(900)
def test_zero2_saved_on_2_resumes_as_zero2_on_3_and_zero1_on_1(tmp_path):
    _zero2_saved_on_2_resumes(tmp_path, ((3, 2), (1, 1)))


@pytest.mark.timeout(600)
def test_zero3_saved_on_2_resumes_as_zero1_on_1_and_reads_without_deepspeed(tmp_path):
    path, oracle, _ = _save(tmp_path, 3)
    run_ranks("scenarios_deepspeed:load", 1, {"path": path, "stage": 1, "oracle": oracle}, timeout=240,
              extra_env=ENV)
    outs = run_ranks("scenarios_deepspeed:load_into_plain_model", 1, {"path": path, "oracle": oracle}, timeout=120)
    assert "PLAIN OK" in outs[0]


@pytest.mark.slow  # bf16 ZeRO-2 in make test: test_deepspeed_stock's zero2-bf16 engine
@pytest.mark.timeout(600)
def test_bf16_zero2_resumes_on_3(tmp_path):
    path, oracle, _ = _save(tmp_path, 2, bf16=True)
    run_ranks("scenarios_deepspeed:load", 3, {"path": path, "stage": 2, "oracle": oracle, "bf16": True},
              timeout=240, extra_env=ENV)


@pytest.mark.timeout(600)
def test_resume_on_1_and_3_matches_ds_to_universal(tmp_path):
    """DeepSpeed's offline route to another world size (ds_to_universal + load_universal) and a
    bytecheckpoint load give the same engine on 1 and 3 processes, and the same next step."""
    import subprocess
    import sys
    path, oracle, ds_dir = _save(tmp_path, 2, with_ds=True)
    universal = tmp_path / "universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(ds_dir, "t"), "--output_folder", str(universal / "t"), "--inject_missing_state"],
                   check=True, capture_output=True, env=dict(os.environ, **ENV), timeout=240)
    (universal / "latest").write_text("t")
    for world in (1, 3):
        outs = run_ranks("scenarios_deepspeed:load_vs_universal", world, {"path": path, "stage": 2,
                                                                          "universal": str(universal)},
                         timeout=240, extra_env=ENV)
        assert all("UNIVERSAL MATCH" in o for o in outs), world
