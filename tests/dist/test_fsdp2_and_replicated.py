"""Real FSDP2 (fully_shard) model + AdamW saved on 2 ranks, loaded on 1 and 3; DDP-style
replicated state is stored once and its writes are balanced."""
import pytest

from launcher import run_ranks


@pytest.mark.timeout(400)
def test_fsdp2_with_optimizer_reshards(tmp_path):
    path, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    run_ranks("scenarios_fsdp2:train_and_save", 2, {"path": path, "reference": ref}, timeout=150)
    for world in (1, 3):
        outs = run_ranks("scenarios_fsdp2:load_and_compare", world, {"path": path, "reference": ref}, timeout=150)
        assert all("ok" in o for o in outs)


@pytest.mark.timeout(200)
def test_replicated_state_written_once_and_balanced(tmp_path):
    outs = run_ranks("scenarios_fsdp2:save_replicated", 2, {"path": str(tmp_path / "rep")}, timeout=150)
    assert "on_disk" in outs[0]


@pytest.mark.timeout(200)
def test_a_rank_that_cannot_prepare_its_state_fails_the_save_on_every_rank(tmp_path):
    outs = run_ranks("scenarios_fsdp2:prepare_fails_on_one_rank", 2, {"path": str(tmp_path / "ck")}, timeout=150)
    assert all("prepare failure ok" in o for o in outs)
