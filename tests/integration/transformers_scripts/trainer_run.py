"""One Trainer run on the tiny GPT-2, stock or with the adapter attached; launched with torchrun
(any process count) or plain python. Rank 0 dumps the final weights, the losses, the global step
and what the adapter recorded to --dump.

    trainer_run.py --out DIR [--attach sync|async] [--resume PATH|true] [--max-steps N] [--save-steps K]
                   [--save-total-limit L] [--deepspeed STAGE [--ds-gather]] [--dump FILE] [--state-at STEP] [--peft]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/integration (_leave)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/ (scenarios_deepspeed)
if "--deepspeed" in sys.argv:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from tiny import Tokens, losses, tiny_gpt2, tiny_lora, training_args, weights  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--attach", choices=["none", "sync", "async"], default="none")
    p.add_argument("--resume", default=None)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--deepspeed", type=int, default=None, help="ZeRO stage (DeepSpeed on CPU, gloo)")
    p.add_argument("--fsdp", type=int, default=None, help="FSDP version, forced on CPU (test-only Trainer subclass)")
    p.add_argument("--state-dict-type", default="SHARDED_STATE_DICT")
    p.add_argument("--save-final", default=None, help="trainer.save_model(DIR) after train()")
    p.add_argument("--dump", default=None)
    p.add_argument("--state-at", type=int, default=None, help="dump DeepSpeed's full view at this step / after load")
    p.add_argument("--ds-gather", action="store_true", help="ZeRO-3: stage3_gather_16bit_weights_on_model_save")
    p.add_argument("--peft", action="store_true", help="a LoRA adapter on the tiny GPT-2 (tiny.tiny_lora)")
    a = p.parse_args()
    torch.set_num_threads(1)
    from transformers import Trainer, TrainerCallback

    extra = {}
    if a.deepspeed is not None:
        from scenarios_deepspeed import skip_shm_build

        skip_shm_build()
        gather = {"stage3_gather_16bit_weights_on_model_save": True} if a.ds_gather else {}
        extra["deepspeed"] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "zero_optimization": {"stage": a.deepspeed, **gather}, "zero_allow_untested_optimizer": True,
                              "gradient_clipping": "auto", "steps_per_print": 10 ** 9}
        extra["ddp_backend"] = "gloo"
        # the default adamw_torch_fused: bytecheckpoint's DeepSpeed route refuses to load into a fresh
        # fused Adam (core/state/deepspeed_engine.py), so DeepSpeed runs use the unfused AdamW
        extra["optim"] = "adamw_torch"
    if a.fsdp is not None:
        extra["fsdp"] = "full_shard"
        # sync_module_states builds a device param_init_fn (no device on CPU): the weights are seeded alike
        extra["fsdp_config"] = {"fsdp_version": a.fsdp, "state_dict_type": a.state_dict_type, "sync_module_states": "false"}
    args = training_args(a.out, max_steps=a.max_steps, save_steps=a.save_steps, save_total_limit=a.save_total_limit,
                         **extra)
    views = {}

    class FullView(TrainerCallback):  # DeepSpeed's own full view: the oracle of a resharded resume
        def on_save(self, args_, state, control, **kw):
            if a.state_at is not None and state.global_step == a.state_at:
                views["saved"] = _full_view(trainer)

        def on_train_begin(self, args_, state, control, **kw):
            if a.resume is not None and a.state_at is not None:
                views["loaded"] = _full_view(trainer)

    trainer = (_cpu_fsdp_trainer(Trainer) if a.fsdp is not None else Trainer)(model=tiny_lora() if a.peft else tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=[FullView()])
    handle = None
    if a.attach != "none":
        from transformers_bytecheckpoint import attach

        handle = attach(trainer, async_save=a.attach == "async")
    resume = True if a.resume == "true" else a.resume
    result = trainer.train(resume_from_checkpoint=resume)
    info = {"global_step": result.global_step}
    if a.save_final:
        trainer.save_model(a.save_final)
    if handle is not None:
        info["last_save"] = handle.last_save
        handle.remove()
    final = _full_view(trainer) if a.deepspeed is not None else weights(trainer.model)  # collective for DeepSpeed
    if a.dump and trainer.args.process_index == 0:
        torch.save({"weights": final, "losses": losses(trainer), "info": info, "views": views,
                    "world_size": trainer.args.world_size}, a.dump)
        print("DUMP", json.dumps(info), flush=True)


def _cpu_fsdp_trainer(base):
    """Accelerate enables FSDP only on GPU backends (on CPU the Trainer silently trains DDP): force
    its FSDP code path on CPU/gloo, as tests/integration/accelerate_scripts/fsdp_resume.py does."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class CpuFsdpTrainer(base):
        def create_accelerator_and_postprocess(self):
            plugin_args = self.args.fsdp_plugin_args
            if plugin_args is None:
                raise SystemExit("TrainingArguments built no fsdp_plugin_args on this machine")
            self.args.fsdp_plugin_args = None  # a CPU Accelerator first (FSDP1's plugin wants a device)
            try:
                super().create_accelerator_and_postprocess()
            finally:
                self.args.fsdp_plugin_args = plugin_args
            state = self.accelerator.state
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
            state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
            if state.fsdp_plugin.fsdp_version != 2:  # FSDP1 on CPU wants device_id=cpu
                state.device = PartialState().device = torch.device("cpu")
            self.is_fsdp_enabled = True

    return CpuFsdpTrainer


def _full_view(trainer):
    """DeepSpeed's own full view of the fp32 master weights (collective). (Its full view of the Adam
    moments, safe_get_full_optimizer_state, fails for this model's parameters whose partition lies
    on one rank: "exp_avg not found in optimizer state fragment"; tests/dist/test_deepspeed.py
    checks the moments on a model where it works.)"""
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).clone() for name, p in trainer.model_wrapped.module.named_parameters()}


if __name__ == "__main__":
    from _leave import leave

    main()
    leave(0)
