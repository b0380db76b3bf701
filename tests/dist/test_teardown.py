"""After saves, loads and a failed load, the engine keeps no process group alive (see
scenarios_teardown.py)."""
import sys

import pytest

from launcher import run_ranks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
@pytest.mark.timeout(200)
def test_engine_holds_no_process_group_after_teardown(tmp_path):
    outs = run_ranks("scenarios_teardown:save_load_fail_then_teardown", 2, {"root": str(tmp_path)}, timeout=150)
    assert all("load failed as expected" in o and "teardown clean" in o for o in outs), outs
