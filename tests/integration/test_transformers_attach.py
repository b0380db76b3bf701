"""transformers_bytecheckpoint on one process, in-process Trainers (tiny GPT-2 with dropout, so RNG
state matters): resume bit-exact with the stock resume, a run switching to the adapter mid-way,
rotation, load_best_model_at_end, a grad scaler, save_only_model, attach/remove, clear errors;
and the JIT checkpoint on SIGTERM in a subprocess."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "transformers_scripts"
sys.path.insert(0, str(SCRIPTS))
REPO = Path(__file__).resolve().parents[2]

from tiny import Tokens, losses, tiny_gpt2, training_args, weights  # noqa: E402

transformers = pytest.importorskip("transformers")

import bytecheckpoint as bcp  # noqa: E402
from transformers_bytecheckpoint import TransformersCompatError, attach  # noqa: E402
from transformers_bytecheckpoint import _folders  # noqa: E402


def trainer(out: Path, model=None, **kw):
    from transformers import Trainer

    callbacks = kw.pop("callbacks", None)
    eval_dataset = kw.pop("eval_dataset", None)
    return Trainer(model=tiny_gpt2() if model is None else model, args=training_args(str(out), **kw),
                   train_dataset=Tokens(), eval_dataset=eval_dataset, callbacks=callbacks)


def run(out: Path, *, attached=None, resume=None, model=None, **kw):
    t = trainer(out, model, **kw)
    handle = attach(t, async_save=attached == "async") if attached else None
    t.train(resume_from_checkpoint=resume)
    result = {"weights": weights(t.model), "losses": losses(t), "step": t.state.global_step, "trainer": t}
    if handle is not None:
        handle.remove()
    return result


def same(a: dict, b: dict, what: str) -> None:
    for k in b["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), f"{what}: {k}"
    assert a["losses"] == b["losses"], f"{what}: {a['losses']} != {b['losses']}"
    assert a["step"] == b["step"], what


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    out = tmp_path_factory.mktemp("stock")
    full = run(out)
    resumed = run(out, resume=str(out / "checkpoint-4"))
    return out, full, resumed


def test_one_process_resume_bit_exact_with_stock_async(stock, tmp_path: Path) -> None:
    _, full, resumed = stock
    ours = run(tmp_path, attached="async")
    same(ours, full, "continuous")
    assert _folders.committed(bcp.Checkpointer(), str(tmp_path / "checkpoint-6"), {})
    # resumed from step 4: weights, optimizer, scheduler and RNG (dropout) back exactly
    same(run(tmp_path, attached="sync", resume=str(tmp_path / "checkpoint-4")), resumed, "resume from 4")


def test_switch_to_the_adapter_mid_way_from_a_stock_checkpoint(stock, tmp_path: Path) -> None:
    out, _, resumed = stock
    shutil.copytree(out / "checkpoint-4", tmp_path / "checkpoint-4")  # written by the stock Trainer
    ours = run(tmp_path, attached="async", resume=True)
    same(ours, resumed, "stock checkpoint resumed with the adapter")
    assert "model.safetensors" in os.listdir(tmp_path / "checkpoint-4")
    assert set(os.listdir(tmp_path / "checkpoint-6")) >= {"bytecheckpoint", "trainer_state.json", "model.safetensors"}
    assert "optimizer.pt" not in os.listdir(tmp_path / "checkpoint-6")
    assert os.stat(tmp_path / "checkpoint-6" / "model.safetensors").st_nlink == 2  # the checkpoint's own pack


def test_resume_true_without_committed_checkpoint_says_so(tmp_path: Path) -> None:
    (tmp_path / "checkpoint-2" / "bytecheckpoint").mkdir(parents=True)  # a save cut short
    t = trainer(tmp_path)
    attach(t)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        t.train(resume_from_checkpoint=True)


def test_explicit_torn_checkpoint_is_refused(tmp_path: Path) -> None:
    run(tmp_path, attached="sync")
    (tmp_path / "checkpoint-4" / "bytecheckpoint" / "metadata.json").unlink()
    t = trainer(tmp_path)
    attach(t)
    with pytest.raises(bcp.CheckpointError, match="metadata"):
        t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))


@pytest.mark.parametrize("limit", [1, 2])
def test_save_total_limit_rotation(stock, tmp_path: Path, limit: int) -> None:
    # async saves every step: while a save is in flight the newest committed folder is kept beside it;
    # once they commit (at the end of train()) the stock limit holds exactly
    _, full, _ = stock
    ours = run(tmp_path, attached="async", save_total_limit=limit, save_steps=1)
    same(ours, full, "run with rotation")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-5", "checkpoint-6"][2 - limit:]
    assert all(_folders.committed(bcp.Checkpointer(), str(tmp_path / f), {}) for f in os.listdir(tmp_path))


def _folder(run_dir: Path, step: int, committed: bool, mtime: float) -> Path:
    f = run_dir / f"checkpoint-{step}"
    with bcp.Checkpointer() as c:
        c.save(str(f / "bytecheckpoint"), {"x": torch.full((4,), float(step))}, step=step).wait()
    (f / "trainer_state.json").write_text("{}")
    if not committed:
        (f / "bytecheckpoint" / "metadata.json").unlink()
    for p in (f, f / "trainer_state.json"):
        os.utime(p, (mtime, mtime))
    return f


def test_rotation_keeps_newest_committed_and_in_flight(tmp_path: Path, monkeypatch) -> None:
    now = time.time()
    c2 = _folder(tmp_path, 2, True, now - 30)
    c4 = _folder(tmp_path, 4, True, now - 20)
    c6 = _folder(tmp_path, 6, False, now - 10)   # still being written by an async save
    c8 = _folder(tmp_path, 8, False, now)        # the newest, also being written
    ckpt = bcp.Checkpointer()
    monkeypatch.setattr(ckpt, "pending_paths", lambda: [str(c6 / "bytecheckpoint"), str(c8 / "bytecheckpoint")])
    # the stock rotation (limit 1) would keep checkpoint-8 only: no committed checkpoint left
    deleted = _folders.rotate(ckpt, str(tmp_path), 1, None, {})
    assert deleted == [str(c2)]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    # once the saves are done, the stock rule applies again
    monkeypatch.setattr(ckpt, "pending_paths", lambda: [])
    _folder(tmp_path, 8, True, now)
    assert _folders.rotate(ckpt, str(tmp_path), 1, None, {}) == [str(c4), str(c6)]
    # the best checkpoint is kept, as the stock rotation keeps it
    c10 = _folder(tmp_path, 10, True, now + 10)
    assert _folders.rotate(ckpt, str(tmp_path), 1, str(tmp_path / "checkpoint-8"), {}) == []
    assert _folders.rotate(ckpt, str(tmp_path), 1, None, {}) == [str(tmp_path / "checkpoint-8")]
    assert os.listdir(tmp_path) == [c10.name]
    ckpt.close()


def test_load_best_model_at_end_bit_exact_with_stock(tmp_path: Path) -> None:
    kw = dict(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
              save_total_limit=1, eval_dataset=Tokens(n=8, seed=99), learning_rate=3e-2)
    want = run(tmp_path / "stock", **kw)
    got = run(tmp_path / "bcp", attached="async", **kw)
    assert got["trainer"].state.best_model_checkpoint.endswith(
        os.path.basename(want["trainer"].state.best_model_checkpoint))
    same(got, want, "load_best_model_at_end")
    assert sorted(os.listdir(tmp_path / "bcp")) == sorted(os.listdir(tmp_path / "stock"))
    assert (tmp_path / "bcp" / os.path.basename(got["trainer"].state.best_model_checkpoint) / "bytecheckpoint").is_dir()


def test_grad_scaler_state_saved_and_restored(tmp_path: Path) -> None:
    """A GradScaler on the Accelerator (fp16 training): its scale and growth tracker come back as
    the stock scaler.pt gives them."""
    def scaled(out, **kw):
        t = trainer(out, **kw.pop("args", {}))
        t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
        return t

    results = {}
    for name in ("stock", "bcp"):
        t = scaled(tmp_path / name)
        h = attach(t) if name == "bcp" else None
        t.train()
        t2 = scaled(tmp_path / name)
        h2 = attach(t2) if name == "bcp" else None
        t2.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-4"))
        results[name] = (t2.accelerator.scaler.state_dict(), weights(t2.model))
        for handle in (h, h2):
            if handle is not None:
                handle.remove()
    assert "scaler.pt" in os.listdir(tmp_path / "stock" / "checkpoint-4")
    assert "scaler" in bcp.load_full(str(tmp_path / "bcp" / "checkpoint-4" / "bytecheckpoint"), keys=["scaler"])
    assert results["bcp"][0] == results["stock"][0] and results["bcp"][0]["scale"] != 2.0 ** 8
    for k, v in results["stock"][1].items():
        assert torch.equal(results["bcp"][1][k], v), k


def test_save_only_model_saves_the_model_only(tmp_path: Path) -> None:
    run(tmp_path, attached="sync", save_only_model=True)
    saved = bcp.load_full(str(tmp_path / "checkpoint-4" / "bytecheckpoint"))
    assert set(saved) == {"model", "trainer"} and "rng" not in saved["trainer"] and "rng_per_rank" not in saved["trainer"]


def test_attach_remove_and_errors(tmp_path: Path) -> None:
    from transformers import Trainer

    t = trainer(tmp_path)
    before = dict(t.__dict__)
    handle = attach(t, async_save=True)
    assert t.__dict__["_save_checkpoint"].func.__self__ is handle
    with pytest.raises(RuntimeError, match="already attached"):
        attach(t)
    handle.remove()
    assert "_save_checkpoint" not in t.__dict__ and t.__dict__.keys() == before.keys()
    with pytest.raises(TypeError, match="expects a transformers.Trainer"):
        attach(object())
    with pytest.raises(TypeError, match="must be a bytecheckpoint.Checkpointer"):
        attach(t, checkpointer="nope")

    class Changed(Trainer):
        def _load_rng_state(self, path, extra):  # another signature than the tested version's
            pass

    bad = Changed(model=tiny_gpt2(), args=training_args(str(tmp_path)), train_dataset=Tokens())
    with pytest.raises(TransformersCompatError, match=r"Trainer\._load_rng_state .*tested with transformers"):
        attach(bad)


def test_shared_checkpointer_not_closed_by_remove(tmp_path: Path) -> None:
    with bcp.Checkpointer(async_save=True) as ckpt:
        t = trainer(tmp_path)
        handle = attach(t, checkpointer=ckpt)
        t.train()
        handle.remove()
        assert not ckpt.closed and ckpt.is_checkpoint(str(tmp_path / "checkpoint-6" / "bytecheckpoint"))


# ---------------------------------------------------------------------------------------- JIT checkpoint

def _jit(*args: str, timeout: float = 120) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "jit_run.py"), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_jit_checkpoint_on_sigterm_is_committed_before_exit_and_resumes(tmp_path: Path) -> None:
    out = _jit(str(tmp_path), "--attach", "async")
    m = re.search(r"JIT (checkpoint-\d+) ([0-9.]+) stopped at (\d+)", out)
    assert m, out[-3000:]
    folder = tmp_path / m.group(1)
    assert not (folder / "checkpoint-is-incomplete.txt").exists()
    assert bcp.verify(str(folder / "bytecheckpoint")).ok
    assert bcp.load_full(str(folder / "bytecheckpoint"), keys=["trainer"])["trainer"]["global_step"] == int(
        m.group(1).split("-")[1])
    # every folder the run wrote (its async saves too) is committed: the process left with os._exit
    for f in os.listdir(tmp_path):
        assert _folders.committed(bcp.Checkpointer(), str(tmp_path / f), {}), f
    assert "RESUMED 40" in _jit(str(tmp_path), "--attach", "async", "--resume")


class _OrderModel(torch.nn.Module):
    """Logs the data order in a buffer that grows every step, and overrides load_state_dict to
    resize it on load (as transformers' own test_resume_batch_order model does)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4, bias=False)
        self.register_buffer("data_order", torch.empty(0, dtype=torch.long))

    def load_state_dict(self, state_dict, strict=True):
        if "data_order" in state_dict and self.data_order.shape != state_dict["data_order"].shape:
            self.data_order = state_dict["data_order"].clone()
        return super().load_state_dict(state_dict, strict=strict)

    def forward(self, input_ids, labels=None):
        self.data_order = torch.cat([self.data_order, input_ids[:, 0].long()])
        logits = self.fc(input_ids)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class _Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))
        self.x[:, 0] = torch.arange(10)
        self.y = torch.randint(0, 4, (10,), generator=torch.Generator().manual_seed(4))

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def test_model_overriding_load_state_dict_is_loaded_through_it(tmp_path: Path) -> None:
    """The stock Trainer loads weights with model.load_state_dict(sd, False): a model that overrides
    it (here: resizing a buffer that grows every step) is loaded through it with the adapter too."""
    from transformers import Trainer, set_seed

    def order(out: Path, attached: bool, resume=None):
        set_seed(0)
        t = Trainer(model=_OrderModel(), args=training_args(str(out), max_steps=8, save_steps=1, optim="sgd",
                                                              learning_rate=0.1), train_dataset=_Rows())
        h = attach(t) if attached else None
        t.train(resume_from_checkpoint=resume)
        if h is not None:
            h.remove()
        return t.model.data_order.clone()

    for attached in (False, True):
        out = tmp_path / ("bcp" if attached else "stock")
        full = order(out, attached)
        resumed = order(out, attached, resume=str(out / "checkpoint-5"))
        assert torch.equal(resumed, full), (attached, resumed, full)
    assert (tmp_path / "bcp" / "checkpoint-5" / "bytecheckpoint").is_dir()


# ---------------------------------------------------------------------------------------- PEFT (LoRA)

def _lora_run(out: Path, **kw):
    from tiny import tiny_lora

    return run(out, model=tiny_lora(), **kw)


def test_lora_load_best_model_at_end_bit_exact_with_stock(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    # "best" = the highest eval loss: an early checkpoint, so loading it changes the weights
    kw = dict(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
              greater_is_better=True, save_total_limit=1, eval_dataset=Tokens(n=8, seed=99), learning_rate=3e-2)
    want = _lora_run(tmp_path / "stock", **kw)
    got = _lora_run(tmp_path / "bcp", attached="async", **kw)
    best = os.path.basename(want["trainer"].state.best_model_checkpoint)
    assert best != "checkpoint-6" and got["trainer"].state.best_model_checkpoint.endswith(best)
    same(got, want, "LoRA load_best_model_at_end")  # the best adapter loaded, as the stock load_adapter does
    assert sorted(os.listdir(tmp_path / "bcp")) == sorted(os.listdir(tmp_path / "stock"))


def test_lora_checkpoint_saved_with_the_whole_model_still_resumes(tmp_path: Path, monkeypatch) -> None:
    """A PEFT run's checkpoint from before adapter-only saves (the whole PeftModel under 'model')
    resumes as before, bit for bit as the stock resume."""
    pytest.importorskip("peft")
    from transformers_bytecheckpoint import _peft

    want = _lora_run(tmp_path / "stock", resume=None)
    want = _lora_run(tmp_path / "stock", resume=str(tmp_path / "stock" / "checkpoint-4"))
    with monkeypatch.context() as m:
        m.setattr(_peft, "model_of", lambda trainer, route: None)  # the adapter as it was: the whole model
        _lora_run(tmp_path / "bcp", attached="sync")
    saved = {t.name.split("/")[0] for t in bcp.inspect(str(tmp_path / "bcp" / "checkpoint-4" / "bytecheckpoint")).tensors}
    assert "model" in saved and "adapter" not in saved
    got = _lora_run(tmp_path / "bcp", attached="sync", resume=str(tmp_path / "bcp" / "checkpoint-4"))
    same(got, want, "resume of a whole-model PEFT checkpoint")
    saved = {t.name.split("/")[0] for t in bcp.inspect(str(tmp_path / "bcp" / "checkpoint-6" / "bytecheckpoint")).tensors}
    assert saved == {"adapter", "optimizer"}  # its new checkpoints are adapter-only


def test_torch_compile_checkpoints_resume_into_plain_runs_and_back(tmp_path: Path) -> None:
    """torch_compile=True (backend eager: the names do not depend on the backend): the checkpoint's
    names are the model's own, so a plain run resumes a compiled run's checkpoint and the other way
    round, as the stock Trainer's checkpoints do."""
    compiled = dict(torch_compile=True, torch_compile_backend="eager")
    run(tmp_path / "c", attached="sync", **compiled)
    names = {t.name for t in bcp.inspect(str(tmp_path / "c" / "checkpoint-4" / "bytecheckpoint")).tensors}
    assert "model/transformer.wte.weight" in names and not any("_orig_mod" in n for n in names)
    want = run(tmp_path / "stock")
    want = run(tmp_path / "stock", resume=str(tmp_path / "stock" / "checkpoint-4"))
    got = run(tmp_path / "c", attached="sync", resume=str(tmp_path / "c" / "checkpoint-4"))  # compiled -> plain
    same(got, want, "plain resume of a compiled run")
    run(tmp_path / "p", attached="sync")
    got = run(tmp_path / "p", attached="sync", resume=str(tmp_path / "p" / "checkpoint-4"), **compiled)
    assert got["step"] == 6 and got["losses"][-2:] == want["losses"][-2:]  # plain -> compiled


def test_adapter_state_dict_is_peft_s_own_and_follows_changes_to_the_model() -> None:
    """What an adapter save writes is get_peft_model_state_dict's dict (names and the model's own
    tensors), also when it is kept between saves, and it is computed again when the model changes."""
    pytest.importorskip("peft")
    from peft.utils import get_peft_model_state_dict
    from tiny import tiny_lora
    from transformers_bytecheckpoint._peft import _saving_state_dict

    model = tiny_lora()
    view = _saving_state_dict(model, "default")

    def check():
        got, want = view(), get_peft_model_state_dict(model)
        assert got.keys() == want.keys()
        assert all(got[k].data_ptr() == want[k].data_ptr() and torch.equal(got[k], want[k]) for k in want)
        return got
    first = check()
    assert check().keys() == first.keys() and view.fingerprint is not None  # kept
    lora = model.base_model.model.transformer.h[0].attn.c_attn.lora_A
    lora["default"].weight = torch.nn.Parameter(torch.ones_like(lora["default"].weight))  # a replaced tensor
    assert torch.equal(check()["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"],
                       torch.ones_like(lora["default"].weight))
    model.resize_token_embeddings(80)  # another vocabulary: peft then saves the embeddings too ("auto")
    check()
    import gc
    import weakref

    gone = weakref.ref(model)
    del model, lora, first, view
    gc.collect()
    assert gone() is None  # what is kept between saves does not keep the model alive
