"""FSDP1 (FullyShardedDataParallel, CPU + gloo): model + AdamW saved on 2 ranks through the flat
route (use_orig_params True and False) and the ShardedTensor route, loaded into FSDP1 on 3 ranks,
FSDP2 and DDP on 2 ranks and a plain model on 1 process, bit-exact against FSDP's own full state dict."""
import pytest

from launcher import run_ranks


@pytest.mark.timeout(600)
def test_fsdp1_saves_load_into_fsdp1_fsdp2_and_plain(tmp_path):
    root = str(tmp_path)
    outs = run_ranks("scenarios_fsdp1:save_all", 2, {"root": root}, timeout=180)
    assert all("fsdp1 saves ok" in o for o in outs)
    for world, kinds in ((3, "fsdp1"), (2, "fsdp2,ddp"), (1, "plain")):
        outs = run_ranks("scenarios_fsdp1:load_all", world, {"root": root, "kinds": kinds}, timeout=180)
        for o in outs:
            assert o.count(" ok") == 3 * len(kinds.split(",")), o[-2000:]
