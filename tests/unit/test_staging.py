"""The async staging pool: buffers are reused across saves, two slots ping-pong."""
import threading
import time

import torch

from bytecheckpoint.pipeline.staging import StagingPool


def test_buffers_reused_for_same_layout():
    pool = StagingPool(slots=2)
    src = torch.arange(1000.0)
    key = ("w", (0,), (1000,), torch.float32)
    slot = pool.acquire()
    (first,) = pool.stage(slot, [(key, src)])
    pool.release(slot)
    other = pool.acquire()  # the other slot
    pool.release(other)
    slot2 = pool.acquire()  # back to the first slot
    assert slot2 is slot
    (again,) = pool.stage(slot2, [(key, src + 1)])
    assert again.data_ptr() == first.data_ptr(), "no allocation per save in steady state"
    assert torch.equal(again, src + 1)
    pool.release(slot2)


def test_staged_copy_is_independent_of_the_source():
    pool = StagingPool(slots=2)
    src = torch.ones(10)
    slot = pool.acquire()
    (buf,) = pool.stage(slot, [(("x", (0,), (10,), torch.float32), src)])
    src.zero_()
    assert buf.sum().item() == 10


def test_third_save_waits_for_the_first_to_finish_writing():
    pool = StagingPool(slots=2)
    a, b = pool.acquire(), pool.acquire()
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire()))
    t.start()
    time.sleep(0.2)
    assert not got, "a third save must wait while both slots are still being written"
    pool.release(a)
    t.join(5)
    assert got == [a]
    pool.release(b)
    pool.release(a)


def test_layout_change_drops_stale_buffers():
    pool = StagingPool(slots=1)
    slot = pool.acquire()
    pool.stage(slot, [(("x", (0,), (4,), torch.float32), torch.ones(4))])
    pool.stage(slot, [(("y", (0,), (2,), torch.float32), torch.ones(2))])
    assert list(slot.buffers) == [("y", (0,), (2,), torch.float32)]
    pool.release(slot)


def test_warm_up_allocates_both_slots_and_the_first_save_copies_early(tmp_path):
    import bytecheckpoint as bcp
    model = torch.nn.Linear(64, 32)
    state = {"model": model, "extra": torch.arange(10.0)}
    with bcp.Checkpointer(async_save=True) as ckpt:
        reserved = ckpt.warm_up(state)
        per_slot = sum(t.numel() * t.element_size() for t in (model.weight, model.bias, state["extra"]))
        assert reserved >= 2 * per_slot
        pool = ckpt._pool
        before = [{k: b.data_ptr() for k, b in s.buffers.items()} for s in pool._slots]
        assert all(len(b) == 3 for b in before)
        h = ckpt.save(tmp_path / "c", state)
        h.wait()
        assert h.stats["copies_started_early"], "warm_up planned it: the first save's copies start in the walk"
        after = [{k: b.data_ptr() for k, b in s.buffers.items()} for s in pool._slots]
        assert after == before, "the first save allocated nothing"
        assert ckpt.warm_up(state) == 0, "a second warm-up has nothing to allocate"
        out = {"model": torch.nn.Linear(64, 32), "extra": torch.zeros(10)}
        ckpt.load(tmp_path / "c", out)
        assert torch.equal(out["model"].weight, model.weight) and torch.equal(out["extra"], state["extra"])


def test_an_early_copy_plan_that_no_longer_holds_is_copied_again(tmp_path):
    """The layout changed between saves: the copies made during the walk are not used."""
    import bytecheckpoint as bcp
    with bcp.Checkpointer(async_save=True) as ckpt:
        ckpt.save(tmp_path / "a", {"x": torch.ones(4), "y": torch.ones(3)}).wait()
        h = ckpt.save(tmp_path / "b", {"x": torch.full((4,), 2.0), "y": torch.ones(5)})
        h.wait()
        assert not h.stats["copies_started_early"]
        out = {"x": torch.zeros(4), "y": torch.zeros(5)}
        ckpt.load(tmp_path / "b", out)
        assert out["x"].tolist() == [2.0] * 4 and out["y"].tolist() == [1.0] * 5
