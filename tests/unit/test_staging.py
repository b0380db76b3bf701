"""The async staging pool: buffers are reused across saves, two slots ping-pong."""
import threading
import time

import torch

from bytecheckpoint.staging import StagingPool


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
