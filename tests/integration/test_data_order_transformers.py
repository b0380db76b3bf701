"""transformers.Trainer + attach(): the Trainer resumes in global units over Accelerate's seedable
sampler, step for step on any process count when the global batch is kept; the checkpoint now
records where the data stood, so a resume says so ("data order: exact") or, with a changed global
batch, names the samples the Trainer's step count trains twice or skips (a warning, or an error
with strict_data_order=True) instead of shifting silently (issue 32; docs/data.md)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_accelerate import launch  # noqa: E402
from test_data_order_lightning import _merged, replayed_and_skipped  # noqa: E402

SCRIPT = str(HERE / "transformers_scripts" / "data_ids.py")
N, G = 96, 12


def _run(tmp_path, nproc, tag, batch, *args):
    launch(nproc, SCRIPT, "--out", str(tmp_path), "--tag", tag, "--batch", str(batch), *args)
    return _merged(tmp_path, tag, nproc)  # the script writes the Lightning harness's per-rank files


def _stock_steps():
    from accelerate.data_loader import SeedableRandomSampler

    sampler, steps = SeedableRandomSampler(range(N), data_seed=7), {}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        steps.update({epoch * 8 + k: sorted(order[k * G:(k + 1) * G]) for k in range(8)})
    return steps


def test_global_batch_kept_resumes_step_for_step(tmp_path):
    ref, report = _run(tmp_path, 2, "ref", 6, "--save-steps", "3")
    assert ref == _stock_steps() and report is None
    for world, batch, stop in ((1, 12, 3), (3, 4, 12)):
        folder = str(tmp_path / "ref" / f"checkpoint-{stop}")
        got, report = _run(tmp_path, world, f"r{world}", batch, "--resume", folder)
        assert sorted(got) == list(range(stop, 16))
        assert got == {k: ref[k] for k in got}, f"2 -> {world}: a later step differs"
        assert replayed_and_skipped(ref, got, stop, stop // 8) == (0, 0)
        assert report == f"data order: exact (epoch {stop // 8}, {stop % 8 * G}/96 samples consumed, 2 -> {world} " \
                         f"processes)", report


def test_changed_global_batch_is_named(tmp_path):
    """In process, one device: saved with 12 per step at step 3 (36 samples of epoch 0); resumed
    with 6 per step the Trainer's 3 steps are 18 samples: 18 trained twice, said in one warning;
    strict_data_order=True raises before training."""
    sys.path.insert(0, str(HERE / "transformers_scripts"))
    import data_ids

    data_ids.run(str(tmp_path), "a", 12, save_steps=3, epochs=1)
    ckpt = str(tmp_path / "a" / "checkpoint-3")
    attachment = data_ids.run(str(tmp_path), "b", 6, resume=ckpt, epochs=1)
    assert attachment.data_order.startswith("data order: not exact: global batch 12 -> 6"), attachment.data_order
    assert "epoch 0, sample 18 where the checkpoint stood at epoch 0, sample 36: 18 samples trained twice" in \
        attachment.data_order
    with pytest.raises(ValueError, match="18 samples trained twice"):
        data_ids.run(str(tmp_path), "c", 6, resume=ckpt, epochs=1, strict=True)
    assert not data_ids.SEEN, "strict: nothing trained"
