"""Stage-partitioned state in one process (issue 38): the structure union of simulated ranks, the
by-name optimizer form, model parts as one namespace, LR schedulers across a re-split."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bytecheckpoint as bcp
from bytecheckpoint.state import structure_union
from bytecheckpoint.state.flatten import flatten_for_save, structure_leaves
from bytecheckpoint.state.registry import builtin_registry


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(4, 8)
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(4)})
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h


def stage(model, owned, first, last):
    part = copy.deepcopy(model)
    for k in list(part.layers):
        if int(k) not in owned:
            del part.layers[k]
    if not first:
        part.emb = None
    if not last:
        part.head = None
    return part


def groups(modules):
    named = [(n, p) for m in modules for n, p in m.named_parameters()]
    out = [{"params": [p for n, p in named if n.endswith("weight") and not n.startswith("emb")], "weight_decay": 0.1},
           {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
           {"params": [p for n, p in named if n.startswith("emb") and n.endswith("weight")], "lr": 3e-3}]
    return [g for g in out if g["params"]]


def stepped(modules, opt, steps=2):
    for s in range(steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(s))
        h = x
        for m in modules:
            h = m(h)
        h.square().mean().backward()
        opt.step()
        opt.zero_grad()


def flat_of(state):
    return flatten_for_save(state, builtin_registry())


def test_union_of_rank_structures_names_owners():
    model = Net()
    s0, s1 = stage(model, range(0, 2), True, False), stage(model, range(2, 4), False, True)
    o0, o1 = torch.optim.AdamW(groups([s0])), torch.optim.AdamW(groups([s1]))
    t0 = flat_of({"model": s0, "optimizer": o0, "step": 1}).structure
    t1 = flat_of({"model": s1, "optimizer": o1, "step": 1}).structure
    merged = structure_union.merge({0: t0, 1: t1})
    leaves = structure_leaves(merged.tree)
    assert "model/head.weight" in leaves and "model/emb.weight" in leaves
    assert leaves["optimizer/param_groups/head.weight"] == "object"
    assert merged.object_owners == {k: 1 for k, kind in structure_leaves(t1).items()
                                    if kind == "object" and k not in structure_leaves(t0)}
    assert "step" not in merged.object_owners   # rank 0 holds it: no entry
    assert structure_union.senders(["a", "a", "b", "a", "b", "c"]) == [2, 5]


def test_union_refuses_a_key_saved_as_two_kinds():
    t0 = flat_of({"x": torch.ones(2)}).structure
    t1 = flat_of({"x": 3}).structure
    with pytest.raises(bcp.ShardLayoutError, match=r"'x'.*rank 0 saves a tensor.*rank 1 a plain value"):
        structure_union.merge({0: t0, 1: t1})


def test_optimizer_is_keyed_by_name(tmp_path):
    model = Net()
    opt = torch.optim.AdamW(groups([model]), lr=1e-2)
    stepped([model], opt)
    leaves = structure_leaves(flat_of({"model": model, "optimizer": opt}).structure)
    assert leaves["optimizer/param_groups/layers.0.bias"] == "object"
    assert leaves["optimizer/state/layers.0.bias/exp_avg"] == "tensor"
    assert not any(k.startswith("optimizer/param_groups/0") for k in leaves)


def test_parts_load_into_one_module_and_back(tmp_path):
    """Two parts on one process with one optimizer over both (the interleaved schedules' case)
    load into a single module and its optimizer, and back into another split of parts."""
    model = Net()
    parts = [stage(model, range(0, 1), True, False), stage(model, range(1, 4), False, True)]
    opt = torch.optim.AdamW(groups(parts), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    stepped(parts, opt)
    sched.step()
    bcp.save(tmp_path / "ck", {"model": parts, "optimizer": opt, "sched": sched})

    whole = Net()
    whole_opt = torch.optim.AdamW(groups([whole]), lr=1.0)
    whole_sched = torch.optim.lr_scheduler.LambdaLR(whole_opt, lambda s: 0.5 ** s)
    bcp.load(tmp_path / "ck", {"model": whole, "optimizer": whole_opt, "sched": whole_sched})
    names = {id(p): n for m in parts for n, p in m.named_parameters()}
    saved = {names[id(p)]: st for p, st in opt.state.items()}
    loaded_names = {id(p): n for n, p in whole.named_parameters()}
    loaded = {loaded_names[id(p)]: st for p, st in whole_opt.state.items()}
    assert sorted(saved) == sorted(loaded)
    for n in saved:
        for k in saved[n]:
            assert torch.equal(saved[n][k], loaded[n][k]), (n, k)
    for n, p in whole.named_parameters():
        src = dict(p for m in parts for p in m.named_parameters())[n]
        assert torch.equal(p, src), n
    # hyper-parameters by name: the embedding kept its own lr, biases no decay
    lr_of = {loaded_names[id(p)]: (g["lr"], g["weight_decay"]) for g in whole_opt.param_groups for p in g["params"]}
    assert lr_of["emb.weight"] == (3e-3 * 0.5, 0.01) and lr_of["layers.2.bias"] == (1e-2 * 0.5, 0.0)
    assert whole_sched.base_lrs == [1e-2, 1e-2, 3e-3] and whole_sched.last_epoch == 1

    # and into another split, one optimizer per part, whose groups differ in number and order
    other = [stage(Net(), range(0, 3), True, False), stage(Net(), range(3, 4), False, True)]
    other_opts = [torch.optim.AdamW(list(reversed(groups([p]))), lr=1.0) for p in other]
    other_sched = torch.optim.lr_scheduler.LambdaLR(other_opts[1], lambda s: 0.5 ** s)
    bcp.load(tmp_path / "ck", {"model": other, "optimizer": other_opts, "sched": other_sched})
    assert other_sched.base_lrs == [g["initial_lr"] for g in other_opts[1].param_groups] == [1e-2, 1e-2]
    head = dict(other[1].named_parameters())["head.weight"]
    assert torch.equal(other_opts[1].state[head]["exp_avg"], saved["head.weight"]["exp_avg"])


def test_groups_that_disagree_are_named(tmp_path):
    model = Net()
    opt = torch.optim.AdamW(groups([model]), lr=1e-2)
    stepped([model], opt)
    bcp.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    fresh = Net()
    one_group = torch.optim.AdamW(fresh.parameters(), lr=1e-2)  # weights and biases in one group
    with pytest.raises(bcp.StateMismatchError, match=r"param group 0 holds 'emb.weight' and 'emb.bias'.*different 'lr' \(0.003 and 0.01\)"):
        bcp.load(tmp_path / "ck", {"model": fresh, "optimizer": one_group})


def test_module_lists_with_colliding_names_keep_index_keys(tmp_path):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    leaves = structure_leaves(flat_of({"nets": [a, b]}).structure)
    assert "nets/0/weight" in leaves and "nets/1/weight" in leaves
    bcp.save(tmp_path / "ck", {"nets": [a, b]})
    c, d = nn.Linear(2, 2), nn.Linear(2, 2)
    bcp.load(tmp_path / "ck", {"nets": [c, d]})
    assert torch.equal(c.weight, a.weight) and torch.equal(d.weight, b.weight)


def test_two_ranks_saving_one_name_as_other_dtypes_are_named():
    """Stages that disagree on one shared name (a tied embedding, say) are refused at save."""
    from bytecheckpoint.planning.planner import TensorManifest, plan_save
    box = (((0, 0), (4, 4)),)
    a = TensorManifest("model/emb.weight", "float32", (4, 4), "replicated", box)
    b = TensorManifest("model/emb.weight", "bfloat16", (4, 4), "replicated", box)
    head = TensorManifest("model/head.weight", "float32", (2, 4), "replicated", (((0, 0), (2, 4)),))
    with pytest.raises(bcp.ShardLayoutError, match=r"'model/emb.weight': rank 0 has dtype float32 .* rank 1 has "
                                                   r"dtype bfloat16"):
        plan_save([(a,), (b, head)])
