"""Async staging (issue 34): the optimizers' tensors are copied behind the next forward/backward and
their step() is the only fence; a tensor changed outside the step while its copy was pending fails
the save. Every hazard runs with the background copy *held* (the test decides when it lands), so a
build without the fence or the guard commits a torn checkpoint and these tests fail; each compares
a load of the checkpoint bit for bit with a deep copy of the state taken right before save().
"""
from __future__ import annotations

import copy
import os
import threading
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.pipeline import gate, guards, stage


class Held:
    """The deferred copies wait for release(); `started`/`done` tell where they are."""

    def __init__(self, monkeypatch, fail: bool = False):
        self.release_event, self.started, self.done = threading.Event(), threading.Event(), threading.Event()
        original = stage.copy_deferred

        def held(pairs):
            self.started.set()
            assert self.release_event.wait(60), "test never released the copy"
            if fail:
                raise OSError("injected copy failure")
            original(pairs)
            self.done.set()
        monkeypatch.setattr(stage, "copy_deferred", held)

    def release(self, after_s: float = 0.0) -> None:
        if after_s:
            threading.Timer(after_s, self.release_event.set).start()
        else:
            self.release_event.set()


def model(bn: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256)] + ([torch.nn.BatchNorm1d(256)] if bn else []) + [torch.nn.ReLU(),
                                                                                           torch.nn.Linear(256, 256)]
    return torch.nn.Sequential(*layers)


X = torch.randn(32, 256)


def train_step(m, opt, *, step: bool = True) -> None:
    m.train()
    m(X).square().mean().backward()
    if step:
        opt.step()
        opt.zero_grad()


def snapshot(m, opt) -> dict:
    return copy.deepcopy({"model": m.state_dict(), "optim": opt.state_dict()["state"]})


def assert_saved(ckpt, path, ref) -> None:
    got = ckpt.load_full(path)
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), f"model {k} differs from the state at save()"
    saved = got["optim"]["state"]
    assert len(saved) == len(ref["optim"])
    for (name, st), ref_st in zip(saved.items(), ref["optim"].values()):
        for k, v in ref_st.items():
            assert same(st[k], v), f"optimizer state {name}/{k} differs"


def same(a, b) -> bool:
    if isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), b)
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def ckpt():
    c = bcp.Checkpointer(async_save=True, async_staging=True)
    yield c
    c.close()


@pytest.mark.parametrize("kind", ["single", "foreach", "fused"])
def test_training_goes_on_at_once_and_the_step_is_the_fence(tmp_path, monkeypatch, ckpt, kind):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, **{"single": {"foreach": False}, "foreach": {"foreach": True},
                                                       "fused": {"fused": True}}[kind])
    train_step(m, opt)
    ref = snapshot(m, opt)
    held = Held(monkeypatch)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    assert h.stats["async_staging"] and h.stats["deferred_bytes"] > 0
    train_step(m, opt, step=False)  # forward (BatchNorm statistics change: copied before save returned) + backward
    assert not held.done.is_set(), "forward/backward waited for the copy"
    held.release(after_s=0.3)
    opt.step()  # must wait for the copy
    assert held.done.is_set(), "the step ran before its tensors' copy landed"
    opt.zero_grad()
    train_step(m, opt)
    h.wait()
    assert h.stats["fence_wait_s"] > 0
    assert_saved(ckpt, tmp_path / "a", ref)


def test_only_the_saved_optimizers_step_waits(tmp_path, monkeypatch, ckpt):
    m, other = model(bn=False), model(bn=False)
    opt, other_opt = torch.optim.AdamW(m.parameters()), torch.optim.SGD(other.parameters(), lr=0.1)
    train_step(m, opt)
    ref = snapshot(m, opt)
    held = Held(monkeypatch)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    for _ in range(4):  # gradient accumulation: forwards and backwards, no step, no wait
        train_step(m, opt, step=False)
    train_step(other, other_opt)  # not in the state: its step never waits
    assert not held.done.is_set()
    held.release(after_s=0.2)
    opt.step()
    assert held.done.is_set()
    h.wait()
    assert_saved(ckpt, tmp_path / "a", ref)


class Sam(torch.optim.SGD):
    """Not torch's own: changes the parameters before calling its closure (SAM-style)."""
    __module__ = "user_optimizers"

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(0.01)
        with torch.enable_grad():
            closure()
        return super().step()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.LBFGS, Sam])
def test_closure_runs_beside_the_copy_for_torch_optimizers(tmp_path, monkeypatch, ckpt, cls):
    m = model(bn=False)
    opt = cls(m.parameters(), lr=0.01)
    seen = []
    held = None

    def closure():
        seen.append(held is not None and held.done.is_set())
        opt.zero_grad()
        loss = m(X).square().mean()
        loss.backward()
        return loss
    opt.step(closure)
    ref = snapshot(m, opt)
    seen.clear()
    held = Held(monkeypatch)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    held.release(after_s=0.3)
    opt.step(closure)  # Lightning's shape: forward + backward inside step(closure)
    if cls is Sam:
        assert seen[0] is True, "an optimizer not known to call its closure first must wait before it"
    else:
        assert seen[0] is False, "the closure (forward + backward) should run while the copy is pending"
    assert held.done.is_set()
    h.wait()
    assert_saved(ckpt, tmp_path / "a", ref)


@pytest.mark.parametrize("edit", ["param", "moment", "detached"])
def test_inplace_edit_outside_the_step_fails_the_save(tmp_path, monkeypatch, ckpt, edit):
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    ckpt.save(tmp_path / "before", {"model": m, "optim": opt}).wait()
    held = Held(monkeypatch)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    w = m[0].weight
    with torch.no_grad():
        if edit == "param":
            w.mul_(0.5)               # e.g. weight clipping or an EMA written into the model
        elif edit == "moment":
            opt.state[w]["exp_avg"].zero_()
        else:
            m.state_dict()["0.weight"].add_(1.0)
    held.release()
    with pytest.raises(bcp.CheckpointError) as err:
        h.wait()
    text = str(err.value)
    assert "0.weight" in text and "async_staging=False" in text and "not committed" in text, text
    assert not ckpt.is_checkpoint(tmp_path / "a")
    ckpt.load_full(tmp_path / "before")  # the previous checkpoint is intact


def test_edit_after_the_copy_landed_is_safe(tmp_path, ckpt):
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    ref = snapshot(m, opt)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    ckpt._fence.drain()
    with torch.no_grad():
        m[0].weight.mul_(0.5)
    h.wait()
    assert_saved(ckpt, tmp_path / "a", ref)


def test_data_inplace_is_a_documented_blind_spot(tmp_path, monkeypatch, ckpt):
    """`p.data.<op>_()` moves no version counter (docs/async_staging.md): undetectable, so such code
    must save with async_staging=False. If torch starts counting it, this test tells us."""
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    held = Held(monkeypatch)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    version = m[0].weight._version
    m[0].weight.data.mul_(0.5)
    assert m[0].weight._version == version
    held.release()
    h.wait()


def test_ema_and_swa_models_are_copied_before_save_returns(tmp_path, monkeypatch, ckpt):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    m = model()
    opt = torch.optim.AdamW(m.parameters())
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    train_step(m, opt)
    ema.update_parameters(m)
    ref_ema = copy.deepcopy(ema.state_dict())
    held = Held(monkeypatch)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt, "ema": ema})
    ema.update_parameters(m)  # right after save: no optimizer guards it
    held.release()
    h.wait()
    got = ckpt.load_full(tmp_path / "a", keys=["ema"])["ema"]
    for k, v in ref_ema.items():
        assert torch.equal(got[k], v), k


def test_grad_scaler_skipped_step_does_not_wait(tmp_path, monkeypatch, ckpt):
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    scaler = torch.amp.GradScaler("cpu")

    def scaled_step(inf: bool) -> None:
        scaler.scale(m(X).square().mean()).backward()
        if inf:
            m[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaled_step(False)
    ref = snapshot(m, opt)
    held = Held(monkeypatch)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt, "scaler": scaler})
    scaled_step(True)  # inf: GradScaler skips optimizer.step -> no change, no wait
    assert not held.done.is_set()
    held.release(after_s=0.2)
    scaled_step(False)
    assert held.done.is_set()
    h.wait()
    assert_saved(ckpt, tmp_path / "a", ref)


def test_second_save_before_the_first_landed(tmp_path, monkeypatch, ckpt):
    m = model()
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    ref = snapshot(m, opt)
    held = Held(monkeypatch)
    a = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    b = ckpt.save(tmp_path / "b", {"model": m, "optim": opt})  # no wait in save()
    held.release(after_s=0.2)
    train_step(m, opt)
    a.wait(), b.wait()
    assert_saved(ckpt, tmp_path / "a", ref)
    assert_saved(ckpt, tmp_path / "b", ref)


def test_load_into_the_live_state_waits_for_pending_copies(tmp_path, monkeypatch, ckpt):
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    ckpt.save(tmp_path / "old", {"model": m, "optim": opt}).wait()
    train_step(m, opt)
    ref = snapshot(m, opt)
    held = Held(monkeypatch)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    held.release(after_s=0.2)
    ckpt.load(tmp_path / "old", {"model": m, "optim": opt})  # writes the live tensors: only after the copy
    h.wait()
    assert_saved(ckpt, tmp_path / "a", ref)


def test_a_failed_copy_releases_the_step_and_fails_the_save(tmp_path, monkeypatch, ckpt):
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    held = Held(monkeypatch, fail=True)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    held.release(after_s=0.1)
    train_step(m, opt)  # must not hang
    with pytest.raises(bcp.CheckpointError, match="injected copy failure"):
        h.wait()
    assert not ckpt.is_checkpoint(tmp_path / "a")


def test_close_drains_and_releases_the_fence(tmp_path, monkeypatch):
    c = bcp.Checkpointer(async_save=True, async_staging=True)
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    held = Held(monkeypatch)
    c.save(tmp_path / "a", {"model": m, "optim": opt})
    assert c._fence in gate._FENCES and gate.hook_installed() and gate._HELD
    held.release(after_s=0.2)
    c.close()  # waits for the copy, then the save
    assert held.done.is_set() and c._fence not in gate._FENCES and not gate._HELD
    with bcp.Checkpointer() as reader:
        assert reader.is_checkpoint(tmp_path / "a")


def _hook_tables():
    from torch.optim import optimizer as o
    return list(o._global_optimizer_pre_hooks), list(o._global_optimizer_post_hooks)


def test_hooks_are_never_registered_or_removed_beside_a_step(tmp_path):
    """torch iterates its global step-hook tables on the stepping thread; a hook registered or removed
    meanwhile (a save or close on another thread, a warm-up trigger armed or fired) raised "OrderedDict
    mutated during iteration" in the training step. Saves, closes and triggers from another thread,
    while a step sits in a (user's) global pre-hook and then post-hook, leave both tables alone."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    engines = {phase: bcp.Checkpointer(async_save=True, async_staging=True) for phase in ("pre", "post")}  # setup
    tables = _hook_tables()
    inside = {"pre": threading.Event(), "post": threading.Event()}
    go = {"pre": threading.Event(), "post": threading.Event()}

    def blocking(phase):
        def hook(*_):
            inside[phase].set()
            assert go[phase].wait(30)
        return hook

    def after(*_):  # any hook behind the blocked one (another library's): torch's iterator moves on to it
        return None
    user = [register_optimizer_step_pre_hook(blocking("pre")), register_optimizer_step_pre_hook(after),
            register_optimizer_step_post_hook(blocking("post")), register_optimizer_step_post_hook(after)]
    errors, handles = [], []

    def step() -> None:
        try:
            train_step(m, opt)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    stepper = threading.Thread(target=step)
    try:
        stepper.start()
        for phase in ("pre", "post"):
            assert inside[phase].wait(30)
            second = bcp.Checkpointer(async_save=True, async_staging=True)  # another engine, made and closed
            handles.append(engines[phase].save(tmp_path / phase, {"model": m, "optim": opt}))  # deferred copies
            trigger = gate.AfterFirstSteps(lambda _: [opt], lambda _: None, owner=second)
            trigger.remove()
            gate.AfterFirstSteps(lambda _: None, lambda _: None, owner=second)  # disarms at its first call
            second.close()
            go[phase].set()
        stepper.join(30)
        assert not errors, errors
        assert _hook_tables() == (tables[0] + [user[0].id, user[1].id], tables[1] + [user[2].id, user[3].id])
        try:  # saved in the middle of a step, before its update: copied before it, or failed by the guard
            handles[0].wait()
        except bcp.CheckpointError as exc:
            assert "changed in place" in str(exc), exc
        handles[1].wait()  # saved after the update
    finally:
        for e in go.values():
            e.set()
        for handle in user:
            handle.remove()
        for engine in engines.values():
            try:
                engine.close()
            except bcp.CheckpointError:
                pass  # the 'pre' save's failure (checked above)


@pytest.mark.parametrize("first", [True, False], ids=["first_save", "later_save"])
def test_a_save_inside_the_closure_holds_that_update(tmp_path, monkeypatch, ckpt, first):
    """A checkpoint taken from training_step (Lightning: inside step(closure)) is pending when the
    update comes: the update waits for its copies too (fused AdamW moves no version counter, so the
    guard could not tell), also when it is the process's first deferred save (the step's pre-hook ran
    before any copy was pending: review found that closure unwrapped and the checkpoint torn)."""
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
    train_step(m, opt)
    if not first:
        ckpt.save(tmp_path / "warm", {"model": m, "optim": opt}).wait()  # async staging in use in this process
    held = Held(monkeypatch)
    saved = {}

    def closure():
        opt.zero_grad()
        loss = m(X).square().mean()
        loss.backward()
        saved["ref"] = snapshot(m, opt)
        saved["h"] = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
        held.release(after_s=0.3)
        return loss
    opt.step(closure)
    assert held.done.is_set(), "the update ran before the copies of a save made in its closure landed"
    saved["h"].wait()
    assert_saved(ckpt, tmp_path / "a", saved["ref"])


def test_a_copy_that_never_lands_fails_the_save_once(tmp_path, monkeypatch):
    """A step waits at most timeout_s; then the save fails and later steps are not held again."""
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    with bcp.Checkpointer(async_save=True, async_staging=True, timeout_s=1) as c:
        held = Held(monkeypatch)
        h = c.save(tmp_path / "a", {"model": m, "optim": opt})
        t0 = time.perf_counter()
        train_step(m, opt)  # held 1 s, then goes on
        t1 = time.perf_counter()
        train_step(m, opt)
        assert 0.9 < t1 - t0 and time.perf_counter() - t1 < 0.5, (t1 - t0, time.perf_counter() - t1)
        held.release()
        with pytest.raises(bcp.CheckpointError, match="did not land"):
            h.wait()
        assert not c.is_checkpoint(tmp_path / "a")


def test_a_job_that_fails_before_its_copies_releases_the_step(tmp_path, monkeypatch):
    from bytecheckpoint.pipeline import commit

    def broken(self):
        raise OSError("injected: no heartbeat")
    monkeypatch.setattr(commit.MarkerBoard, "heartbeat", broken)
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    with bcp.Checkpointer(async_save=True, async_staging=True, timeout_s=60) as c:
        h = c.save(tmp_path / "a", {"model": m, "optim": opt})
        t0 = time.perf_counter()
        train_step(m, opt)
        assert time.perf_counter() - t0 < 10, "the step waited for copies no job makes"
        with pytest.raises(Exception, match="no heartbeat"):
            h.wait()


def test_warm_up_trigger_fires_once_and_disarms(monkeypatch):
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    owner = type("Owner", (), {})()
    fired = []
    trigger = gate.AfterFirstSteps(lambda o: [opt], fired.append, owner=owner)
    train_step(m, opt, step=False)
    assert trigger.armed and not fired
    train_step(m, opt)
    train_step(m, opt)
    assert fired == [owner] and not trigger.armed
    zero = type("Zero", (), {})()  # never a torch optimizer whose step runs the hooks (DeepSpeed's ZeRO)

    class Wrapper(torch.optim.Optimizer):  # Accelerate's wrapper around it: no Optimizer.__init__
        def __init__(self, inner):
            self.optimizer = inner

        def step(self, closure=None):
            pass
    never = gate.AfterFirstSteps(lambda o: [Wrapper(zero)], fired.append, owner=owner)
    train_step(m, opt)
    assert not never.armed and fired == [owner]  # disarmed: it would be called at every step forever
    assert guards.optimizers_in({"optim": Wrapper(zero)}) == []  # its tensors are copied before save() returns


def test_off_and_auto_on_cpu_copy_everything_before_returning(tmp_path):
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    for mode in ("auto", False):
        with bcp.Checkpointer(async_save=True, async_staging=mode) as c:
            h = c.save(tmp_path / str(mode), {"model": m, "optim": opt})
            assert h.stats["async_staging"] is False and h.stats["deferred_bytes"] == 0
            h.wait()


def test_guards_match_storages():
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    w, b = m[0].weight, m[0].bias
    held = guards.Guards(guards.optimizers_in({"o": opt}))
    assert held.of(w.detach()).guard.optimizer is opt                       # a state_dict's detach()
    assert held.of(w.detach()[:128]) is not None                             # a view (a box of it)
    assert held.of(opt.state[w]["exp_avg"]) is not None
    assert held.of(b.detach()) is None                                      # small: copied now
    assert held.of(torch.zeros_like(w)) is None                             # not the optimizer's
    twice = guards.Guards(guards.optimizers_in({"a": opt, "b": torch.optim.SGD([w], lr=1)}))
    capturable = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(256, 256))], capturable=True)
    assert not guards.Guards(guards.optimizers_in({"o": capturable}))          # a CUDA-graph step: copied now
    assert twice.of(w.detach()) is None                                       # two optimizers: nobody's
    class Wrapped(torch.optim.Optimizer):  # Accelerate's AcceleratedOptimizer: no Optimizer.__init__
        def __init__(self, inner):
            self.optimizer = inner
    wrapped = Wrapped(opt)
    (found,) = guards.optimizers_in({"optim": wrapped})
    assert found[0] is opt and id(wrapped) in found[1]                        # the hook sees the inner one
    zero = type("ZeroOptimizer", (), {"optimizer": opt})()                     # DeepSpeed's: not a torch optimizer
    assert guards.optimizers_in({"optim": zero}) == []


def test_options_and_environment():
    o = bcp.Options.from_env({"BCP_ASYNC_STAGING": "1", "BCP_DIRECT_IO": "off"})
    assert (o.async_staging, o.direct_io) == (True, False)
    assert bcp.Options().async_staging == "auto" and bcp.Options().direct_io == "auto"
    with pytest.raises(bcp.CheckpointError, match="BCP_ASYNC_STAGING"):
        bcp.Options.from_env({"BCP_ASYNC_STAGING": "maybe"})
    with pytest.raises(bcp.CheckpointError, match="direct_io"):
        bcp.Options(direct_io="yes")


def test_background_warm_up_allocates_off_the_caller(tmp_path):
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    with bcp.Checkpointer(async_save=True, async_staging=True) as c:
        future = c.warm_up({"model": m, "optim": opt}, background=True)
        assert future.result(60) > 0
        h = c.save(tmp_path / "a", {"model": m, "optim": opt})
        assert h.stats["copies_started_early"]
        h.wait()


# ---------------------------------------------------------------------------------- O_DIRECT pack writes

def _takes_o_direct(directory) -> bool:
    try:
        fd = os.open(os.path.join(directory, ".probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(os.path.join(directory, ".probe"))
    return True


def direct_writes(monkeypatch) -> list:
    """The sizes of the files written through the O_DIRECT path from now on (in this test)."""
    from bytecheckpoint.storage import posix
    sizes = []
    finish = posix._DirectWriter.finish

    def counted(self):
        sizes.append(self.size)
        finish(self)
    monkeypatch.setattr(posix._DirectWriter, "finish", counted)
    return sizes


def test_direct_writes_are_byte_identical_to_buffered(tmp_path):
    from bytecheckpoint.storage.posix import BOUNCE_BYTES, PosixStorage
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (BOUNCE_BYTES * 2 + 12345,), dtype=torch.uint8, generator=g)
    aligned = torch.empty(3 << 20, dtype=torch.uint8)  # a page-aligned part goes straight from its buffer
    aligned = aligned[(-aligned.data_ptr()) % 4096:][: 2 << 20].copy_(raw[: 2 << 20])
    parts = [raw[:100], raw[100:5000], aligned, raw[7:BOUNCE_BYTES + 9], raw[1:2], raw[3:4099], raw[:0]]
    direct = PosixStorage("d", str(tmp_path / "d") + "/", direct_io="auto")
    buffered = PosixStorage("b", str(tmp_path / "b") + "/", direct_io=False)
    for store in (direct, buffered):
        store.write_parts("x/pack.bin", [memoryview(p.numpy()) for p in parts]).result()
    want = b"".join(p.numpy().tobytes() for p in parts)
    for store in (direct, buffered):
        with open(store._path("x/pack.bin"), "rb") as f:
            assert f.read() == want
    assert direct._direct_ok is _takes_o_direct(tmp_path / "d" / "x")


def test_checkpoint_files_are_the_same_with_and_without_direct_io(tmp_path, monkeypatch):
    """Pack files (plain and format 6 safetensors ones) of the same state, written with O_DIRECT and
    buffered: the same bytes and the same file modes; the O_DIRECT path really wrote them."""
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(1024, 512), "big": torch.randn(700, 1000)}
    direct = direct_writes(monkeypatch)
    if not _takes_o_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    umask = os.umask(0o002)  # a group-writable umask (shared clusters): both modes follow it
    try:
        for mode in (True, False):
            with bcp.Checkpointer(direct_io=mode) as c:
                c.save(tmp_path / str(mode), state, safetensors=["model"])
            if mode is True:
                written_direct = len(direct)
    finally:
        os.umask(umask)
    assert written_direct >= 2 and len(direct) == written_direct, direct  # the plain and the safetensors pack
    packs = {}
    for mode in ("True", "False"):
        (data,) = [d for d in os.listdir(tmp_path / mode) if d.startswith("data-")]
        folder = tmp_path / mode / data / "pack"
        packs[mode] = {n: ((folder / n).read_bytes(), os.stat(folder / n).st_mode) for n in sorted(os.listdir(folder))}
    assert packs["True"] == packs["False"]
    assert any(n.endswith(".safetensors") for n in packs["True"]) and sum(len(b) for b, _ in packs["True"].values()) > (4 << 20)


def test_auto_bypasses_the_page_cache_for_sync_and_async_saves(tmp_path, monkeypatch):
    """direct_io="auto": every save's big packs are written with O_DIRECT (an async save's background
    write competes with training for the CPU; a sync save in a steady loop was slowed by the writeback
    of the ones before it: benchmarks/bench_steady.py); direct_io=False writes them buffered."""
    if not _takes_o_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    direct = direct_writes(monkeypatch)
    state = {"big": torch.randn(700, 1000)}
    with bcp.Checkpointer() as c:
        c.save(tmp_path / "sync", state)
        assert len(direct) >= 1
        c.save(tmp_path / "async", state, async_save=True).wait()
        assert len(direct) >= 2
        out = {"big": torch.zeros(700, 1000)}
        c.load(tmp_path / "sync", out)  # read back from the device, not the page cache
        assert torch.equal(out["big"], state["big"])
    before = len(direct)
    with bcp.Checkpointer(direct_io=False) as c:
        c.save(tmp_path / "buffered", state)
        c.save(tmp_path / "buffered_async", state, async_save=True).wait()
    assert len(direct) == before


@pytest.mark.parametrize("where", ["open", "first write"])
def test_a_file_system_that_refuses_o_direct(tmp_path, monkeypatch, where):
    """tmpfs before Linux 6.6, some FUSE and network file systems: EINVAL at open or at the first
    aligned write. "auto" remembers it and writes buffered (same bytes); True is an error."""
    import errno
    from bytecheckpoint.storage import posix
    real_open = os.open

    def refusing_open(path, flags, *a):
        if where == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    def refusing_pwrite(fd, data, offset):
        raise OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(posix.os, "open", refusing_open)
    if where == "first write":
        monkeypatch.setattr(posix.os, "pwrite", refusing_pwrite)  # only the O_DIRECT path uses pwrite
    part = memoryview(bytes(range(256)) * 8192)
    auto = posix.PosixStorage("auto", str(tmp_path / "a") + "/", direct_io="auto")
    auto.write_parts("p.bin", [part]).result()
    auto.write_parts("q.bin", [part]).result()
    assert auto._direct_ok is False
    assert (tmp_path / "a" / "p.bin").read_bytes() == bytes(part) == (tmp_path / "a" / "q.bin").read_bytes()
    strict = posix.PosixStorage("strict", str(tmp_path / "s") + "/", direct_io=True)
    with pytest.raises(bcp.CheckpointError, match="direct_io='auto'"):
        strict.write_parts("p.bin", [part]).result()


@pytest.mark.timeout(180)
def test_saves_right_after_a_background_warm_up_never_wait_for_it(tmp_path):
    """The warm-up may wait for a slot a save holds; the save's job must not wait for the warm-up."""
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    with bcp.Checkpointer(async_save=True, async_staging=True) as c:
        for round_ in range(3):
            first = c.save(tmp_path / f"{round_}-a", {"model": m, "optim": opt})  # holds slot 0 while it writes
            future = c.warm_up({"model": m, "optim": opt}, background=True)  # waits for slot 0, then slot 1
            handles = [first] + [c.save(tmp_path / f"{round_}-{i}", {"model": m, "optim": opt}) for i in range(2)]
            for h in handles:
                h.wait(timeout=60)
            future.result(60)


def test_a_load_by_another_checkpointer_waits_for_pending_copies(tmp_path, monkeypatch, ckpt):
    """A load writes the live tensors' memory without moving their version counters: one by another
    engine (bcp.load's default one) must wait for this engine's pending copies, or the save commits
    the loaded values as if they were the state at save()."""
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    train_step(m, opt)
    with bcp.Checkpointer() as other:
        other.save(tmp_path / "sevens", {"w": torch.full_like(m[0].weight, 7.0)})
        ref = snapshot(m, opt)
        held = Held(monkeypatch)
        h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
        held.release(after_s=0.3)
        other.load(tmp_path / "sevens", {"w": m[0].weight.detach()})
        assert held.done.is_set(), "the other engine's load ran before the pending copy landed"
    h.wait()
    assert_saved(ckpt, tmp_path / "a", ref)
    assert torch.equal(m[0].weight, torch.full_like(m[0].weight, 7.0))


def test_a_landed_save_keeps_nothing_alive(tmp_path, ckpt):
    """Once its copies landed, a save holds no reference to the optimizer or the model (an engine that
    is never closed, bcp.save's default one, must not keep the last saved model resident)."""
    import gc
    import weakref
    m = model(bn=False)
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    h.wait()
    alive = weakref.ref(opt), weakref.ref(m[0].weight)
    del m, opt, h
    gc.collect()
    assert [r() is None for r in alive] == [True, True]


def test_an_embedding_with_max_norm_is_copied_before_save_returns(tmp_path, monkeypatch, ckpt):
    """nn.Embedding(max_norm=...) renormalises the rows it looks up, in place, in every forward: its
    weight is copied before save() returns, so training on at once does not fail the save."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(1000, 64, max_norm=1.0), torch.nn.Linear(64, 256))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    ids = torch.randint(0, 1000, (64,))
    m(ids).square().mean().backward()
    opt.step()
    opt.zero_grad()
    ref = snapshot(m, opt)
    held = Held(monkeypatch)
    h = ckpt.save(tmp_path / "a", {"model": m, "optim": opt})
    assert h.stats["deferred_bytes"] > 0  # the Linear's tensors still are
    m(torch.randint(0, 1000, (64,))).square().mean().backward()  # renormalises rows in place
    held.release(after_s=0.2)
    opt.step()
    h.wait()
    assert_saved(ckpt, tmp_path / "a", ref)
