"""The `torchtitan` marker: torchtitan's real Trainer on gloo processes (minutes each). They run only
when selected by name, `pytest -m torchtitan tests/torchtitan`, so `make test` (-m "not faults and not
slow") and `make test-slow` keep their length; the fast manager tests here run in `make test`."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "torchtitan: torchtitan's Trainer on gloo processes (pytest -m torchtitan)")


def pytest_collection_modifyitems(config, items):
    if "torchtitan" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="torchtitan's Trainer on processes: run with -m torchtitan")
    for item in items:
        if item.get_closest_marker("torchtitan") is not None:
            item.add_marker(skip)
