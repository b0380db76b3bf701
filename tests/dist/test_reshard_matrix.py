"""Save at W in {1,2,3,4}, load at every other W: every layout, real gloo processes."""
import os

import pytest

from launcher import run_ranks

WORLDS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("matrix")
    paths = {}
    for w in WORLDS:
        paths[w] = str(base / f"saved_at_{w}")
        # W=2 and W=4 save asynchronously and mutate the state right after save() returns.
        run_ranks("scenarios_reshard:save_all", w, {"path": paths[w], "async_save": w % 2 == 0}, timeout=120)
    return paths


@pytest.mark.timeout(600)
@pytest.mark.parametrize("load_world", WORLDS)
def test_load_at_other_world_sizes(saved, load_world):
    others = [saved[w] for w in WORLDS if w != load_world]
    outs = run_ranks("scenarios_reshard:load_all", load_world, {"paths": others}, timeout=180)
    assert all("ok" in o for o in outs)


