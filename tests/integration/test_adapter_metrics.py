"""The adapters' checkpoint/... metrics follow each framework's logging conventions: Lightning's
log steps (log_every_n_steps, its step, its loggers, its logger.save() calls: no call of their own),
an Accelerate tracker at the script's own accelerator.log calls, the Trainer's callbacks (report_to
integrations, the console) at its log steps without entering state.log_history (unless asked).
None is lost: every save's numbers arrive (several waiting for one log step are summed, with
checkpoint/saves). Resume load metrics; the off switches (log_metrics=False, BCP_LOG_METRICS=0).
One process each, in-process frameworks."""
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


def _count(entries, key):
    """How many saves (loads) carried `key` into these entries (a folded entry counts them)."""
    count = {"checkpoint/save_stall_s": "checkpoint/saves", "checkpoint/save_s": "checkpoint/saves_completed",
             "checkpoint/load_s": "checkpoint/loads"}[key]
    return sum(int(float(e.get(count) or 1)) for e in entries if e.get(key) not in (None, ""))


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
        return list(csv.DictReader(f))


def test_lightning_csv_logger_gets_save_and_load_metrics(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    entries = _lightning_fit(tmp_path, 0, 4)
    rows = _metrics_rows(entries)
    # saves at global_step 2 and 4, made in on_train_batch_end: logged with that batch, at Lightning's step (1, 3)
    assert [step for step, keys in rows if "checkpoint/save_stall_s" in keys] == [1, 3], rows
    assert _count(entries, "checkpoint/save_s") == 2, rows   # both completions, later (or at teardown)
    assert all(set(keys) <= SAVE | {"checkpoint/save_stall_s", "checkpoint/saves", "checkpoint/saves_completed"}
               for _, keys in rows)
    rows = _metrics_rows(_lightning_fit(tmp_path, 1, 6, ckpt_path=str(tmp_path / "ck" / "epoch=0-step=4.ckpt")))
    assert (4, sorted(LOAD)) in rows, rows              # the resume, with the resumed run's first log step
    rows = _lightning_fit(tmp_path / "off", 0, 2, log_metrics=False)
    monkeypatch.setenv("BCP_LOG_METRICS", "0")
    assert _metrics_rows(rows) == [] and _metrics_rows(_lightning_fit(tmp_path / "env", 0, 2)) == []


def test_lightning_metrics_follow_log_every_n_steps_with_no_call_of_their_own(tmp_path):
    """log_every_n_steps=3, a checkpoint every 2 steps: the loggers get exactly the calls (steps and
    logger.save()s) of a run without metrics; every save's numbers ride in them, none lost."""
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loggers.logger import Logger

    from lightning_bytecheckpoint import ByteCheckpointIO

    class Recorder(Logger):
        name, version = "rec", 0

        def __init__(self):
            super().__init__()
            self.calls, self.saves = [], 0

        def log_metrics(self, metrics, step=None):
            self.calls.append((step, dict(metrics)))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def save(self):
            self.saves += 1

    class Logs(BoringModel):
        def training_step(self, *args, **kwargs):
            self.log("foo", -1.0)
            return super().training_step(*args, **kwargs)

    def fit(out, **plugin):
        rec = Recorder()
        L.Trainer(max_steps=6, logger=rec, accelerator="cpu", devices=1, log_every_n_steps=3, limit_val_batches=0,
                  enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1)],
                  plugins=[ByteCheckpointIO(**plugin)]).fit(Logs())
        return rec

    stock, ours = fit(tmp_path / "stock", log_metrics=False), fit(tmp_path / "ours")
    assert [s for s, _ in ours.calls] == [s for s, _ in stock.calls] == [2, 5] and ours.saves == stock.saves
    assert all("foo" in m for _, m in ours.calls)
    assert _count([m for _, m in ours.calls], "checkpoint/save_s") == 3   # saves at global_step 2, 4, 6
    step5 = ours.calls[1][1]
    assert step5["checkpoint/saves"] == step5["checkpoint/saves_completed"] == 2.0   # global_step 4 and 6: summed
    assert step5["checkpoint/save_mb_s"] == pytest.approx(step5["checkpoint/save_bytes"] / step5["checkpoint/save_s"] / 1e6)


# ---------------------------------------------------------------------- Accelerate
def _list_tracker():
    from accelerate.tracking import GeneralTracker

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

    return ListTracker()


def test_accelerate_metrics_ride_on_the_scripts_own_log_calls(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from accelerate_bytecheckpoint import attach

    def run(log=True, **kw):
        tracker = _list_tracker()
        acc = Accelerator(log_with=[tracker], cpu=True)
        acc.init_trackers("t")
        model = torch.nn.Linear(8, 8)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        handle = attach(acc, async_save=True, **kw)
        for step in (1, 2, 3, 4, 5):
            if log:
                acc.log({"loss": 1.0 / step}, step=10 * step)
            if step == 1:
                acc.save_state(str(tmp_path / "c1"))
                handle.wait()                      # its completion is known before the next log
            elif step == 3:
                acc.save_state(str(tmp_path / "c3"))
                acc.save_state(str(tmp_path / "c4"))   # waits for c3 first
            elif step == 4:
                acc.load_state(str(tmp_path / "c1"))
        acc.end_training()
        handle.remove()
        return tracker.logged

    logged = run()
    assert [e["step"] for e in logged] == [10, 20, 30, 40, 50] and all("loss" in e for e in logged), logged
    assert _metrics_rows(logged)[0] == (20, sorted(SAVE | {"checkpoint/save_stall_s"})), logged
    assert logged[1]["checkpoint/saved_step"] == 1.0                  # accelerator.save_iteration of c1
    assert _count(logged, "checkpoint/save_stall_s") == 3 and _count(logged, "checkpoint/save_s") == 3, logged
    assert logged[3]["checkpoint/saves"] == 2.0                  # c3's and c4's stalls, summed
    assert set(LOAD) <= set(logged[4]), logged                   # the load, with the next log call
    # a script that never logs: what waits goes at end_training, at metrics_step()
    left = run(log=False, metrics_step=lambda: 7)
    assert [e["step"] for e in left] == [7] and _count(left, "checkpoint/save_s") == 3, left
    assert _metrics_rows(run(log_metrics=False)) == []


def test_accelerate_attached_accelerator_with_its_log_wrapped_still_pickles():
    """accelerator.log is an @on_main_process function named `_inner`: a bound method of it does not
    pickle, so the wrapper holds the class's method by name (Accelerate's own test_can_pickle_dataloader)."""
    pytest.importorskip("accelerate")
    import pickle

    from accelerate import Accelerator

    from accelerate_bytecheckpoint import attach

    acc = Accelerator(cpu=True)
    handle = attach(acc)
    copy = pickle.loads(pickle.dumps(acc))
    assert "log" in copy.__dict__ and copy.log({"x": 1.0}, step=1) is None
    handle.remove()
    assert "log" not in acc.__dict__


# ---------------------------------------------------------------------- transformers.Trainer
def _tiny():
    sys.path.insert(0, str(Path(__file__).parent / "transformers_scripts"))
    import tiny

    return tiny


def _on_log_recorder():
    from transformers import TrainerCallback

    class OnLog(TrainerCallback):
        def __init__(self):
            self.calls = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.calls.append({**logs, "step": state.global_step})

    return OnLog()


def test_trainer_metrics_reach_the_callbacks_and_console_not_log_history(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    tiny = _tiny()
    from transformers import Trainer

    from transformers_bytecheckpoint import attach

    def run(out, attached=True, resume=None, **kw):
        rec = _on_log_recorder()
        t = Trainer(model=tiny.tiny_gpt2(), args=tiny.training_args(str(out)), train_dataset=tiny.Tokens(),
                    callbacks=[rec])
        handle = attach(t, async_save=True, **kw) if attached else None
        t.train(resume_from_checkpoint=resume)
        if handle is not None:
            handle.remove()
        return t.state.log_history, rec.calls

    stock, _ = run(tmp_path / "stock", attached=False)
    history, calls = run(tmp_path / "a")
    same = lambda h: [sorted(k for k in e if "runtime" not in k and "per_second" not in k) for e in h]  # noqa: E731
    assert same(history) == same(stock) and _metrics_rows(history) == []
    ours = [c for c in calls if any(k.startswith("checkpoint/") for k in c)]
    assert ours and all(set(c) & {"loss", "train_runtime"} == set() for c in ours)   # entries of their own
    for c in ours:   # each right after one of the Trainer's own logs, at its step
        before = calls[calls.index(c) - 1]
        assert before["step"] == c["step"] and not any(k.startswith("checkpoint/") for k in before)
    assert _count(ours, "checkpoint/save_stall_s") == 3 and _count(ours, "checkpoint/save_s") == 3, ours
    assert "checkpoint/save_stall_s" in capsys.readouterr().out   # the console (PrinterCallback)
    _, calls = run(tmp_path / "a", resume=str(tmp_path / "a" / "checkpoint-4"))
    first = [c for c in calls if "checkpoint/load_s" in c]
    assert len(first) == 1 and first[0]["step"] == 5 and set(LOAD) <= set(first[0]), calls
    history, _ = run(tmp_path / "h", metrics_in_log_history=True)
    assert _count(history, "checkpoint/save_s") == 3 and sum("loss" in e for e in history) == 6
    monkeypatch.setenv("BCP_LOG_METRICS", "0")
    _, calls = run(tmp_path / "off")
    assert _metrics_rows(calls) == []


def test_trainer_report_to_tensorboard_gets_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import Trainer

    from transformers_bytecheckpoint import attach

    tiny = _tiny()
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = tiny.training_args(str(tmp_path / "out"), report_to=["tensorboard"], logging_steps=3)
    t = Trainer(model=tiny.tiny_gpt2(), args=args, train_dataset=tiny.Tokens())
    handle = attach(t, async_save=False)
    t.train()
    handle.remove()
    scalars = {}
    for events in (tmp_path / "tb").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.step for e in acc.Scalars(tag))
    # saves at 2, 4, 6 (each after that step's log); the Trainer logs at 3 and 6, and its final log at 6
    assert sorted(scalars["train/checkpoint/save_s"]) == [3, 6, 6], scalars
    assert sorted(scalars["train/loss"]) == [3, 6] and "train/checkpoint/save_stall_s" in scalars


def test_trainer_jit_checkpoint_from_a_step_end_keeps_the_steps_loss_log(tmp_path):
    """transformers' JIT checkpoint (SIGTERM) may run in JITCheckpointCallback.on_step_end, after
    DefaultFlowCallback set control.should_log: handing the save's metrics over must not drop the
    Trainer's own loss log of that step."""
    pytest.importorskip("transformers")
    tiny = _tiny()
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
        rec = _on_log_recorder()
        trainer = Trainer(model=tiny.tiny_gpt2(), args=tiny.training_args(str(out), enable_jit_checkpoint=True,
                                                                          save_steps=100),
                          train_dataset=tiny.Tokens(), callbacks=[RequestAtStep(), rec])
        handle = attach(trainer, async_save=True) if attached else None
        trainer.train()
        if handle is not None:
            handle.remove()
        return trainer.state.log_history, rec.calls

    trainer = None
    stock, _ = run(tmp_path / "stock", attached=False)
    history, calls = run(tmp_path / "a", attached=True)
    assert [e["step"] for e in history if "loss" in e] == [e["step"] for e in stock if "loss" in e] == [1, 2, 3]
    assert (3, ["checkpoint/save_bytes", "checkpoint/save_mb_s", "checkpoint/save_s", "checkpoint/save_stall_s",
                "checkpoint/save_write_s"]) in _metrics_rows(calls)   # the JIT save is synchronous


# ---------------------------------------------------------------------- the fold (core, pure)
def test_fold_sums_what_waits_for_one_log_step_and_counts_it():
    from bytecheckpoint.monitor.metrics import MAX_PENDING, MetricsFeed, fold

    a = {"checkpoint/save_stall_s": 0.1, "checkpoint/save_s": 1.0, "checkpoint/save_bytes": 2e6,
         "checkpoint/save_mb_s": 2.0, "checkpoint/saved_step": 4.0}
    b = {"checkpoint/save_stall_s": 0.3}
    c = {"checkpoint/load_s": 0.5, "checkpoint/load_bytes": 1e6, "checkpoint/load_mb_s": 2.0}
    assert fold([]) == {} and fold([a]) == a and fold([b, {}]) == b
    ab = fold([a, b])
    assert ab == {"checkpoint/save_stall_s": pytest.approx(0.4), "checkpoint/save_s": 1.0, "checkpoint/save_bytes": 2e6,
                  "checkpoint/save_mb_s": 2.0, "checkpoint/saved_step": 4.0, "checkpoint/saves": 2.0}
    abac = fold([ab, dict(a, **{"checkpoint/saved_step": 2.0}), c])
    assert abac["checkpoint/saves"] == 3.0 and abac["checkpoint/saves_completed"] == 2.0
    assert abac["checkpoint/save_mb_s"] == pytest.approx(2.0) and abac["checkpoint/saved_step"] == 4.0
    assert "checkpoint/loads" not in abac and abac["checkpoint/load_mb_s"] == 2.0
    feed = MetricsFeed()
    for _ in range(MAX_PENDING + 5):   # a framework that does not log for long: bounded, nothing lost
        feed.hold(b)
    assert len(feed._held) <= MAX_PENDING and feed.waiting
    assert feed.take()["checkpoint/saves"] == MAX_PENDING + 5 and not feed.waiting and feed.take() == {}
