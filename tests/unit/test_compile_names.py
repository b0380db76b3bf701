"""torch.compile'd modules are saved under the module's own names (no `_orig_mod.`): compiled and plain
modules load each other's checkpoints, whole-model or per-block compiled, with their optimizers; a
checkpoint saved with `_orig_mod.` names (data/format_v5, written by the code before this) still loads
into both, and exports plain names; only a torch.compile wrapper's `_orig_mod` is left out, a real
submodule of that name keeps it. backend="eager": the names do not depend on the backend."""
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.tools.export import export_safetensors

OLD_FIXTURE = Path(__file__).parent / "data" / "format_v5"   # {"model": torch.compile(net), "optimizer": AdamW, "step": 7}


def plain_name(name: str) -> str:  # the test nets have no real submodule named _orig_mod
    return name.replace("_orig_mod.", "")


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _trained(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return opt


def _equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = ({plain_name(k): v for k, v in m.state_dict().items()} for m in (a, b))
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _opt_equal(a, b) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[i][n], sb[i][n]) for i in sa for n in sa[i])


def _per_block(model):
    model[0] = torch.compile(model[0], backend="eager")
    return model


@pytest.mark.parametrize("how", ["whole", "per_block"])
def test_compiled_and_plain_load_each_other(tmp_path, how):
    compile_ = (lambda m: torch.compile(m, backend="eager")) if how == "whole" else _per_block
    src = compile_(_net())
    opt = _trained(src)
    assert any("_orig_mod" in k for k in src.state_dict())
    bcp.save(tmp_path / "c", {"model": src, "optimizer": opt})
    saved = bcp.Checkpointer().metadata(tmp_path / "c").tensors
    assert saved and not any("_orig_mod" in k for k in saved), sorted(saved)
    # compiled -> plain
    plain = _net(1)
    plain_opt = _trained(plain)
    bcp.load(tmp_path / "c", {"model": plain, "optimizer": plain_opt})
    assert _equal(plain, src) and _opt_equal(plain_opt, opt)
    # plain -> compiled
    _trained(plain)
    bcp.save(tmp_path / "p", {"model": plain, "optimizer": plain_opt})
    dst = compile_(_net(2))
    dst_opt = _trained(dst)
    bcp.load(tmp_path / "p", {"model": dst, "optimizer": dst_opt})
    assert _equal(dst, plain) and _opt_equal(dst_opt, plain_opt)


def test_old_checkpoint_with_orig_mod_names_loads_into_plain_and_compiled_and_exports_plain(tmp_path):
    import shutil
    OLD = shutil.copytree(OLD_FIXTURE, tmp_path / "old")  # a load records its stats beside the checkpoint
    assert any(k.startswith("model/_orig_mod.") for k in bcp.Checkpointer().metadata(OLD).tensors)
    saved = bcp.load_full(OLD)
    want = {plain_name(k): v for k, v in saved["model"].items()}
    for model in (_net(3), torch.compile(_net(3), backend="eager")):
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        state = {"model": model, "optimizer": opt, "step": None}
        bcp.load(OLD, state)
        got = {plain_name(k): v for k, v in model.state_dict().items()}
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert state["step"] == 7 and len(opt.state) == 4
    result = export_safetensors(OLD, tmp_path / "hf")
    from safetensors.torch import load_file
    exported = load_file(str(tmp_path / "hf" / result.files[0]))
    assert sorted(exported) == sorted(want) and all(torch.equal(exported[k], want[k]) for k in want)


class _Both(nn.Module):
    """A real submodule named `_orig_mod` beside a sibling of the same inner names (no torch.compile)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(2, 2)
        self.register_module("_orig_mod", nn.Module())
        self._orig_mod.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x) + self._orig_mod.lin(x)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_real_submodule_named_orig_mod_keeps_its_name(tmp_path, compiled):
    """Only a torch.compile wrapper's `_orig_mod` is left out (DCP's rule): a module's own submodule
    called `_orig_mod` is saved under its own name, beside `lin`, also inside a compiled model, with
    the optimizer keyed by the same names, and the checkpoint loads back and exports those names."""
    src = _Both(0)
    src_model = torch.compile(src, backend="eager") if compiled else src
    opt = torch.optim.AdamW(src_model.parameters(), lr=0.1)
    src_model(torch.randn(3, 2)).sum().backward()
    opt.step()
    bcp.save(tmp_path / "c", {"model": src_model, "optimizer": opt})
    saved = sorted(bcp.Checkpointer().metadata(tmp_path / "c").tensors)
    own = sorted(f"model/{k}" for k in src.state_dict())
    assert [k for k in saved if k.startswith("model/")] == own, saved
    assert "optimizer/state/_orig_mod.lin.weight/exp_avg" in saved, saved  # DCP's name of the same parameter
    dst = _Both(1)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=0.1)
    bcp.load(tmp_path / "c", {"model": dst, "optimizer": dst_opt})
    want, got = src.state_dict(), dst.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert _opt_equal(dst_opt, opt)
    result = export_safetensors(tmp_path / "c", tmp_path / "hf")
    from safetensors.torch import load_file
    exported = load_file(str(tmp_path / "hf" / result.files[0]))
    assert sorted(exported) == sorted(src.state_dict())


def test_a_view_whose_names_collide_without_orig_mod_is_refused_naming_both(tmp_path):
    model = torch.compile(_net(), backend="eager")  # its state dict names begin with the wrapper's _orig_mod.
    sd = dict(model.state_dict())
    view = bcp.ModuleView(model, lambda: {**sd, "0.weight": sd["_orig_mod.0.weight"]}, lambda _: None)
    with pytest.raises(bcp.StateMismatchError, match=r"'_orig_mod\.0\.weight' and '0\.weight'|'0\.weight' and '_orig_mod\.0\.weight'"):
        bcp.save(tmp_path / "x", {"model": view})
    assert not (tmp_path / "x" / "metadata.json").exists()


def test_saved_names_lose_only_a_wrapper_s_orig_mod():
    from bytecheckpoint.state.modules import saved_own_names

    assert saved_own_names(["_orig_mod.0.w", "_orig_mod.1.w"]) == {"_orig_mod.0.w": "0.w", "_orig_mod.1.w": "1.w"}
    assert saved_own_names(["a._orig_mod._orig_mod.w", "b.w"]) == {"a._orig_mod._orig_mod.w": "a.w", "b.w": "b.w"}
    per_block = ["layers.0._orig_mod.w", "layers.1.w"]
    assert saved_own_names(per_block) == {"layers.0._orig_mod.w": "layers.0.w", "layers.1.w": "layers.1.w"}
    both = ["lin.w", "_orig_mod.lin.w"]  # a real submodule beside a sibling: its name
    assert saved_own_names(both) == {n: n for n in both}

