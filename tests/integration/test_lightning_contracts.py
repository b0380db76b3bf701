"""ByteCheckpointIO against Lightning's calling contracts, one process, real Trainers (CPU).

Regression tests for what Lightning's own checkpoint suite found with the plugin injected
(docs/lightning.md, "Lightning's own test suite"): non-dict storage_options, fsspec-only URLs
(memory://) and Lightning's HPC resume scan, a checkpoint directory served over http,
``Model.load_from_checkpoint(dir)``, engine threads after teardown, the engine object's
ownership, and the in-place load of a Trainer's weights.
"""
from __future__ import annotations

import functools
import http.server
import sys
import threading
from pathlib import Path

import bytecheckpoint as bcp
import lightning.pytorch as pl
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_lightning import Net, assert_same, dataloader, make_trainer  # noqa: E402

from lightning_bytecheckpoint import ByteCheckpointIO, load_from_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short fit and a checkpoint directory of it (shared by the read-only tests below)."""
    root = tmp_path_factory.mktemp("trained")
    pl.seed_everything(21)
    model = Net(hidden=24)
    trainer = make_trainer(root, plugins=[ByteCheckpointIO()], max_epochs=1)
    trainer.fit(model, dataloader())
    trainer.save_checkpoint(root / "model.ckpt")
    return model, root / "model.ckpt"


def test_storage_options_must_be_a_dict(tmp_path, trained):
    with pytest.raises(TypeError, match="storage_options must be a dict of bytecheckpoint storage options"):
        ByteCheckpointIO(storage_options="endpoint=http://x")
    model, _ = trained
    trainer = make_trainer(tmp_path, plugins=[ByteCheckpointIO()], max_epochs=1)
    trainer.fit(Net(hidden=24), dataloader())
    with pytest.raises(TypeError, match=r"storage_options must be a dict .* got str 'my options'"):
        trainer.save_checkpoint(tmp_path / "x.ckpt", storage_options="my options")
    assert not (tmp_path / "x.ckpt").exists()
    trainer.save_checkpoint(tmp_path / "y.ckpt", storage_options={"request_timeout": 60})  # a dict goes to the engine
    assert bcp.is_checkpoint(str(tmp_path / "y.ckpt"))


def test_fsspec_only_url_goes_to_lightning_default_and_hpc_resume_finds_it():
    """memory:// is fsspec's in-memory file system for Lightning: checkpoints there are regular
    files (TorchCheckpointIO), so Lightning's fsspec lookups (here the HPC resume scan) see them."""
    root = "memory://bcp-hpc-test"
    pl.seed_everything(22)
    model = Net(hidden=24)
    trainer = make_trainer(root, plugins=[ByteCheckpointIO()], max_epochs=1)
    with pytest.warns(UserWarning, match="memory:// is an fsspec file system bytecheckpoint does not store to"):
        trainer.fit(model, dataloader())  # ModelCheckpoint saves under memory://.../checkpoints
    trainer.save_checkpoint(f"{root}/hpc_ckpt_3.ckpt")
    resumed = Net(hidden=24)
    trainer2 = make_trainer(root, plugins=[ByteCheckpointIO()], max_epochs=2)
    trainer2.fit(resumed, dataloader(), ckpt_path="hpc")
    assert trainer2.global_step == 16 and resumed.loaded["global_step"] == 8
    assert_same(resumed.loaded["state_dict"], model.snapshots[8]["state_dict"], "hpc resume")


def test_checkpoint_directory_over_http_loads_read_only(trained):
    """A checkpoint directory behind a plain web server loads through the engine (read-only),
    through the plugin and through load_from_checkpoint (it used to unpickle the HTML listing)."""
    model, path = trained
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(path.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{path.name}"
        loaded = ByteCheckpointIO().load_checkpoint(url)
        assert_same(loaded["state_dict"], model.state_dict(), "plugin over http")
        assert_same(Net.load_from_checkpoint(url).state_dict(), model.state_dict(), "load_from_checkpoint over http")
    finally:
        server.shutdown()
        server.server_close()


def test_load_from_checkpoint_reads_a_directory(trained):
    """Lightning's classmethod and the helper: model rebuilt from the saved hyper-parameters
    (overridable), weights as saved, strict checks as Lightning's, on CPU, no RNG touched."""
    model, path = trained
    loaded = Net.load_from_checkpoint(path)
    assert loaded.hparams.hidden == 24 and isinstance(loaded, Net)
    assert_same(loaded.state_dict(), model.state_dict(), "Model.load_from_checkpoint(dir)")
    helped = load_from_checkpoint(Net, str(path), map_location="cpu")
    assert_same(helped.state_dict(), model.state_dict(), "load_from_checkpoint(Net, dir)")

    class Wider(Net):
        def __init__(self, hidden: int = 24, extra: object = None) -> None:
            super().__init__(hidden, extra)
            self.head = torch.nn.Linear(1, 1)

    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"head.weight\""):
        Wider.load_from_checkpoint(path)
    partial = Wider.load_from_checkpoint(path, strict=False, hidden=24)
    assert_same(partial.net.state_dict(), model.net.state_dict(), "strict=False")


def test_no_engine_thread_outlives_teardown(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    io = ByteCheckpointIO(async_save=True)
    assert io.checkpointer is bcp.default_checkpointer()   # the engine behind bcp.save
    trainer = make_trainer(tmp_path, plugins=[io], max_epochs=1, callbacks=[
        pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(Net(hidden=128), dataloader())
    leaked = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not leaked, f"threads left after fit: {leaked}"
    assert io.checkpointer.pending_paths() == []
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    io.teardown()
    assert bcp.is_checkpoint(str(tmp_path / "after.ckpt"))
    assert not [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]


def test_shared_checkpointer_is_used_and_not_closed(tmp_path):
    ckpt = bcp.Checkpointer(async_save=True)
    io = ByteCheckpointIO(ckpt)
    assert io.checkpointer is ckpt
    trainer = make_trainer(tmp_path, plugins=[io], max_epochs=1, callbacks=[
        pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "c", filename="{step}", every_n_train_steps=4,
                                     save_top_k=-1)])
    trainer.fit(Net(hidden=24), dataloader())
    assert not ckpt.closed and ckpt.pending_paths() == []  # waited for at teardown, left open
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["step=4.ckpt", "step=8.ckpt"]
    ckpt.close()


def test_trainer_load_reads_weights_in_place(trained, tmp_path):
    """On one device / DDP the saved weights are read straight into the module's tensors (no
    second copy); a module that edits checkpoints in on_load_checkpoint gets Lightning's path."""
    model, path = trained

    class Plain(pl.LightningModule):  # Net records what it loads in on_load_checkpoint
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(hidden=24).net

    target = Plain()
    trainer = make_trainer(tmp_path, plugins=[ByteCheckpointIO()])
    trainer.strategy.connect(target)
    target.trainer = trainer  # what fit/validate do before restoring
    ptrs = {k: v.data_ptr() for k, v in target.state_dict().items()}
    before = {k: v.clone() for k, v in target.state_dict().items()}
    peek = trainer.strategy.checkpoint_io.load_checkpoint(path)  # not a restore: the live model is left alone
    assert_same(target.state_dict(), before, "a load outside a restore")
    assert all(peek["state_dict"][k].data_ptr() != p for k, p in ptrs.items())
    trainer.ckpt_path = str(path)  # what fit/validate(ckpt_path=...) sets before restoring
    ckpt = trainer.strategy.checkpoint_io.load_checkpoint(path)
    assert {k: v.data_ptr() for k, v in ckpt["state_dict"].items()} == ptrs
    assert_same(target.state_dict(), model.state_dict(), "in place")
    assert "optimizer_states" in ckpt and "bytecheckpoint_lightning" not in ckpt

    class Editing(Net):
        def on_load_checkpoint(self, checkpoint):
            checkpoint["state_dict"].pop("net.3.bias")

    editing = Editing(hidden=24)
    trainer2 = make_trainer(tmp_path, plugins=[ByteCheckpointIO()])
    trainer2.strategy.connect(editing)
    editing.trainer = trainer2
    trainer2.ckpt_path = str(path)
    ckpt = trainer2.strategy.checkpoint_io.load_checkpoint(path)
    assert all(ckpt["state_dict"][k].data_ptr() != v.data_ptr() for k, v in editing.state_dict().items())


def test_missing_peer_in_a_collective_save_is_reported_within_the_bound(tmp_path):
    """Sharded saves are collective; a rank that never arrives is reported after the
    checkpointer's timeout_s (here 3 s), naming the cause, instead of hanging."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from launcher import run_ranks

    outs = run_ranks("lightning_ranks:missing_peer", 2, {"path": str(tmp_path / "c.ckpt"), "timeout_s": 3},
                     timeout=60, extra_env={"PYTHONPATH": str(Path(__file__).resolve().parent)})
    result = json.loads(next(line for line in outs[0].splitlines() if line.startswith("RESULT "))[7:])
    assert 3 <= result["seconds"] < 10, result
    assert "not every rank of the process group (2 ranks) arrived within 3 s" in result["message"]
