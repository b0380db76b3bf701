"""Stock DeepSpeed ZeRO 1/2/3 checkpoint folders (engine.save_checkpoint on 2 gloo ranks) load
through bcp.load without DeepSpeed: onto one plain process and onto FSDP2 at 2 and 3 ranks,
bit-exact with DeepSpeed's own full view (fp32 master weights, Adam moments), with buffers,
hyper-parameters, step and client state (tests/scenarios_deepspeed_stock.py)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

import bytecheckpoint as bcp  # noqa: E402
from launcher import HERE, run_ranks  # noqa: E402

ENV = {"DS_ACCELERATOR": "cpu"}


def _save(tmp_path, stage, bf16=False):
    ds_dir, oracle = str(tmp_path / f"ds{stage}"), str(tmp_path / f"oracle{stage}.pt")
    run_ranks("scenarios_deepspeed_stock:stock_save", 2, {"ds_dir": ds_dir, "stage": stage, "oracle": oracle,
                                                          "bf16": bf16}, timeout=240, extra_env=ENV)
    return ds_dir, oracle


def _load_plain(path, oracle):
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import scenarios_deepspeed_stock as s; "
            f"s.plain_main({path!r}, {oracle!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **ENV))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "deepspeed -> plain ok" in out.stdout


# ZeRO-1 and ZeRO-2 folders (the same partitioned form) in make test:
# test_stock_zero2_folder_resumes_deepspeed_engines_of_other_sizes_and_stages
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_stock_zero_folder_loads_on_one_plain_process_and_fsdp2(tmp_path, stage):
    ds_dir, oracle = _save(tmp_path, stage)
    _load_plain(ds_dir, oracle)                                   # save_dir: `latest` names the tag
    _load_plain(os.path.join(ds_dir, "global_step2"), oracle)     # the tag folder itself
    if stage != 1:  # the reader is the same for 1 and 2; FSDP2 at another size once per layout
        outs = run_ranks("scenarios_deepspeed_stock:stock_load", 3, {"ds_dir": ds_dir, "oracle": oracle,
                                                                     "layout": "fsdp2"}, timeout=200, extra_env=ENV)
        assert all("deepspeed -> fsdp2 ok" in o for o in outs)
    info = bcp.inspect(ds_dir)
    assert info.info["format"] == "deepspeed" and info.info["zero_stage"] == stage and info.info["step"] == 2
    assert bcp.verify(ds_dir).ok
    # a client value of another class is only read by a real unpickle, which the caller must allow
    with pytest.raises(bcp.CheckpointError, match="argparse.Namespace.*allow_pickle=True"):
        bcp.load_full(ds_dir)
    assert bcp.load_full(ds_dir, allow_pickle=True)["args"].lr == 1
    # a flipped byte inside a partition: verify names the file (a load does not check DeepSpeed's data)
    tag = os.path.join(ds_dir, "global_step2")
    victim = os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    report = bcp.verify(ds_dir)
    assert not report.ok and any("zero_pp_rank_1" in p for p in report.problems), report.problems
    # a rank's optimizer states missing: incomplete, never loaded as if whole
    os.remove(victim)
    with pytest.raises(bcp.IncompleteCheckpointError, match="2 ranks but 1 optimizer-states"):
        bcp.load_full(ds_dir)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("legs", [pytest.param(((2, 2),), id="zero2-on-2"),
                                  pytest.param(((3, 3), (1, 1)), id="zero3-on-3-zero1-on-1", marks=pytest.mark.slow)])
def test_stock_zero2_folder_resumes_deepspeed_engines_of_other_sizes_and_stages(tmp_path, legs):
    """Into DeepSpeed itself: ZeRO-2 on 2 -> ZeRO-2 on 2 (next step equal to DeepSpeed's own resume),
    ZeRO-3 on 3 and ZeRO-1 on 1 (DeepSpeed's own loader needs the saved world size). make test: the
    first (the other sizes and stages of a stock folder: test_stock_folder_into_another_engine)."""
    ds_dir, oracle = _save(tmp_path, 2)
    for world, stage in legs:
        outs = run_ranks("scenarios_deepspeed_stock:stock_into_engine", world,
                         {"ds_dir": ds_dir, "oracle": oracle, "stage": stage}, timeout=240, extra_env=ENV)
        assert all("INTO ENGINE ok" in o for o in outs), (world, stage)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("saved, into, bf16", [(3, (1, 2), False), (2, (3, 2), True)], ids=["zero3-fp32", "zero2-bf16"])
def test_stock_folder_into_another_engine(tmp_path, saved, into, bf16):
    """ZeRO-3 on 2 -> ZeRO-2 on 1; bf16 ZeRO-2 on 2 -> ZeRO-2 on 3 (the bf16 weights from the folder)."""
    ds_dir, oracle = _save(tmp_path, saved, bf16)
    outs = run_ranks("scenarios_deepspeed_stock:stock_into_engine", into[0],
                     {"ds_dir": ds_dir, "oracle": oracle, "stage": into[1], "bf16": bf16}, timeout=240, extra_env=ENV)
    assert all("INTO ENGINE ok" in o for o in outs)
