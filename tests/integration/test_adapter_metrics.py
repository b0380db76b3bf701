"""The adapters' checkpoint/... metrics land where users already look: Lightning's CSVLogger,
an Accelerate tracker (accelerator.log), the Trainer's log history; an async save's stall at its
step, its completion later with checkpoint/saved_step; a resume's load metrics; the off switches
(log_metrics=False, BCP_LOG_METRICS=0). One process each, in-process frameworks."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

SAVE = {"checkpoint/save_s", "checkpoint/save_write_s", "checkpoint/save_bytes", "checkpoint/save_mb_s",
        "checkpoint/saved_step"}
LOAD = {"checkpoint/load_s", "checkpoint/load_bytes", "checkpoint/load_mb_s"}


def _metrics_rows(rows):
    """(step, sorted checkpoint/... keys) of each entry that has any."""
    out = []
    for row in rows:
        keys = sorted(k for k, v in row.items() if k.startswith("checkpoint/") and v not in ("", None))
        if keys:
            out.append((int(float(row["step"])), keys))
    return out


# ---------------------------------------------------------------------- Lightning
def _lightning_fit(tmp_path: Path, version: int, max_steps: int, ckpt_path=None, **plugin):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loggers import CSVLogger

    from lightning_bytecheckpoint import ByteCheckpointIO
    logger = CSVLogger(tmp_path, name="logs", version=version)
    trainer = L.Trainer(max_steps=max_steps, logger=logger, accelerator="cpu", devices=1, log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)],
                        plugins=[ByteCheckpointIO(async_save=True, **plugin)])
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    written = Path(logger.log_dir) / "metrics.csv"
    if not written.exists():   # BoringModel logs nothing itself
        return []
    with open(written) as f:
        return _metrics_rows(csv.DictReader(f))


def test_lightning_csv_logger_gets_save_and_load_metrics(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    rows = _lightning_fit(tmp_path, 0, 4)
    stalls = [step for step, keys in rows if keys == ["checkpoint/save_stall_s"]]
    done = [step for step, keys in rows if set(keys) == SAVE]
    assert stalls == [2, 4] and len(done) == 2, rows   # completions at a later step (or teardown)
    rows = _lightning_fit(tmp_path, 1, 6, ckpt_path=str(tmp_path / "ck" / "epoch=0-step=4.ckpt"))
    assert (4, sorted(LOAD)) in rows, rows              # the resume, at the restored step
    rows = _lightning_fit(tmp_path / "off", 0, 2, log_metrics=False)
    monkeypatch.setenv("BCP_LOG_METRICS", "0")
    assert rows == [] and _lightning_fit(tmp_path / "env", 0, 2) == []


# ---------------------------------------------------------------------- Accelerate
def test_accelerate_tracker_gets_metrics_at_the_checkpoint_count_or_metrics_step(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    from accelerate_bytecheckpoint import attach

    class ListTracker(GeneralTracker):
        name, requires_logging_directory = "list", False

        def __init__(self):
            super().__init__()
            self.logged = []

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            self.logged.append({**values, "step": step})

    def run(**kw):
        tracker = ListTracker()
        acc = Accelerator(log_with=[tracker], cpu=True)
        acc.init_trackers("t")
        model = torch.nn.Linear(8, 8)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        handle = attach(acc, async_save=True, **kw)
        acc.save_state(str(tmp_path / "a"))
        acc.save_state(str(tmp_path / "b"))
        acc.load_state(str(tmp_path / "a"))
        acc.end_training()
        handle.remove()
        return _metrics_rows(tracker.logged)

    rows = run()
    assert rows[0] == (1, ["checkpoint/save_stall_s"]) and (1, sorted(SAVE)) in rows   # save_iteration
    assert (2, sorted(LOAD)) in rows and [keys for _, keys in rows].count(sorted(SAVE)) == 2, rows
    steps = iter([100, 200, 300, 400, 500, 600])
    rows = run(metrics_step=lambda: next(steps))
    assert rows[0][0] == 100 and all(step >= 100 for step, _ in rows), rows
    assert run(log_metrics=False) == []


# ---------------------------------------------------------------------- transformers.Trainer
def test_trainer_log_history_gets_metrics_and_keeps_its_own_logs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent / "transformers_scripts"))
    from tiny import Tokens, tiny_gpt2, training_args
    from transformers import Trainer

    from transformers_bytecheckpoint import attach

    def run(out, attached=True, resume=None, **kw):
        t = Trainer(model=tiny_gpt2(), args=training_args(str(out)), train_dataset=Tokens())
        handle = attach(t, async_save=True, **kw) if attached else None
        t.train(resume_from_checkpoint=resume)
        if handle is not None:
            handle.remove()
        return t.state.log_history

    history = run(tmp_path / "a")
    stock = run(tmp_path / "stock", attached=False)
    assert sum("loss" in e for e in history) == sum("loss" in e for e in stock) == 6   # nothing of its own lost
    rows = _metrics_rows(history)
    assert [s for s, keys in rows if keys == ["checkpoint/save_stall_s"]] == [2, 4, 6]
    saved = [e["checkpoint/saved_step"] for e in history if "checkpoint/save_s" in e]
    assert saved == [2.0, 4.0, 6.0], rows
    resumed = run(tmp_path / "a", resume=str(tmp_path / "a" / "checkpoint-4"))
    assert (4, sorted(LOAD)) in _metrics_rows(resumed)
    monkeypatch.setenv("BCP_LOG_METRICS", "0")
    assert _metrics_rows(run(tmp_path / "off")) == []


def test_trainer_jit_checkpoint_from_a_step_end_keeps_the_steps_loss_log(tmp_path):
    """transformers' JIT checkpoint (SIGTERM) may run in JITCheckpointCallback.on_step_end, after
    DefaultFlowCallback set control.should_log: the save metrics' Trainer.log (whose on_log
    clears should_log) must not drop the Trainer's own loss log of that step."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent / "transformers_scripts"))
    from tiny import Tokens, tiny_gpt2, training_args
    from transformers import Trainer, TrainerCallback

    from transformers_bytecheckpoint import attach

    class RequestAtStep(TrainerCallback):   # as the SIGTERM timer would, between two hooks of step 3
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 2:
                for cb in trainer.callback_handler.callbacks:
                    if getattr(cb, "jit_manager", None) is not None:
                        cb.jit_manager.is_checkpoint_requested = True

    def run(out, attached):
        nonlocal trainer
        trainer = Trainer(model=tiny_gpt2(), args=training_args(str(out), enable_jit_checkpoint=True, save_steps=100),
                          train_dataset=Tokens(), callbacks=[RequestAtStep()])
        handle = attach(trainer, async_save=True) if attached else None
        trainer.train()
        if handle is not None:
            handle.remove()
        return trainer.state.log_history

    trainer = None
    stock = run(tmp_path / "stock", attached=False)
    history = run(tmp_path / "a", attached=True)
    assert [e["step"] for e in history if "loss" in e] == [e["step"] for e in stock if "loss" in e] == [1, 2, 3]
    assert (3, ["checkpoint/save_bytes", "checkpoint/save_mb_s", "checkpoint/save_s", "checkpoint/save_stall_s",
                "checkpoint/save_write_s"]) in _metrics_rows(history)   # the JIT save is synchronous
