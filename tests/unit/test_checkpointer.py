"""The engine as an object: instances side by side, close(), caches, the type registry."""
import threading

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.format import metadata as md_module


def _engine_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("bytecheckpoint")]


def test_two_checkpointers_with_different_options_side_by_side(tmp_path):
    fast = bcp.Checkpointer(async_save=True, staging_slots=1, io_threads=1)
    careful = bcp.Checkpointer(io_threads=3, zero_redundancy=False, timeout_s=30, local_io="tensorstore")
    assert fast.options.async_save and not careful.options.async_save
    w = torch.arange(40_000.0)
    h = fast.save(tmp_path / "fast", {"w": w, "step": 1})           # async: its own option
    careful.save(tmp_path / "careful", {"w": w * 2, "step": 2})     # sync, through the kvstore
    w.zero_()                                                       # after the staging copy
    assert fast.pending_paths() in ([], [str(tmp_path / "fast")]) and careful.pending_paths() == []
    h.wait()
    for ckpt, name, factor, step in ((careful, "fast", 1, 1), (fast, "careful", 2, 2)):  # each reads the other's
        out = {"w": torch.empty(40_000), "step": 0}
        ckpt.load(tmp_path / name, out)
        assert torch.equal(out["w"], torch.arange(40_000.0) * factor) and out["step"] == step
    fast.close()
    careful.close()


def test_pending_saves_belong_to_their_instance(tmp_path):
    a, b = bcp.Checkpointer(async_save=True), bcp.Checkpointer(async_save=True)
    ha = a.save(tmp_path / "a", {"w": torch.ones(1000)})
    hb = b.save(tmp_path / "b", {"w": torch.ones(1000)})
    a.wait()
    assert ha.done() and a.pending_paths() == []
    hb.wait()
    a.close()
    b.close()


def test_close_frees_the_staging_pool_and_threads_and_refuses_work(tmp_path):
    ckpt = bcp.Checkpointer(async_save=True)
    big = torch.ones(1 << 20)
    for i in range(3):
        ckpt.save(tmp_path / f"s{i}", {"w": big})
    ckpt.wait()
    pool = ckpt._pool
    assert pool is not None and pool.nbytes() >= 2 * big.numel() * 4  # both ping-pong slots filled
    ckpt.close()
    assert pool.nbytes() == 0 and ckpt._pool is None
    assert _engine_threads() == []
    with pytest.raises(bcp.CheckpointerClosedError):
        ckpt.save(tmp_path / "after", {"w": big})
    with pytest.raises(bcp.CheckpointerClosedError):
        ckpt.load(tmp_path / "s0", {"w": big})
    ckpt.close()  # idempotent


def test_context_manager_waits_for_pending_saves(tmp_path):
    with bcp.Checkpointer(async_save=True) as ckpt:
        h = ckpt.save(tmp_path / "c", {"w": torch.ones(100_000)})
    assert h.done() and bcp.is_checkpoint(tmp_path / "c")
    assert _engine_threads() == []


def test_no_threads_left_after_sync_and_waited_async_work(tmp_path):
    ckpt = bcp.Checkpointer()
    ckpt.save(tmp_path / "s", {"w": torch.ones(1 << 18)})
    ckpt.load(tmp_path / "s", {"w": torch.zeros(1 << 18)})
    h = ckpt.save(tmp_path / "a", {"w": torch.ones(1 << 18)}, async_save=True)
    ckpt.wait()
    assert h.done() and _engine_threads() == []


def test_metadata_parsed_once_per_version(tmp_path, monkeypatch):
    """A resume asks several questions of one checkpoint; its metadata.json is parsed once."""
    ckpt = bcp.Checkpointer()
    ckpt.save(tmp_path / "m", {"w": torch.ones(10), "step": 3})
    parses = []
    real = md_module.Metadata.from_json
    monkeypatch.setattr(md_module.Metadata, "from_json",
                        staticmethod(lambda *a, **k: parses.append(1) or real(*a, **k)))
    assert ckpt.is_checkpoint(tmp_path / "m")
    assert ckpt.load_full(tmp_path / "m", keys=["step"]) == {"step": 3}
    ckpt.load(tmp_path / "m", {"w": torch.zeros(10), "step": 0})
    assert len(parses) == 1
    ckpt.save(tmp_path / "m", {"w": torch.ones(10), "step": 4}, overwrite=True)   # a new version
    assert ckpt.load_full(tmp_path / "m", keys=["step"]) == {"step": 4}
    assert len(parses) == 2
    ckpt.close()


def test_options_are_validated():
    with pytest.raises(bcp.CheckpointError, match="staging_slots"):
        bcp.Checkpointer(staging_slots=0)
    with pytest.raises(bcp.CheckpointError, match="zero_redundancy"):
        bcp.Checkpointer(zero_redundancy="sometimes")
    with pytest.raises(bcp.CheckpointError, match="timeout_s"):
        bcp.Checkpointer(timeout_s=-1)
    with pytest.raises(bcp.CheckpointError, match="storage_options must be a dict"):
        bcp.Checkpointer(storage_options="endpoint=http://x")
    with pytest.raises(bcp.CheckpointError, match="storage_options must be a dict"):
        bcp.save("/tmp/never-written", {"w": torch.ones(1)}, storage_options="nope")


def test_environment_supplies_defaults_only_through_from_env():
    env = {"BCP_STAGING_SLOTS": "3", "BCP_TIMEOUT_S": "12", "BCP_ZERO_REDUNDANCY": "0", "BCP_FILE_IO": "tensorstore"}
    ckpt = bcp.Checkpointer.from_env(env, io_threads=2)
    assert (ckpt.options.staging_slots, ckpt.options.timeout_s, ckpt.options.zero_redundancy,
            ckpt.options.local_io, ckpt.options.io_threads) == (3, 12.0, False, "tensorstore", 2)
    assert bcp.Checkpointer().options.staging_slots == 2   # the constructor never reads the environment
    with pytest.raises(bcp.CheckpointError, match="BCP_TIMEOUT_S"):
        bcp.Checkpointer.from_env({"BCP_TIMEOUT_S": "soon"})


def test_registry_refuses_silent_collisions():
    class Point:
        def __init__(self, x):
            self.x = x

    class PointHandler(bcp.Handler):
        def save(self, value, key, walk):
            return walk.save({"x": torch.tensor([value.x])}, key)

    bcp.REGISTRY.register(Point, PointHandler())
    try:
        with pytest.raises(bcp.CheckpointError, match="already registered.*override=True"):
            bcp.REGISTRY.register(Point, PointHandler())
        bcp.REGISTRY.register(Point, PointHandler(), override=True)
        with pytest.raises(bcp.CheckpointError, match="already registered"):
            bcp.REGISTRY.register(torch.Tensor, PointHandler())
    finally:
        bcp.REGISTRY._handlers.pop(Point, None)


def test_fresh_optimizer_is_not_changed_by_save(tmp_path):
    """Saving before the first step must not fill in optimizer state (torch would run a step)."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    bcp.save(tmp_path / "fresh", {"model": model, "optimizer": opt})
    assert len(opt.state) == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # ...and loading that checkpoint into a trained optimizer leaves it without state, as saved
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.param_groups[0]["lr"] = 5.0
    bcp.load(tmp_path / "fresh", {"model": model, "optimizer": opt})
    assert len(opt.state) == 0 and opt.param_groups[0]["lr"] == 0.1


def test_restore_without_a_template_returns_the_whole_newest_state(tmp_path):
    """restore() with no template (what framework adapters use): the newer of the local tier and
    the persistent directory, whole, with plain values and integer keys as saved."""
    tier = bcp.LocalTier(dir=str(tmp_path / "local"), replicas=0)
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "opt": {"state": {0: {"m": torch.ones(2)}}}, "step": 3}
    with bcp.Checkpointer(local_tier=tier) as ckpt:
        ckpt.save(str(tmp_path / "p" / "step_1"), {**state, "step": 1}, step=1)
        ckpt.save("step_3", state, tier="local", step=3)
        got = ckpt.restore(persistent=str(tmp_path / "p"))
        assert (got.source, got.name, got.state["step"]) == ("local", "step_3", 3)
        assert torch.equal(got.state["model"]["w"], state["model"]["w"])
        assert torch.equal(got.state["opt"]["state"][0]["m"], torch.ones(2))
    with bcp.Checkpointer() as ckpt:   # no local tier: the persistent one
        got = ckpt.restore(persistent=str(tmp_path / "p"))
        assert got.source == "persistent" and got.state["step"] == 1
