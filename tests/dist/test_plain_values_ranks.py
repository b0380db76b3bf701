"""Plain values that differ between the ranks that saved them (a per-rank dict, a per-rank counter)
are never silently dropped on another world size: dicts unite every rank's keys, a differing value
comes from the saved rank the loading rank stands for, load_full(per_rank=True) returns each rank's,
and a strict load with a template key the checkpoint lacks fails before any tensor is written."""
import pytest

import bytecheckpoint as bcp
from launcher import run_ranks


@pytest.mark.timeout(300)
def test_per_rank_plain_values_keep_their_owners(tmp_path, caplog):
    path = str(tmp_path / "ckpt")
    run_ranks("scenarios_plain_values:save", 4, {"path": path}, timeout=120)
    outs = run_ranks("scenarios_plain_values:load", 2, {"path": path, "saved_world": 4}, timeout=120)
    assert all("PLAIN VALUES OK" in o for o in outs)
    assert "took saved rank 2's, not ranks 0, 1, 3's" in outs[1], outs[1][-2000:]
    run_ranks("scenarios_plain_values:load", 1, {"path": path, "saved_world": 4}, timeout=120)
    with caplog.at_level("WARNING", logger="bytecheckpoint"):
        whole = bcp.load_full(path)
    assert whole["extra"] == {**{f"only_rank{i}": i + 10 for i in range(4)}, "common": 5} and whole["seen"] == 0
    assert "plain value 'seen' differs" in caplog.text
    per_rank = bcp.load_full(path, per_rank=True)
    assert [s["seen"] for s in per_rank] == [0, 1, 2, 3]
    assert [s["extra"] for s in per_rank] == [{f"only_rank{i}": i + 10, "common": 5} for i in range(4)]
    assert all(s["w"] is per_rank[0]["w"] for s in per_rank)   # tensors read once, shared
