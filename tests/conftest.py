import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


import pytest  # noqa: E402

import layout_check  # noqa: E402

layout_check.install()
os.environ["BCP_LAYOUT_CHECK"] = "1"  # the ranks the tests start check too (launcher_worker.py); benchmarks do not


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps process-wide singletons (AcceleratorState, GradientState); a test that ran
    a Trainer or prepared dataloaders leaves weakrefs there that make a later Accelerator
    unpicklable. Reset them after every test, as Accelerate's own test cases do."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()
