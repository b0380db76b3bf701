"""Async staging on 2 gloo ranks: DDP, FSDP2 (foreach and fused AdamW), FSDP1's flat route (both
use_orig_params): training goes on at once, every step waits for its rank's copies, and each
checkpoint equals a synchronous save of the same state (tests/scenarios_async_staging.py)."""
import pytest

from launcher import run_ranks

KINDS = "ddp,fsdp2_foreach,fsdp2_fused,fsdp1_orig,fsdp1_flat"


@pytest.mark.timeout(600)
def test_async_staging_on_two_ranks(tmp_path):
    outs = run_ranks("scenarios_async_staging:run", 2, {"root": str(tmp_path), "kinds": KINDS}, timeout=400)
    for o in outs:
        for kind in KINDS.split(","):
            assert f"async staging {kind} ok" in o, o[-3000:]
