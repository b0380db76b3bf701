"""Single-process save/load through the public API, and every bad-input error."""
import json
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import bytecheckpoint as bcp


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train(model, optim, steps, seed=123):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g)
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_resume_matches_uninterrupted_bit_for_bit(tmp_path, opt_cls):
    kwargs = {"lr": 1e-2, "momentum": 0.9} if opt_cls is torch.optim.SGD else {"lr": 1e-2}
    model = make_model()
    optim = opt_cls(model.parameters(), **kwargs)
    train(model, optim, 3)
    bcp.save(tmp_path / "ck", {"model": model, "optim": optim, "step": 3})
    train(model, optim, 4, seed=9)

    fresh = make_model(seed=42)
    fresh_optim = opt_cls(fresh.parameters(), **kwargs)  # no state yet
    state = bcp.load(tmp_path / "ck", {"model": fresh, "optim": fresh_optim, "step": 0})
    assert state["step"] == 3
    train(fresh, fresh_optim, 4, seed=9)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64,
                                   torch.bool, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2,
                                   torch.float64, torch.complex64])
def test_dtypes_round_trip_exactly(tmp_path, dtype):
    src = (torch.randn(6, 5) * 50)
    if dtype == torch.complex64:
        src = torch.complex(src, -src)
    t = src.to(dtype) if dtype != torch.bool else src > 0
    bcp.save(tmp_path / "ck", {"t": t})
    out = {"t": torch.zeros_like(t)}
    bcp.load(tmp_path / "ck", out)
    view = (lambda x: x.view(torch.uint8)) if t.element_size() == 1 and dtype not in (torch.bool, torch.uint8) else (lambda x: x)
    assert torch.equal(view(out["t"]), view(t))


def test_plain_values_and_nested_containers(tmp_path):
    pyrng = random.Random(3).getstate()
    nprng = np.random.RandomState(5).get_state()
    state = {"step": 10, "epoch": 2.5, "name": "run", "none": None, "blob": b"\x00\x01",
             "nested": {"a": [1, (2, 3)], 7: {"x": torch.ones(2)}}, "pyrng": pyrng, "nprng": nprng,
             "dtype": torch.bfloat16, "big": 1 << 80, "inf": float("inf")}
    bcp.save(tmp_path / "ck", state)
    target = {"step": 0, "epoch": 0.0, "name": "", "none": 1, "blob": b"", "nested": {"a": None, 7: {"x": torch.zeros(2)}},
              "pyrng": None, "nprng": None, "dtype": None, "big": 0, "inf": 0.0}
    bcp.load(tmp_path / "ck", target)
    assert target["step"] == 10 and target["epoch"] == 2.5 and target["name"] == "run" and target["none"] is None
    assert target["blob"] == b"\x00\x01" and target["nested"]["a"] == [1, (2, 3)]
    assert torch.equal(target["nested"][7]["x"], torch.ones(2))
    assert target["pyrng"] == pyrng and target["dtype"] is torch.bfloat16 and target["big"] == 1 << 80
    assert target["nprng"][0] == nprng[0] and np.array_equal(target["nprng"][1], nprng[1])
    full = bcp.load_full(tmp_path / "ck")
    assert full["nested"][7]["x"].tolist() == [1.0, 1.0] and full["step"] == 10


def test_stateful_objects(tmp_path):
    model = make_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    for _ in range(3):
        optim.step()
        sched.step()
    bcp.save(tmp_path / "ck", {"sched": sched})
    optim2 = torch.optim.SGD(make_model().parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(optim2, step_size=1, gamma=0.5)
    bcp.load(tmp_path / "ck", {"sched": sched2})
    assert sched2.state_dict() == sched.state_dict()


class Custom:
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Custom) and other.v == self.v


def test_pickled_objects_need_opt_in(tmp_path):
    bcp.save(tmp_path / "ck", {"obj": Custom(3)})
    with pytest.raises(bcp.CheckpointError, match="allow_pickle=True"):
        bcp.load(tmp_path / "ck", {"obj": None})
    out = bcp.load(tmp_path / "ck", {"obj": None}, allow_pickle=True)
    assert out["obj"] == Custom(3)


def test_shard_and_flatshard_single_process(tmp_path):
    g = torch.arange(60.0).reshape(6, 10)
    bcp.save(tmp_path / "ck", {"a": bcp.FlatShard(g.reshape(-1).clone(), (6, 10), 0),
                               "b": bcp.Shard(g.clone(), (6, 10), (0, 0))})
    flat = torch.zeros(17)
    box = torch.zeros(3, 4)
    bcp.load(tmp_path / "ck", {"a": bcp.FlatShard(flat, (6, 10), 13), "b": bcp.Shard(box, (6, 10), (2, 5))})
    assert torch.equal(flat, g.reshape(-1)[13:30])
    assert torch.equal(box, g[2:5, 5:9])


# ------------------------------------------------------------------ bad input

def test_missing_path(tmp_path):
    with pytest.raises(bcp.CheckpointNotFoundError, match="no metadata.json"):
        bcp.load(tmp_path / "nope", {"x": torch.zeros(1)})


def test_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("hi")
    with pytest.raises(bcp.CheckpointNotFoundError, match="not a bytecheckpoint checkpoint"):
        bcp.load(tmp_path / "junk", {"x": torch.zeros(1)})


def test_partial_checkpoint_is_refused_and_reported(tmp_path):
    bcp.save(tmp_path / "ck", {"x": torch.ones(3)})
    os.remove(tmp_path / "ck" / "metadata.json")
    with pytest.raises(bcp.IncompleteCheckpointError, match="did not finish"):
        bcp.load(tmp_path / "ck", {"x": torch.zeros(3)})
    info = bcp.inspect(tmp_path / "ck")
    assert not info.complete and "did not finish" in info.problem
    assert not bcp.verify(tmp_path / "ck").ok
    assert not bcp.is_checkpoint(tmp_path / "ck")


def test_no_overwrite_keeps_old_checkpoint(tmp_path):
    bcp.save(tmp_path / "ck", {"x": torch.ones(3)})
    with pytest.raises(bcp.CheckpointExistsError, match="overwrite=True"):
        bcp.save(tmp_path / "ck", {"x": torch.zeros(3)})
    out = bcp.load(tmp_path / "ck", {"x": torch.zeros(3)})
    assert out["x"].tolist() == [1, 1, 1]
    bcp.save(tmp_path / "ck", {"x": torch.full((3,), 2.0)}, overwrite=True)
    assert bcp.load(tmp_path / "ck", {"x": torch.zeros(3)})["x"].tolist() == [2, 2, 2]
    assert len([d for d in os.listdir(tmp_path / "ck") if d.startswith("data-")]) == 1, "old data removed"


def test_shape_and_dtype_mismatch_named(tmp_path):
    bcp.save(tmp_path / "ck", {"model": {"w": torch.ones(3, 4)}})
    with pytest.raises(bcp.StateMismatchError, match=r"'model/w'.*\[3, 4\].*\[4, 3\]"):
        bcp.load(tmp_path / "ck", {"model": {"w": torch.zeros(4, 3)}})
    with pytest.raises(bcp.StateMismatchError, match="'model/w'.*float32.*float16"):
        bcp.load(tmp_path / "ck", {"model": {"w": torch.zeros(3, 4, dtype=torch.float16)}})


def test_missing_and_unexpected_keys(tmp_path):
    bcp.save(tmp_path / "ck", {"a": torch.ones(2), "b": torch.ones(2), "n": 1})
    with pytest.raises(bcp.StateMismatchError) as err:
        bcp.load(tmp_path / "ck", {"a": torch.zeros(2), "c": torch.zeros(2)})
    assert "'c'" in str(err.value) and "'b'" in str(err.value) and "'n'" in str(err.value)
    out = bcp.load(tmp_path / "ck", {"a": torch.zeros(2), "c": torch.zeros(2)}, strict=False)
    assert out["a"].tolist() == [1, 1] and out["c"].tolist() == [0, 0]


def test_newer_format_version_refused(tmp_path):
    bcp.save(tmp_path / "ck", {"x": torch.ones(1)})
    p = tmp_path / "ck" / "metadata.json"
    body = json.loads(p.read_text())
    body.pop("checksum")
    body["version"] = 99
    p.write_text(json.dumps(body))
    with pytest.raises(bcp.FormatVersionError, match="version 99 is newer"):
        bcp.load(tmp_path / "ck", {"x": torch.zeros(1)})


def test_bad_state_type_and_shards():
    with pytest.raises(TypeError, match="state must be a dict"):
        bcp.save("/tmp/never", [torch.ones(1)])
    with pytest.raises(ValueError, match="dim 0 covers"):
        bcp.Shard(torch.ones(3, 2), (2, 2), (0, 0))
    with pytest.raises(ValueError, match="do not fit"):
        bcp.FlatShard(torch.ones(5), (2, 2), 0)


def test_async_save_mutation_does_not_leak(tmp_path):
    t = torch.arange(100_000.0)
    h = bcp.save(tmp_path / "a", {"t": t}, async_save=True)
    t.zero_()
    h.wait()
    assert h.done()
    assert torch.equal(bcp.load_full(tmp_path / "a")["t"], torch.arange(100_000.0))


def test_two_overlapping_async_saves(tmp_path):
    t = torch.arange(50_000.0)
    h1 = bcp.save(tmp_path / "a", {"t": t}, async_save=True)
    t.add_(1)
    h2 = bcp.save(tmp_path / "b", {"t": t}, async_save=True)
    t.add_(1)
    h3 = bcp.save(tmp_path / "c", {"t": t}, async_save=True)  # reuses slot of h1 once it is done
    bcp.wait_pending()
    for h in (h1, h2, h3):
        assert h.done()
    for i, name in enumerate("abc"):
        assert torch.equal(bcp.load_full(tmp_path / name)["t"], torch.arange(50_000.0) + i)


def test_async_save_onto_existing_fails_before_returning(tmp_path):
    bcp.save(tmp_path / "x", {"t": torch.ones(2)})
    with pytest.raises(bcp.CheckpointExistsError):
        bcp.save(tmp_path / "x", {"t": torch.ones(2)}, async_save=True)


def test_async_failure_raised_by_wait(tmp_path):
    from bytecheckpoint.storage import faults
    with faults.inject({"op": "write", "kind": "error", "key": "/pack/"}, checkpointer=bcp.default_checkpointer()):  # every chunk write fails
        h = bcp.save(tmp_path / "w", {"t": torch.ones(2)}, async_save=True)
        with pytest.raises(bcp.CheckpointError, match="Input/output error"):
            h.wait()
    assert not bcp.is_checkpoint(tmp_path / "w")


def test_async_background_failure_surfaces_on_next_save(tmp_path):
    from bytecheckpoint.storage import faults
    with faults.inject({"op": "write", "kind": "error", "key": "/pack/"}, checkpointer=bcp.default_checkpointer()):
        h = bcp.save(tmp_path / "y", {"t": torch.ones(2)}, async_save=True)
        while not h.done():
            pass
    with pytest.raises(bcp.CheckpointError, match="Input/output error"):
        bcp.save(tmp_path / "z", {"t": torch.ones(2)})
    assert not bcp.is_checkpoint(tmp_path / "y")


def test_unwaited_background_failure_is_reported_at_exit(tmp_path):
    import subprocess
    import sys
    import os
    code = (
        "import time, torch, bytecheckpoint as bcp\n"
        f"bcp.save({str(tmp_path / 'x')!r}, {{'w': torch.ones(3)}}, async_save=True)\n"
        "time.sleep(0.5)\n")
    env = dict(os.environ, BCP_FAULTS='[{"op": "write", "kind": "enospc", "key": "/pack/"}]')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "failed and was not committed" in out.stderr and "No space left" in out.stderr
    assert not bcp.is_checkpoint(tmp_path / "x")
