"""Settings reach every path: the environment's defaults through bcp.save and the Lightning plugin,
every setting through pickling (ddp_spawn, Fabric launchers), and last_load_stats of the engine
that actually loaded (issue 22: each test here failed before its fix)."""
import pickle

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint import checkpointer as checkpointer_module


@pytest.fixture
def fresh_default(monkeypatch):
    """A default engine built from this test's environment, closed afterwards."""
    monkeypatch.setattr(checkpointer_module, "_DEFAULT", None)
    yield
    if checkpointer_module._DEFAULT is not None:
        checkpointer_module._DEFAULT.close()


def test_env_async_save_reaches_bcp_save(fresh_default, monkeypatch, tmp_path):
    monkeypatch.setenv("BCP_ASYNC_SAVE", "1")
    handle = bcp.save(tmp_path / "ck", {"w": torch.ones(1000)})
    assert handle.is_async, "BCP_ASYNC_SAVE=1 must make bcp.save asynchronous unless async_save is passed"
    handle.wait()
    assert not bcp.save(tmp_path / "ck2", {"w": torch.ones(10)}, async_save=False).is_async


def test_lightning_plugin_async_none_means_the_engine_setting(fresh_default, monkeypatch, tmp_path):
    pytest.importorskip("lightning")
    from lightning_bytecheckpoint import ByteCheckpointIO

    monkeypatch.setenv("BCP_ASYNC_SAVE", "1")
    handle = ByteCheckpointIO().save({"w": torch.ones(1000)}, str(tmp_path / "ck"))
    assert handle.is_async, "ByteCheckpointIO(async_save=None) must follow the default engine's option"
    handle.wait()


def test_checkpointer_pickles_with_every_setting(tmp_path):
    tier = bcp.LocalTier(dir=str(tmp_path / "local"), replicas=0, keep=3)
    ckpt = bcp.Checkpointer(async_save=True, io_threads=3, timeout_s=42, local_tier=tier,
                            process_group=bcp.LOCAL, storage_options={"region": "x"})
    copy = pickle.loads(pickle.dumps(ckpt))
    try:
        assert copy is not ckpt and not copy.closed
        assert copy.options == ckpt.options and copy.storage_options == {"region": "x"}
        assert copy.local_tier == tier and copy.process_group is bcp.LOCAL
    finally:
        copy.close()
        ckpt.close()


def test_checkpointer_with_a_live_process_group_refuses_to_pickle_clearly():
    ckpt = bcp.Checkpointer(process_group=object())
    with pytest.raises(pickle.PicklingError, match="process_group"):
        pickle.dumps(ckpt)
    ckpt.close()


def test_lightning_plugin_pickles_with_local_tier_and_process_group(tmp_path):
    pytest.importorskip("lightning")
    from lightning_bytecheckpoint import ByteCheckpointIO

    tier = bcp.LocalTier(dir=str(tmp_path / "local"), replicas=0)
    ckpt = bcp.Checkpointer(local_tier=tier, process_group=bcp.LOCAL, dead_peer_s=7)
    copy = pickle.loads(pickle.dumps(ByteCheckpointIO(ckpt)))
    engine = copy.checkpointer
    assert engine.local_tier == tier and engine.process_group is bcp.LOCAL and engine.options.dead_peer_s == 7
    engine.close()
    ckpt.close()


def test_accelerate_attachment_pickles_with_local_tier(monkeypatch, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from accelerate_bytecheckpoint import attach

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    acc = accelerate.Accelerator(cpu=True)
    tier = bcp.LocalTier(dir=str(tmp_path / "local"), replicas=0)
    ckpt = bcp.Checkpointer(local_tier=tier, process_group=bcp.LOCAL, timeout_s=9)
    handle = attach(acc, ckpt)
    other = pickle.loads(pickle.dumps(acc))._bytecheckpoint_attachment.checkpointer
    assert other.local_tier == tier and other.process_group is bcp.LOCAL and other.options.timeout_s == 9
    other.close()
    handle.remove()
    ckpt.close()


def test_lightning_plugin_engine_reports_its_own_load(fresh_default, tmp_path):
    pytest.importorskip("lightning")
    from lightning_bytecheckpoint import ByteCheckpointIO

    io = ByteCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.arange(5000.0)}, "epoch": 1}, str(tmp_path / "ck"))
    io.load_checkpoint(str(tmp_path / "ck"))
    assert io.checkpointer.last_load_stats.bytes_read >= 5000 * 4
    assert bcp.last_load_stats.bytes_read >= 5000 * 4  # the default engine is the plugin's here
    io.teardown()


def test_accelerate_attachment_engine_reports_its_own_load(monkeypatch, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from accelerate_bytecheckpoint import attach

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    acc = accelerate.Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(64, 64))
    handle = attach(acc)
    acc.save_state(str(tmp_path / "ck"))
    acc.load_state(str(tmp_path / "ck"))
    assert handle.checkpointer.last_load_stats.bytes_read >= model.weight.numel() * 4
    handle.remove()
