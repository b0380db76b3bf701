"""Format-6 safetensors packs from 2 ranks (replicated state): one pack per writing rank, shown as
a sharded Hugging Face folder (model-0000i-of-00002.safetensors + index) by link_views."""
import pytest

from launcher import run_ranks


@pytest.mark.timeout(200)
def test_replicated_model_saved_by_two_ranks_is_a_sharded_safetensors_folder(tmp_path):
    outs = run_ranks("scenarios_safetensors:save_replicated_views", 2,
                     {"path": str(tmp_path / "ck"), "folder": str(tmp_path / "hf")}, timeout=150)
    assert "views ok" in outs[0]
