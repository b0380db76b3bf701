"""One rank of a torchtitan training run on CPU (gloo), started by tests/launcher.run_ranks as
`titan_rank:main` (launch.py) with the run's spec (see launch.py).

Builds torchtitan's llama3 debug model config, swaps in a byte-level tokenizer and a local
dataset (no hub), picks the checkpoint manager ("dcp": torchtitan's own, "bcp": ours), runs the
real Trainer, and writes what the tests compare (each step's loss and this rank's token batches)
to spec["out"]-r<rank>.json.
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import shims  # noqa: E402

shims.install()

import torch  # noqa: E402

from byte_tokenizer import ByteTokenizer  # noqa: E402


def _debug_config(model: str):
    """torchtitan's own debug configs: llama3's dense model, or DeepSeek V3's MoE (8 routed experts
    per MoE layer, the ones expert parallelism splits)."""
    if model == "llama3":
        from torchtitan.models.llama3.config_registry import llama3_debugmodel

        return llama3_debugmodel()
    if model == "deepseek_v3":
        from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

        return deepseek_v3_debugmodel()
    raise ValueError(f"unknown test model {model!r}")


def build_config(spec: dict):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    config = _debug_config(spec.get("model", "llama3"))
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=spec["data_dir"])
    config.dump_folder = spec["dump"]
    config.activation_checkpoint = None
    config.validator.enable = False
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = False
    config.training.disable_cuda_graphs = True
    config.training.seq_len = spec.get("seq_len", 64)
    config.training.local_batch_size = spec.get("local_batch", 2)
    config.training.global_batch_size = spec.get("global_batch", -1)
    config.training.steps = spec["steps"]
    config.training.max_norm = 1.0
    config.debug.seed = 7
    config.debug.deterministic = True
    config.debug.enable_structured_logging = False
    p = config.parallelism
    p.spmd_backend = "partial_dtensor"
    p.data_parallel_shard_degree = spec.get("dp_shard", -1)
    p.data_parallel_replicate_degree = spec.get("dp_replicate", 1)
    p.tensor_parallel_degree = spec.get("tp", 1)
    p.pipeline_parallel_degree = spec.get("pp", 1)
    p.expert_parallel_degree = spec.get("ep", 1)
    p.pipeline_parallel_schedule = spec.get("pp_schedule", "1F1B")
    p.pipeline_parallel_microbatch_size = spec.get("pp_microbatch", 1)
    p.pipeline_parallel_layers_per_stage = spec.get("pp_layers_per_stage")
    common = dict(enable=spec.get("enable", True), folder=spec.get("folder", "checkpoint"),
                  interval=spec.get("interval", 2),
                  last_save_model_only=False, keep_latest_k=spec.get("keep_latest_k", 0),
                  load_step=spec.get("load_step", -1), exclude_from_loading=spec.get("exclude", []))
    common.update(spec.get("checkpoint", {}))  # any other field of torchtitan's checkpoint Config
    if spec.get("manager", "dcp") == "dcp":
        config.checkpoint = CheckpointManager.Config(async_mode=spec.get("async_mode", "disabled"), **common)
    else:
        from torchtitan_bytecheckpoint import ByteCheckpointManager

        config.checkpoint = ByteCheckpointManager.Config(async_mode=spec.get("async_mode", "disabled"),
                                                         **common, **spec.get("bcp", {}))
    return config


def record(trainer, spec: dict) -> dict:
    """Each step's global loss (as torchtitan logs it) and this rank's input token batches."""
    seen = {"losses": {}, "batches": {}}
    log = trainer.metrics_processor.log

    def log_and_keep(step, global_avg_loss, *args, **kwargs):
        seen["losses"][step] = float(global_avg_loss)
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = log_and_keep
    generator = trainer.batch_generator

    def batches(iterable):
        for input_dict, labels in generator(iterable):
            seen["batches"].setdefault(trainer.step, []).extend(input_dict["input"].tolist())
            yield input_dict, labels

    trainer.batch_generator = batches

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            seen.setdefault(name, []).append(time.perf_counter() - t0)
            return out
        return call

    ckpt = trainer.checkpointer  # seconds the loop spent in each call (a save's stall, the resume)
    ckpt.save, ckpt.load = timed("save_s", ckpt.save), timed("load_s", ckpt.load)
    ckpt.maybe_wait_for_staging = timed("staging_wait_s", ckpt.maybe_wait_for_staging)
    trainer.train_step = timed("step_s", trainer.train_step)
    return seen


def main(spec: dict) -> None:
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = build_config(spec)
    trainer = config.build()
    rank = torch.distributed.get_rank()
    try:
        shims.after_build(trainer)
        seen = record(trainer, spec)
        trainer.train()
        trainer.checkpointer.maybe_wait_for_saving()
    finally:
        trainer.close()
    with open(f"{spec['out']}-r{rank}.json", "w") as f:
        json.dump(dict(seen, final_step=trainer.step), f)
