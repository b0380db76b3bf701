"""FSDP2 over tensor parallel on a 2x2 dp x tp mesh (the torchtitan layout, _StridedShard
placements) and HSDP (Replicate x Shard; FSDP2 and FSDP1 HYBRID_SHARD) saved on 4 gloo ranks, loaded on 2 ranks FSDP-only and
on 1 plain process, bit-exact; every byte written once; Partial placements refused before
anything is written."""
import pytest

from launcher import run_ranks


@pytest.mark.timeout(500)
def test_fsdp2_tp_and_hsdp_reshard_and_partial_is_refused(tmp_path):
    root = str(tmp_path)
    outs = run_ranks("scenarios_fsdp2_tp:save_all", 4, {"root": root}, timeout=200)
    assert all("fsdp2+tp, hsdp, refusal ok" in o for o in outs)
    for world, kind in ((2, "fsdp"), (1, "plain")):
        outs = run_ranks("scenarios_fsdp2_tp:load_all", world, {"root": root, "kind": kind}, timeout=150)
        for o in outs:
            assert o.count(" ok") == 3, o[-2000:]
