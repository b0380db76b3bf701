"""bcp.latest on a real S3 server (SeaweedFS on 127.0.0.1, started as in test_s3.py): a prefix of
checkpoints with a torn newest one (data objects, no metadata object) and an async save still in
flight; names that sort the wrong way (step_9 / step_10)."""
from __future__ import annotations

import os

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.checkpointer import default_checkpointer
from bytecheckpoint.storage import faults

from seaweed import seaweed  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(240)


def _save(url, v, opts, **kw):
    return bcp.save(url, {"w": torch.full((64,), float(v)), "v": v}, storage_options=opts, **kw)


def test_latest_on_s3_skips_torn_and_in_flight(seaweed):  # noqa: F811 - the fixture
    opts = seaweed.storage_options
    bucket = f"bcp-latest-{os.getpid()}"
    seaweed.create_bucket(bucket)
    run = f"s3://{bucket}/run"
    assert bcp.latest(run, storage_options=opts) is None
    for s in (9, 10):
        _save(f"{run}/step_{s}", s, opts, step=s).wait()
    # torn: every data object of a save, without its metadata object (the commit point)
    ckpt = default_checkpointer()
    src, torn = ckpt.storage(f"{run}/step_10", opts), ckpt.storage(f"{run}/step_11", opts)
    for key in src.list():
        if key != "metadata.json":
            torn.put(key, src.get(key))
    assert bcp.latest(run, storage_options=opts) == f"{run}/step_10"
    # an async save still writing (its writes slowed) is not a checkpoint yet
    with faults.inject({"op": "write", "kind": "slow", "delay_s": 1.0, "key": ""}, checkpointer=ckpt):
        h = _save(f"{run}/step_12", 12, opts, step=12, async_save=True)
        assert bcp.latest(run, storage_options=opts) == f"{run}/step_10"
        h.wait()
    got = bcp.latest(run, storage_options=opts)
    assert got == f"{run}/step_12"
    out = {"w": torch.zeros(64), "v": 0}
    bcp.load(got, out, storage_options=opts)
    assert out["v"] == 12 and torch.equal(out["w"], torch.full((64,), 12.0))
    # keep_last keeps what latest resumes from, leaves the torn one alone
    report = bcp.keep_last(run, 1, storage_options=opts)
    assert report.kept == [got] and report.incomplete == [f"{run}/step_11"]
