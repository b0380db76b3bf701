"""One Trainer run on the tiny GPT-2, stock or with the adapter attached; launched with torchrun
(any process count) or plain python. Rank 0 dumps the final weights, the losses, the global step
and what the adapter recorded to --dump.

    trainer_run.py --out DIR [--attach sync|async] [--resume PATH|true] [--max-steps N] [--save-steps K]
                   [--save-total-limit L] [--deepspeed STAGE] [--dump FILE] [--state-at STEP]
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

from tiny import Tokens, losses, tiny_gpt2, training_args, weights  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--attach", choices=["none", "sync", "async"], default="none")
    p.add_argument("--resume", default=None)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--deepspeed", type=int, default=None, help="ZeRO stage (DeepSpeed on CPU, gloo)")
    p.add_argument("--dump", default=None)
    p.add_argument("--state-at", type=int, default=None, help="dump DeepSpeed's full view at this step / after load")
    a = p.parse_args()
    torch.set_num_threads(1)
    from transformers import Trainer, TrainerCallback

    extra = {}
    if a.deepspeed is not None:
        from scenarios_deepspeed import skip_shm_build

        skip_shm_build()
        extra["deepspeed"] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "zero_optimization": {"stage": a.deepspeed}, "zero_allow_untested_optimizer": True,
                              "gradient_clipping": "auto", "steps_per_print": 10 ** 9}
        extra["ddp_backend"] = "gloo"
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

    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=[FullView()])
    handle = None
    if a.attach != "none":
        from transformers_bytecheckpoint import attach

        handle = attach(trainer, async_save=a.attach == "async")
    resume = True if a.resume == "true" else a.resume
    result = trainer.train(resume_from_checkpoint=resume)
    info = {"global_step": result.global_step}
    if handle is not None:
        info["last_save"] = handle.last_save
        handle.remove()
    if a.dump and trainer.args.process_index == 0:
        model = trainer.model_wrapped if a.deepspeed is not None else trainer.model
        final = _full_view(trainer) if a.deepspeed is not None else weights(model)
        torch.save({"weights": final, "losses": losses(trainer), "info": info, "views": views,
                    "world_size": trainer.args.world_size}, a.dump)
        print("DUMP", json.dumps(info), flush=True)


def _full_view(trainer):
    from scenarios_deepspeed import full_view

    return full_view(trainer.model_wrapped)


if __name__ == "__main__":
    from _leave import leave

    main()
    leave(0)
