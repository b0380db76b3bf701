"""No checkpoint collective waits without a bound: a save some rank never joins, and a rank that
dies during an async save, end with errors on every rank (never a hang), within the bound."""
import re

import pytest

import bytecheckpoint as bcp
from harness import Job, run


def _seconds(text: str, label: str) -> float:
    return float(re.search(label + r" after ([0-9.]+) s", text).group(1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharded", [False, True])
def test_save_called_on_a_subset_of_ranks_fails_on_both(tmp_path, sharded):
    job = Job("bounded_scenarios:subset_save", 2, {"path": str(tmp_path / "ck"), "timeout_s": 4.0,
                                                     "sharded": sharded})
    codes = job.finish(90)
    out0, out1 = job.outputs()
    assert codes == [0, 0], job.describe()
    assert "RAISED PeerTimeoutError" in out0 and "subset of ranks" in out0, job.describe()
    assert 3.5 < _seconds(out0, "PeerTimeoutError") < 60, job.describe()   # the bound, not gloo's 30 min
    assert "BARRIER ERROR" in out1, job.describe()
    assert not bcp.is_checkpoint(tmp_path / "ck")


@pytest.mark.timeout(120)
def test_replicated_state_saved_by_one_rank_with_local_group(tmp_path):
    outs = run("bounded_scenarios:local_save_on_main", 2, {"path": str(tmp_path / "ck")}, timeout=90)
    assert all("LOCAL OK" in o for o in outs)
    assert bcp.inspect(tmp_path / "ck").world_size == 1


@pytest.mark.timeout(180)
def test_dead_peer_during_async_save_is_detected_by_heartbeat(tmp_path):
    job = Job("bounded_scenarios:dead_peer_async", 2, {"path": str(tmp_path / "ck"), "dead_peer_s": 5.0})
    codes = job.finish(150)
    assert codes[1] == -9, job.describe()
    out0 = job.outputs()[0]
    assert "DEAD PEER DETECTED" in out0 and "rank 1" in out0, job.describe()
    # detected by the stopped heartbeat (dead_peer_s=5), far below the 600 s peer timeout
    assert _seconds(out0, "DEAD PEER DETECTED") < 60, job.describe()
    assert not bcp.is_checkpoint(tmp_path / "ck")
