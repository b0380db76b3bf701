"""The small files the stock `save_model` puts into a checkpoint folder, without the weights
(those are in `bytecheckpoint/`): the model's config and generation config, the processing class
(tokenizer, processor) and `training_args.bin`, written by the processes the stock Trainer writes
on (`args.should_save`), as its `_save` does."""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ._peft import write_files as write_adapter_files

logger = logging.getLogger(__name__)


def write_model_files(trainer: Any, output_dir: str, peft_model: Any = None) -> None:
    from transformers.trainer import TRAINING_ARGS_NAME

    args = trainer.args
    if not args.should_save:
        return
    os.makedirs(output_dir, exist_ok=True)
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    config = getattr(model, "config", None)
    if peft_model is not None:  # the adapter's files, as PeftModel.save_pretrained writes them (no config.json)
        write_adapter_files(peft_model, output_dir)
    elif config is not None and hasattr(config, "save_pretrained") and not getattr(model, "_hf_peft_config_loaded", False):
        config.save_pretrained(output_dir)
    can_generate = getattr(model, "can_generate", None)
    if peft_model is None and callable(can_generate) and can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(output_dir)
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(output_dir)
    elif getattr(trainer.data_collator, "tokenizer", None) is not None:
        logger.info("Saving Trainer.data_collator.tokenizer by default as Trainer.processing_class is `None`")
        trainer.data_collator.tokenizer.save_pretrained(output_dir)
    torch.save(args, os.path.join(output_dir, TRAINING_ARGS_NAME))
