"""Optimizer state on resume and save (core/state/optimizers.py): a fresh torch optimizer gets the state
tensors its checkpoint holds made directly (no zero-lr step), bit-exact with torch's own path;
anything not known falls back to torch's path and says so; DCP's parameter names are reused
between saves only while they still hold."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.state import optimizers as optim_state


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3, bias=False)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(torch.tanh(self.b(torch.relu(self.a(x)))))


OPTIMIZERS = [
    (torch.optim.Adam, {}), (torch.optim.Adam, {"amsgrad": True}), (torch.optim.AdamW, {"weight_decay": 0.1}),
    (torch.optim.SGD, {"momentum": 0.9}), (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),
    (torch.optim.RMSprop, {}), (torch.optim.Adamax, {}), (torch.optim.NAdam, {}), (torch.optim.RAdam, {}),
    (torch.optim.Adadelta, {}),
]


def _step(model, optim, seed):
    g = torch.Generator().manual_seed(seed)
    optim.zero_grad()
    model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
    optim.step()


def _trained(cls, kw):
    torch.manual_seed(0)
    model = Net()
    optim = cls(model.parameters(), lr=0.01, **kw)
    for i in range(3):
        _step(model, optim, i)
    return model, optim


def _fresh(cls, kw):
    torch.manual_seed(1)
    model = Net()
    return model, cls(model.parameters(), lr=0.01, **kw)


def _equal_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys(), k
        for name, v in sa["state"][k].items():
            w = sb["state"][k][name]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.device == w.device and v.shape == w.shape, (k, name)
                assert torch.equal(v, w), (k, name)
            else:
                assert v == w, (k, name)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_fresh_optimizer_resumes_bit_exact_without_a_step(tmp_path, cls, kw):
    model, optim = _trained(cls, kw)
    bcp.save(tmp_path / "c", {"model": model, "optim": optim})
    direct_model, direct = _fresh(cls, kw)
    with bcp.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "c", {"model": direct_model, "optim": direct})
        assert ckpt.last_load_stats.optimizer_state == {"optim": "created"}
    _equal_state(optim, direct)
    assert all(p.grad is None for p in direct_model.parameters()), "no step ran (it would leave zero grads)"

    # torch's own path (DCP's zero-lr step), forced by an unknown class name, gives the same state
    class Unknown(cls):
        pass
    torch_model, through_torch = _fresh(Unknown, kw)
    with bcp.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "c", {"model": torch_model, "optim": through_torch})
        how = ckpt.last_load_stats.optimizer_state["optim"]
        assert how.startswith("torch step (") and "Unknown is not one of torch's optimizers" in how
    _equal_state(direct, through_torch)
    # and the next step is the same for both and for the original
    for m, o in ((model, optim), (direct_model, direct), (torch_model, through_torch)):
        _step(m, o, 7)
    for p, q, r in zip(model.parameters(), direct_model.parameters(), torch_model.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)


def test_saved_state_the_settings_would_not_make_falls_back_to_torch(tmp_path):
    model, optim = _trained(torch.optim.Adam, {"amsgrad": True})
    bcp.save(tmp_path / "c", {"model": model, "optim": optim})
    fresh_model, fresh = _fresh(torch.optim.Adam, {})  # amsgrad=False: no max_exp_avg_sq
    with bcp.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "c", {"model": fresh_model, "optim": fresh}, strict=False)
        how = ckpt.last_load_stats.optimizer_state["optim"]
    assert how.startswith("torch step (the checkpoint holds state") and "max_exp_avg_sq" in how


def test_an_optimizer_with_state_is_loaded_in_place_as_before(tmp_path):
    model, optim = _trained(torch.optim.AdamW, {})
    bcp.save(tmp_path / "c", {"model": model, "optim": optim})
    other_model, other = _trained(torch.optim.AdamW, {})
    _step(other_model, other, 11)
    moments = [st["exp_avg"] for st in other.state.values()]
    with bcp.Checkpointer() as ckpt:
        ckpt.load(tmp_path / "c", {"model": other_model, "optim": other})
        assert ckpt.last_load_stats.optimizer_state == {}, "it had state: nothing to create"
    _equal_state(optim, other)
    assert all(a is st["exp_avg"] for a, st in zip(moments, other.state.values())), "loaded in place"


def test_name_cache_matches_dcp_and_notices_changes():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    model, optim = _trained(torch.optim.Adam, {})
    names = optim_state.NameCache()
    first = names.state_dict(model, optim)
    again = names.state_dict(model, optim)  # from the cache
    assert again == get_optimizer_state_dict(model, optim) == first
    assert again["state"]["a.weight"] is optim.state[model.a.weight]
    # a new parameter group: the cached names no longer cover the optimizer
    extra = nn.Parameter(torch.ones(2))
    model.register_parameter("extra", extra)
    optim.add_param_group({"params": [extra]})
    assert names.state_dict(model, optim) == get_optimizer_state_dict(model, optim)
    # a state_dict hook: the cache steps aside (the hook must run)
    def hook(o, sd):
        sd["param_groups"][0]["hooked"] = True
    optim.register_state_dict_post_hook(hook)
    assert names.state_dict(model, optim)["param_groups"][0]["hooked"] is True


def test_saving_does_not_change_a_fresh_optimizer(tmp_path):
    """A checkpoint never changes what it saves: no state created, no grads set."""
    model, optim = _fresh(torch.optim.Adam, {})
    before = copy.deepcopy(optim.state_dict())
    bcp.save(tmp_path / "c", {"model": model, "optim": optim})
    assert not optim.state and optim.state_dict() == before
    assert all(p.grad is None for p in model.parameters())


def test_a_failed_resume_leaves_the_fresh_optimizer_without_state(tmp_path):
    model, optim = _trained(torch.optim.AdamW, {})
    bcp.save(tmp_path / "c", {"model": model, "optim": optim})
    wrong_model, wrong = _fresh(torch.optim.AdamW, {})
    with torch.no_grad():
        wrong_model.b.weight = nn.Parameter(torch.zeros(5, 4))  # another shape: refused while planning
    wrong = torch.optim.AdamW(wrong_model.parameters(), lr=0.01)
    with pytest.raises(bcp.StateMismatchError, match="b.weight"):
        bcp.load(tmp_path / "c", {"model": wrong_model, "optim": wrong})
    assert not wrong.state, "the state made for the load was taken back"
    # a damaged chunk: the read fails after the state was made; it is taken back too
    import glob
    import os
    pack = max(glob.glob(str(tmp_path / "c" / "data-*" / "pack" / "*.bin")), key=os.path.getsize)
    with open(pack, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    fresh_model, fresh = _fresh(torch.optim.AdamW, {})
    with pytest.raises(bcp.CheckpointError, match="checksum"):
        bcp.load(tmp_path / "c", {"model": fresh_model, "optim": fresh})
    assert not fresh.state
