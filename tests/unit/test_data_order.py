"""bytecheckpoint.data: the world-size-independent data position (issue 32), ranks simulated in
one process. Sample ids per *global step* (every rank's batch of that step) are compared between
an uninterrupted run and a run saved on 2 processes and resumed on M."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import bytecheckpoint as bcp
from bytecheckpoint.data import (DataPosition, ElasticDataLoader, ElasticSampler, GeneratorOrder, SeededOrder,
                                 epoch_order, make_stateful, per_rank_len, rank_stream)


def ids(n):
    return TensorDataset(torch.arange(n))


@pytest.mark.parametrize("n", [96, 100, 23, 7, 1])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_same_world_is_distributed_sampler(n, world):
    """Without a loaded position the sampler is DistributedSampler, output and length."""
    for shuffle in (True, False):
        for drop_last in (False, True):
            for epoch in (0, 3):
                for rank in range(world):
                    kw = dict(num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
                    ref, ours = DistributedSampler(ids(n), **kw), ElasticSampler(ids(n), **kw)
                    ref.set_epoch(epoch)
                    ours.set_epoch(epoch)
                    assert list(ours) == list(ref)
                    assert len(ours) == len(ref) == per_rank_len(n, world, drop_last=drop_last)


def loaders(n, world, g, *, drop_last=False, drop_last_sampler=False, seed=7, **kw):
    assert g % world == 0
    return [ElasticDataLoader(ids(n), batch_size=g // world, shuffle=True, seed=seed, num_replicas=world, rank=r,
                              drop_last=drop_last, drop_last_sampler=drop_last_sampler, **kw) for r in range(world)]


def steps_of(dls, epoch, limit=None):
    """Global steps of one epoch (ranks in lockstep): each step = sorted ids of all ranks' batches."""
    for dl in dls:
        dl.set_epoch(epoch)
    out = []
    for batches in zip(*[iter(dl) for dl in dls]):
        out.append(sorted(int(i) for b in batches for i in b[0]))
        if len(out) == limit:
            break
    return out


def run(n, world, g, epochs=2, **kw):
    dls = loaders(n, world, g, **kw)
    return [steps_of(dls, e) for e in range(epochs)]


def resumed(n, g, load_world, stop_at, *, save_world=2, epochs=2, load_g=None, **kw):
    """Save on `save_world` after `stop_at` global steps (counted over the epochs); resume on `load_world`."""
    dls = loaders(n, save_world, g, **kw)
    done, e = [], 0
    while True:
        part = steps_of(dls, e, limit=stop_at - sum(len(x) for x in done))
        done.append(part)
        if sum(len(x) for x in done) == stop_at:
            break
        e += 1
    states = [dl.state_dict() for dl in dls]
    assert all(s == states[0] for s in states), "the record must not depend on the rank"
    new = loaders(n, load_world, load_g or g, **kw)
    for dl in new:
        dl.load_state_dict(states[0])   # every rank reads the same (rank 0's) record
    out = done[:-1] + [done[-1] + steps_of(new, new[0].epoch)]
    for epoch in range(new[0].epoch + 1, epochs):
        out.append(steps_of(new, epoch))
    return out, new[0].data_order


@pytest.mark.parametrize("load_world", [1, 3, 2, 4, 6])
@pytest.mark.parametrize("stop_at", [1, 3, 11])
def test_two_to_m_exact_per_global_step(load_world, stop_at):
    """Saved on 2 at global step 1, 3 (epoch 0) or 11 (epoch 1): every later step equals the
    uninterrupted 2-process run's, every epoch trains each sample once."""
    n, g = 96, 12
    got, verdict = resumed(n, g, load_world, stop_at)
    assert got == run(n, 2, g), f"2 -> {load_world}"
    assert verdict.exact and verdict.line.startswith("data order: exact")
    for epoch in got:
        c = collections.Counter(i for s in epoch for i in s)
        assert set(c) == set(range(n)) and set(c.values()) == {1}


@pytest.mark.parametrize("load_world", [1, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("drop_last_sampler", [False, True])
def test_partial_last_batch(load_world, drop_last, drop_last_sampler):
    """N=100, G=12: the 8 full steps equal the 2-process run's on every world; the rest of the
    epoch equals the uninterrupted M-process run's; the last step trains the order's last 4
    samples plus the new world's padding (drop_last=False), or is dropped."""
    n, g, stop = 100, 12, 3
    kw = dict(drop_last=drop_last, drop_last_sampler=drop_last_sampler)
    got, _ = resumed(n, g, load_world, stop, **kw)
    ref_two, ref_m = run(n, 2, g, **kw), run(n, load_world, g, **kw)
    for e in range(2):
        assert got[e][:8] == ref_two[e][:8], "every full step equals the 2-process run's"
        assert got[e][stop:] == ref_m[e][stop:], "the rest equals the uninterrupted M-process run's"
        if not drop_last and not drop_last_sampler:
            tail = set(i for s in got[e][8:] for i in s) - set(i for s in got[e][:8] for i in s)
            assert sorted(tail) == sorted(epoch_order(n, e, seed=7)[96:]), "last step: the same new samples"


def test_last_step_padding_depends_on_the_world():
    """Documented (docs/data.md): DataLoader(drop_last=True) with N mod G > G - W makes one more
    step on W processes, filled with W - 1 repeats of the epoch's first samples (N=23, G=12)."""
    assert [len(run(23, w, 12, epochs=1, drop_last=True)[0]) for w in (1, 2, 3, 4)] == [1, 2, 2, 2]


@pytest.mark.parametrize("load_world", [1, 2, 3])
def test_padded_extra_full_step_is_not_skipped(load_world):
    """N=23, G=12, DataLoader(drop_last=True): DistributedSampler's padding makes a second full
    step on 2 processes (11 new samples and a repeat). Saved after the first step, the epoch is not
    over: the resume trains the second step as the uninterrupted run on the new world does (it
    was taken for the epoch's end and skipped, 11 samples never trained, reported exact)."""
    n, g = 23, 12
    got, verdict = resumed(n, g, load_world, 1, drop_last=True)
    ref_two, ref_m = run(n, 2, g, drop_last=True), run(n, load_world, g, drop_last=True)
    assert got[0][:1] == ref_two[0][:1] and got[0][1:] == ref_m[0][1:] and got[1] == ref_m[1]
    assert verdict.exact and "epoch 0, 12/23 samples consumed" in verdict.line


def test_changed_global_batch_continues_by_sample_count():
    n = 96
    got, verdict = resumed(n, 12, 3, 3, load_g=9, epochs=1)  # 3 per process x 3 processes
    c = collections.Counter(i for s in got[0] for i in s)
    assert set(c) == set(range(n)) and set(c.values()) == {1}, "nothing skipped, nothing replayed"
    assert not verdict.exact and verdict.line.startswith("data order: continues by sample count")
    assert "global batch 12 -> 9" in verdict.line


def test_global_batch_the_new_world_cannot_keep_is_named():
    """Saved with 12 per step on 2; on 5 processes no per-process batch gives 12: the line says
    so (it told the user to keep 12 before), and the stream still continues by sample count."""
    n = 96
    got, verdict = resumed(n, 12, 5, 3, load_g=10, epochs=1)  # 2 per process x 5 processes
    c = collections.Counter(i for s in got[0] for i in s)
    assert set(c) == set(range(n)) and set(c.values()) == {1}, "nothing skipped, nothing replayed"
    assert "global batch 12 -> 10" in verdict.line
    assert "the saved global batch 12 is not divisible by 5" in verdict.line and "keep" not in verdict.line
    _, kept = resumed(n, 12, 3, 3, load_g=9, epochs=1)
    assert "keep the global batch at 12 (4 per process)" in kept.line


def test_end_of_epoch_record_starts_the_next_epoch():
    n, g = 96, 12
    dls = loaders(n, 2, g)
    steps_of(dls, 0)
    state = dls[0].state_dict()
    assert (state["epoch"], state["consumed"]) == (0, n)
    new = loaders(n, 3, g)
    for dl in new:
        dl.load_state_dict(state)
    assert new[0].epoch == 1 and steps_of(new, 1) == run(n, 3, g)[1]


def test_changed_dataset_length_restarts_the_epoch():
    dls = loaders(96, 2, 12)
    steps_of(dls, 0, limit=3)
    new = loaders(90, 3, 12)
    new[0].load_state_dict(dls[0].state_dict())
    assert not new[0].data_order.exact
    assert "the dataset has 90 samples, the checkpoint's had 96" in new[0].data_order.line
    assert list(new[0].sampler) == rank_stream(90, 0, 3, 0, seed=7)


def test_an_abandoned_pass_starts_at_the_position_again():
    """A pass started and left (an early iter(), a peek) keeps the loaded position; one that ran to
    its end, or another epoch, does not."""
    dls = loaders(96, 2, 12)
    steps_of(dls, 0, limit=3)
    new = ElasticSampler(ids(96), num_replicas=1, rank=0, seed=7)
    new.resume(dls[0].position(), 12)
    rest = epoch_order(96, 0, seed=7)[36:]
    it = iter(new)
    next(it)
    assert list(new) == rest, "abandoned: the next pass starts at the position again"
    assert list(new) == epoch_order(96, 0, seed=7), "after a full pass: the whole epoch"
    new.resume(dls[0].position(), 12)
    new.set_epoch(1)
    assert list(new) == epoch_order(96, 1, seed=7)


def test_saved_seed_wins():
    dls = loaders(96, 2, 12, seed=7)
    steps_of(dls, 0, limit=3)
    new = loaders(96, 1, 12, seed=123)
    new[0].load_state_dict(dls[0].state_dict())
    assert list(new[0].sampler) == epoch_order(96, 0, seed=7)[36:]


def test_accelerate_batch_sharding_deals_the_same_global_steps():
    """Accelerate's BatchSamplerShard over one global order: global step k is positions
    [kG, (k+1)G) of the order on every W, the steps the elastic dealing gives."""
    from accelerate.data_loader import BatchSamplerShard

    n, g = 100, 12
    order = epoch_order(n, 0, seed=7)
    per_w = {}
    for world in (1, 2, 3):
        b = g // world
        shards = [list(BatchSamplerShard(BatchSampler(order, b, False), world, r, split_batches=False,
                                         even_batches=True)) for r in range(world)]
        per_w[world] = [sorted(i for s in shards for i in s[k]) for k in range(len(shards[0]))]
        ours = [rank_stream(n, 0, world, r, seed=7) for r in range(world)]
        elastic = [sorted(i for r in range(world) for i in ours[r][k * b:(k + 1) * b]) for k in range(8)]
        assert per_w[world][:8] == elastic
    assert per_w[1][:8] == per_w[2][:8] == per_w[3][:8]


def test_workers_read_ahead_does_not_move_the_position():
    dl = ElasticDataLoader(ids(96), batch_size=6, seed=7, num_replicas=2, rank=0, num_workers=2, prefetch_factor=4)
    it = iter(dl)
    for _ in range(3):
        next(it)
    assert dl.state_dict()["consumed"] == 3 * 12
    del it


def test_make_stateful_keeps_the_loader_class():
    class MyLoader(DataLoader):
        pass

    sampler = ElasticSampler(ids(10), num_replicas=1, rank=0, seed=1)
    dl = make_stateful(MyLoader(ids(10), batch_size=2, sampler=sampler))
    assert isinstance(dl, MyLoader) and type(dl).__name__ == "MyLoader" and dl.state_dict()["consumed"] == 0
    with pytest.raises(TypeError, match="ElasticSampler"):
        make_stateful(DataLoader(ids(10), batch_size=2, shuffle=True))
    with pytest.raises(TypeError, match="IterableDataset"):
        ElasticDataLoader(torch.utils.data.IterableDataset())
    with pytest.raises(ValueError, match="format"):
        DataPosition.from_state({"format": "bytecheckpoint.data/9"})


def test_stateful_loaders_pickle():
    """A loader switched by make_stateful pickles as its own switched class (pickle found the
    class by name, i.e. the user's base class, and refused); ElasticDataLoader by name."""
    import pickle

    sampler = ElasticSampler(ids(10), num_replicas=1, rank=0, seed=1)
    dl = make_stateful(_PicklableLoader(ids(10), batch_size=2, sampler=sampler))
    next(iter(dl))
    back = pickle.loads(pickle.dumps(dl))
    assert type(back) is type(dl) and isinstance(back, _PicklableLoader) and back.state_dict() == dl.state_dict()
    elastic = pickle.loads(pickle.dumps(ElasticDataLoader(ids(10), batch_size=2, num_replicas=1, rank=0)))
    assert type(elastic) is ElasticDataLoader and sorted(elastic.sampler) == list(range(10))


class _PicklableLoader(DataLoader):
    pass


def test_global_orders_for_frameworks_that_deal_batches():
    """SeededOrder: SeedableRandomSampler's order; a stale set_epoch never sends it back.
    GeneratorOrder: the epoch's order drawn again from the saved generator state."""
    from accelerate.data_loader import SeedableRandomSampler

    ds = ids(30)
    stock = SeedableRandomSampler(ds, data_seed=5)
    seeded = SeededOrder(ds, seed=5)
    assert list(seeded) == list(stock) and seeded.epoch == 1
    seeded.set_epoch(0)  # stale: ignored
    stock.set_epoch(1)
    assert list(seeded) == list(stock)
    g = torch.Generator().manual_seed(3)
    order = GeneratorOrder(torch.utils.data.RandomSampler(ds, generator=g))
    first = list(order)
    saved = order.position(12, 2)
    second = list(order)
    fresh = GeneratorOrder(torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(99)))
    fresh.restore(saved)
    assert saved.epoch == 1 and list(fresh) == second != first


def test_record_through_bcp_save_and_load(tmp_path):
    """A loader saved in a bcp state on "2 processes" loads into a "3-process" loader."""
    dls = loaders(96, 2, 12)
    steps_of(dls, 0, limit=5)
    bcp.save(str(tmp_path / "ck"), {"data": dls[0]}, process_group=bcp.LOCAL)
    new = loaders(96, 3, 12)
    bcp.load(str(tmp_path / "ck"), {"data": new[1]}, process_group=bcp.LOCAL)
    assert new[1].position().consumed == 60 and new[1].data_order.exact
    assert "epoch 0, 60/96 samples consumed, 2 -> 3 processes" in new[1].data_order.line
