"""Pure parts of the local tier: where replicas go, which checkpoint a set of survivors can restore."""
import pytest

import bytecheckpoint as bcp
from bytecheckpoint.tiers.local import choose, prune, replica_targets


def test_replicas_go_to_other_nodes_only():
    nodes = ["a", "a", "b", "b"]
    assert replica_targets(nodes, 1) == [[2], [3], [0], [1]]
    assert replica_targets(nodes, 0) == [[], [], [], []]
    assert replica_targets(nodes, 5) == [[2], [3], [0], [1]]          # at most one per other node
    three = ["a", "a", "b", "b", "c", "c"]
    assert replica_targets(three, 2) == [[2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]]
    assert replica_targets(["a", "a", "a"], 1) == [[], [], []]          # one node: nowhere to copy to
    uneven = ["a", "a", "a", "b"]
    assert replica_targets(uneven, 1) == [[3], [3], [3], [0]]
    for targets, node in zip(replica_targets(three, 2), three):
        assert all(three[t] != node for t in targets)


def test_choose_the_newest_checkpoint_held_completely():
    # (name, save_id, created, world at save, parts held on this rank's node)
    survivors = [
        [("s1", "i1", 1.0, 4, [0, 1, 2, 3]), ("s2", "i2", 2.0, 4, [0, 1])],
        [("s1", "i1", 1.0, 4, [0, 1, 2, 3]), ("s2", "i2", 2.0, 4, [0, 1])],
    ]
    assert choose(survivors) == ("s1", "i1")
    survivors[1] = [("s2", "i2", 2.0, 4, [2, 3])]                        # the parts are spread over ranks
    assert choose(survivors) == ("s2", "i2")
    assert choose([[("s3", "i3", 3.0, 2, [0])], []]) is None
    assert choose([[("s", "old", 1.0, 1, [0])], [("s", "new", 2.0, 1, [0])]]) == ("s", "new")


def test_local_tier_options_are_checked():
    with pytest.raises(bcp.CheckpointError, match="replicas"):
        bcp.LocalTier(dir="/tmp/x", replicas=-1)
    with pytest.raises(bcp.CheckpointError, match="node-local"):
        bcp.LocalTier(dir="s3://bucket/x")
    with pytest.raises(bcp.CheckpointError, match="no local tier"):
        bcp.Checkpointer().save("step_1", {}, tier="local")
    with pytest.raises(bcp.CheckpointError, match="plain name"):
        bcp.Checkpointer(local_tier=bcp.LocalTier(dir="/tmp/x")).save("../up", {"a": 1}, tier="local")


def test_single_process_local_tier_and_pruning(tmp_path):
    import os
    import torch
    tier = bcp.LocalTier(dir=str(tmp_path / "node{node}"), keep=2, node=lambda r: 0)
    with bcp.Checkpointer(local_tier=tier) as ckpt:
        w = torch.zeros(10)
        for step in range(4):
            w += 1
            ckpt.save(f"step_{step}", {"w": w, "step": step}, tier="local", async_save=True)
        ckpt.wait()
        root = tier.root(0)
        assert sorted(os.listdir(root)) == ["step_2", "step_3"]          # keep=2
        assert not bcp.is_checkpoint(os.path.join(root, "step_3"))       # never taken for a persistent one
        out = {"w": torch.zeros(10), "step": -1}
        restored = ckpt.restore(out)
        assert restored.source == "local" and restored.name == "step_3" and out["step"] == 3
        assert torch.equal(out["w"], torch.full((10,), 4.0))
        ckpt.load("step_2", out, tier="local")
        assert out["step"] == 2
    os.makedirs(os.path.join(root, "crashed"))                              # a save that never committed
    assert sorted(prune(root, keep=1)) == ["crashed", "step_2"]
    assert sorted(os.listdir(root)) == ["step_3"]


def test_restore_prefers_the_local_tier_for_the_same_step():
    from bytecheckpoint.tiers.restoring import not_older as _not_older
    from bytecheckpoint.format.metadata import order_key
    local = order_key({"step": 3, "captured_unix": 100.0})
    later_save_same_step = order_key({"step": 3, "captured_unix": 100.2})   # the persistent save of step 3
    assert _not_older(local, later_save_same_step)                        # same state: no remote read
    assert not _not_older(local, order_key({"step": 4, "captured_unix": 99.0}))
    # without steps, the capture time decides; older checkpoints have only their commit time
    assert order_key({"created_unix": 5.0}) == (-1, 5.0)
    assert not _not_older(order_key({"captured_unix": 1.0}), order_key({"captured_unix": 2.0}))
    with pytest.raises(bcp.CheckpointError, match="step must be an int"):
        bcp.Checkpointer().save("/tmp/never", {"w": 1}, step="3")
