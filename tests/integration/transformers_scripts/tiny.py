"""A tiny GPT-2 (built from a config, no download) and a fixed token data set, shared by the
Trainer scripts and tests of the transformers adapter."""
from __future__ import annotations

import torch


class Tokens(torch.utils.data.Dataset):
    """`n` fixed sequences of `length` token ids (labels = inputs, the causal LM loss)."""

    def __init__(self, n: int = 64, length: int = 16, vocab: int = 64, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2(dropout: float = 0.1, n_layer: int = 2, n_embd: int = 32, vocab: int = 64, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel, set_seed

    set_seed(seed)  # the same initial weights in every run

    cfg = GPT2Config(n_layer=n_layer, n_head=2, n_embd=n_embd, vocab_size=vocab, n_positions=32,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return GPT2LMHeadModel(cfg)


def tiny_lora(**kw):
    """The tiny GPT-2 with a LoRA adapter on its attention (peft): only the adapter trains."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_gpt2(**kw), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1,
                                                      task_type="CAUSAL_LM"))


def training_args(out: str, **overrides):
    from transformers import TrainingArguments

    kw = dict(output_dir=out, per_device_train_batch_size=2, learning_rate=1e-3, max_steps=6, save_steps=2,
              save_strategy="steps", logging_steps=1, seed=0, report_to=[], use_cpu=True, disable_tqdm=True,
              dataloader_num_workers=0, lr_scheduler_type="linear", warmup_steps=1)
    kw.update(overrides)
    return TrainingArguments(**kw)


def losses(trainer) -> list:
    return [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]


def weights(model) -> dict:
    """Full CPU copies of the state dict (collective for FSDP2's DTensors: call on every process)."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().clone()
    return out
