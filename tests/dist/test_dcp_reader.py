"""Stock PyTorch DCP checkpoints (dcp.save of FSDP2 state on 2 gloo ranks) load through bcp.load
on another layout and world size, bit-exact with model, AdamW moments and plain values."""
import subprocess
import sys

import pytest

from launcher import HERE, run_ranks


def _load_plain(path, ref):
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import scenarios_dcp as s; "
            f"s.plain_main({path!r}, {ref!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dcp -> plain ok" in out.stdout


@pytest.mark.timeout(400)
@pytest.mark.parametrize("rank_local", [False, True], ids=["dcp", "dcp-rank-local-metadata"])
def test_dcp_fsdp2_checkpoint_reshards_through_bcp(tmp_path, rank_local):
    path, ref = str(tmp_path / "step-3"), str(tmp_path / "ref.pt")
    run_ranks("scenarios_dcp:dcp_save_fsdp2", 2, {"path": path, "reference": ref, "rank_local": rank_local},
              timeout=150)
    _load_plain(path, ref)  # FSDP2 2 ranks -> 1 plain process
    for world in ((3,) if rank_local else (2, 3)):  # -> FSDP2 at the same and another world size
        outs = run_ranks("scenarios_dcp:bcp_load_compare", world, {"path": path, "reference": ref,
                                                                    "layout": "fsdp2"}, timeout=150)
        assert all("dcp -> fsdp2 ok" in o for o in outs)
