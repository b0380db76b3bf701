"""Accelerate + attach(): the prepared loaders keep one global order on any process count, so a
loop's own ``skip_first_batches(dl, completed_steps)`` (or Accelerate's stateful loader) resumes
step for step (issue 32; docs/data.md). Per sampler setting: a 2-process run (global batch 12 =
6 x 2, 96 samples, 2 epochs of 8 steps) saves at steps 3 and 11; resumed on 1 process from step 3
and on 3 from step 11, every later global step equals the uninterrupted run's, and the 2-process
run's steps are stock Accelerate's (computed here from its sampler's rules)."""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_accelerate import launch  # noqa: E402
from test_data_order_lightning import replayed_and_skipped  # noqa: E402

N, G = 96, 12


def _stock_steps(seedable):
    """Stock Accelerate on 2+ processes, set_seed(7), a Linear(1, 1) built before prepare: global
    step k of an epoch is positions [k*G, (k+1)*G) of one global order (BatchSamplerShard)."""
    from accelerate.data_loader import SeedableRandomSampler

    torch.manual_seed(7)
    torch.nn.Linear(1, 1)
    ds = range(N)
    if seedable:
        sampler = SeedableRandomSampler(ds, data_seed=7)
    else:  # prepare_data_loader seeds the sampler's generator with one draw from the global RNG
        g = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        sampler = torch.utils.data.RandomSampler(ds, generator=g)
    steps = {}
    for epoch in range(2):
        if seedable:
            sampler.set_epoch(epoch)
        order = list(sampler)
        steps.update({epoch * 8 + k: sorted(order[k * G:(k + 1) * G]) for k in range(8)})
    return steps


def _run(tmp_path, nproc, tag, *args):
    out = launch(nproc, "data_order.py", "--out", str(tmp_path), "--tag", tag, *args)
    got = json.loads((tmp_path / f"{tag}.json").read_text())
    return {int(k): v for k, v in got["seen"].items()}, got["report"], out


def _check_resumes(tmp_path, *flags):
    ref, report, _ = _run(tmp_path, 2, "ref", "--save-at", "3", "11", *flags)
    assert report is None
    for world, stop in ((1, 3), (3, 11)):
        got, report, _ = _run(tmp_path, world, f"r{world}", "--resume", str(tmp_path / f"ref_step_{stop}"),
                              "--resume-step", str(stop), *flags)
        assert sorted(got) == list(range(stop, 16))
        assert got == {k: ref[k] for k in got}, f"2 -> {world} from step {stop}: a later step differs"
        assert replayed_and_skipped(ref, got, stop, stop // 8) == (0, 0)
        assert report == [f"data order: exact (epoch {stop // 8}'s order restored, 2 -> {world} processes, global "
                          f"batch 12): skipping the completed steps continues step for step"], report
    return ref


@pytest.mark.parametrize("seedable", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["random_sampler", "seedable_sampler"])
def test_skip_first_batches_resumes_step_for_step(tmp_path, seedable):
    ref = _check_resumes(tmp_path, *(["--seedable"] if seedable else []))
    assert ref == _stock_steps(seedable), "2 processes: stock Accelerate's batches"


@pytest.mark.parametrize("seedable", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["random_sampler", "seedable_sampler"])
def test_stateful_dataloader_resumes_step_for_step(tmp_path, seedable):
    """use_stateful_dataloader: Accelerate's own per-process loader state fast-forwards the
    restored order (torchdata's StatefulDataLoader)."""
    pytest.importorskip("torchdata")
    from accelerate.data_loader import DataLoaderShard

    if "adjust_state_dict_for_prefetch" not in DataLoaderShard.__dict__:
        pytest.skip("this Accelerate saves its stateful loader's position num_processes - 1 batches behind under DDP "
                    "(accelerate#3938, fixed by #3952): its own resume replays them, with or without attach")
    _check_resumes(tmp_path, "--stateful", *(["--seedable"] if seedable else []))


def test_one_process_in_process(tmp_path):
    """Checkpoints without a data record still load (strict) and say so; data_order=False reads
    and drops a saved record; a changed global batch is named."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from accelerate_bytecheckpoint import attach

    def setup(batch, data_order=True):
        acc = Accelerator(cpu=True)
        model = torch.nn.Linear(1, 1)
        dl = DataLoader(TensorDataset(torch.arange(N)), batch_size=batch, shuffle=True)
        model, dl = acc.prepare(model, dl)
        return acc, dl, attach(acc, data_order=data_order)

    acc, dl, att = setup(12, data_order=False)
    acc.save_state(str(tmp_path / "plain"))
    att.remove()
    acc, dl, att = setup(12)
    acc.load_state(str(tmp_path / "plain"))
    assert att.data_order == ["data order: the checkpoint holds no data position (saved without attach's data "
                              "order); the loaders start their orders anew"]
    next(iter(dl))
    acc.save_state(str(tmp_path / "with"))
    att.remove()
    acc, dl, att = setup(12, data_order=False)
    acc.load_state(str(tmp_path / "with"))
    assert att.data_order is None
    att.remove()
    acc, dl, att = setup(24)
    acc.load_state(str(tmp_path / "with"))
    assert att.data_order[0].startswith("data order: not step for step: global batch 12 -> 24"), att.data_order
    att.remove()


def test_sampler_without_one_permutation_per_epoch_is_left_alone():
    """use_seedable_sampler=True over RandomSampler(num_samples=12) of 40 samples: Accelerate's
    SeedableRandomSampler yields 12 indices an epoch. The adapter must not adopt it (a global
    order is a whole permutation: it yielded all 40 before); the record says why."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from accelerate_bytecheckpoint import _data, attach

    def epoch(attached):
        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
        ds = TensorDataset(torch.arange(40))
        att = attach(acc) if attached else None
        dl = acc.prepare(DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, num_samples=12)))
        ids = [int(i) for (x,) in dl for i in x]
        record = _data.record(dl, acc.num_processes)
        if att is not None:
            att.remove()
        return ids, record

    stock, _ = epoch(False)
    ids, record = epoch(True)
    assert len(stock) == 12 and ids == stock, "the same epoch as stock Accelerate's"
    assert record == {"unsupported": "a SeedableRandomSampler with replacement or num_samples has no epoch order"}
