"""LoRA (peft) under transformers.Trainer with attach, against the stock Trainer running the same
script on 2 processes (DDP, gloo on CPU): the checkpoint holds what the stock one holds (the adapter,
its optimizer state, adapter_config.json), about as small; it resumes on 1 process bit for bit as the
stock resume; PeftModel.from_pretrained opens its folder."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "transformers_scripts"))

from test_transformers import assert_same_run, committed, dump, launch  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 steps on 2 processes, a checkpoint every 2, stock and attached (async); both resumed on 1
    process from checkpoint-4."""
    t = tmp_path_factory.mktemp("tr_lora")
    launch(2, "--peft", "--out", str(t / "stock"), "--dump", str(t / "stock.pt"))
    launch(2, "--peft", "--out", str(t / "bcp"), "--attach", "async", "--dump", str(t / "bcp.pt"))
    launch(1, "--peft", "--out", str(t / "stock"), "--resume", str(t / "stock" / "checkpoint-4"),
           "--dump", str(t / "stock_1.pt"))
    launch(1, "--peft", "--out", str(t / "bcp"), "--attach", "async", "--resume", str(t / "bcp" / "checkpoint-4"),
           "--dump", str(t / "bcp_1.pt"))
    return t


def test_lora_run_and_2_to_1_resume_bit_exact_with_stock(lora: Path) -> None:
    assert_same_run(dump(lora / "bcp.pt"), dump(lora / "stock.pt"), "continuous LoRA run")
    ours, stock = dump(lora / "bcp_1.pt"), dump(lora / "stock_1.pt")
    assert ours["world_size"] == stock["world_size"] == 1
    assert any(".lora_A." in k for k in ours["weights"])  # adapter and frozen base, every weight compared
    assert_same_run(ours, stock, "LoRA 2 -> 1 resume")


def _bytes_on_disk(folder: Path) -> int:
    """Bytes of every file under `folder`, a hard-linked file counted once."""
    sizes = {}
    for p in folder.rglob("*"):
        if p.is_file():
            st = p.stat()
            sizes[(st.st_dev, st.st_ino)] = st.st_size
    return sum(sizes.values())


def test_lora_checkpoint_holds_the_adapter_as_stock_and_is_about_as_small(lora: Path) -> None:
    import bytecheckpoint as bcp

    for step in (2, 4, 6):
        ours, stock = lora / "bcp" / f"checkpoint-{step}", lora / "stock" / f"checkpoint-{step}"
        files = set(os.listdir(ours))
        assert files == {"README.md", "adapter_config.json", "adapter_model.safetensors", "bytecheckpoint",
                         "trainer_state.json", "training_args.bin"}, files  # no config.json, model.safetensors
        assert committed(ours)
        assert json.loads((ours / "adapter_config.json").read_text()) == json.loads(
            (stock / "adapter_config.json").read_text())
        # the adapter file is the checkpoint's safetensors pack, and the stock file byte for byte
        md = bcp.Checkpointer().metadata(str(ours / "bytecheckpoint"))
        (pack,) = md.safetensors["adapter/default"]
        assert os.path.samefile(ours / "adapter_model.safetensors", ours / "bytecheckpoint" / md.packs[pack])
        assert (ours / "adapter_model.safetensors").read_bytes() == (stock / "adapter_model.safetensors").read_bytes()
        keys = {k.split("/")[0] for k in md.tensors}
        assert keys == {"adapter", "optimizer"}, keys  # the frozen base is not in the checkpoint
        assert not any("lora" not in k for k in md.tensors), sorted(md.tensors)[:5]
        size, stock_size = _bytes_on_disk(ours), _bytes_on_disk(stock)
        assert size <= 2 * stock_size + MiB, (step, size, stock_size)


def test_peft_from_pretrained_opens_a_checkpoint_folder(lora: Path) -> None:
    from peft import PeftModel
    from tiny import tiny_gpt2

    ours = PeftModel.from_pretrained(tiny_gpt2(), str(lora / "bcp" / "checkpoint-4"))
    stock = PeftModel.from_pretrained(tiny_gpt2(), str(lora / "stock" / "checkpoint-4"))
    got, want = ours.state_dict(), stock.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(got[k], PeftModel.from_pretrained(tiny_gpt2(), str(lora / "stock" / "checkpoint-2"))
                               .state_dict()[k]) for k in got if ".lora_B." in k)  # a trained adapter, not the init
