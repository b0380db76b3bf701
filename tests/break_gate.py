"""A pytest plugin that breaks async staging's fence and/or guard, to show the hazard tests fail without
them (they must: docs/async_staging.md, "How it is tested"). Not part of any test run by itself:

    BCP_BREAK=fence PYTHONPATH=tests .venv/bin/python -m pytest -p break_gate tests/unit/test_staging_gate.py
    BCP_BREAK=guard ...   BCP_BREAK=fence,guard ...
"""
import os
from bytecheckpoint.pipeline import gate
mode = os.environ.get("BCP_BREAK", "")
if "fence" in mode:
    gate.Pending.holds = lambda self, opt: False
    gate.StepFence.drain = lambda self: None
if "guard" in mode:
    gate.Pending._check = lambda self, where, only=None: None
