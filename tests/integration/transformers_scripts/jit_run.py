"""enable_jit_checkpoint=True: the process sends itself SIGTERM at step 3 (as an orchestrator would
before preempting it), the Trainer's JIT checkpoint runs `kill_wait` (3 s) later, training stops,
and the process leaves with os._exit right after train() returns: nothing is waited for after it.

    jit_run.py OUT [--attach async|none] [--resume]     prints JIT <folder> <seconds of the JIT save>
"""
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from tiny import Tokens, tiny_gpt2, training_args  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    attached = "--attach" in sys.argv and sys.argv[sys.argv.index("--attach") + 1] != "none"
    resume = "--resume" in sys.argv
    from transformers import Trainer, TrainerCallback

    class Preempt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            time.sleep(0.25)  # a step that takes a while, so the 3 s grace period ends mid-training
            if state.global_step == 3 and not resume:
                os.kill(os.getpid(), signal.SIGTERM)

    args = training_args(out, max_steps=40, save_steps=2, enable_jit_checkpoint=True, logging_steps=1)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=[Preempt()])
    if attached:
        from transformers_bytecheckpoint import attach

        attach(trainer, async_save=True)
    timing = {}
    for cb in trainer.callback_handler.callbacks:
        manager = getattr(cb, "jit_manager", None)
        if manager is not None:
            inner = manager.execute_jit_checkpoint

            def timed(inner=inner):
                t0 = time.perf_counter()
                timing["step"] = trainer.state.global_step
                inner()
                timing["jit_s"] = time.perf_counter() - t0
            manager.execute_jit_checkpoint = timed
    result = trainer.train(resume_from_checkpoint=True if resume else None)
    if resume:
        print(f"RESUMED {result.global_step}", flush=True)
    else:
        print(f"JIT checkpoint-{timing.get('step')} {timing.get('jit_s', -1):.4f} stopped at {result.global_step}",
              flush=True)


if __name__ == "__main__":
    from _leave import leave

    main()
    leave(0)  # os._exit: no atexit, no waiting for anything after train()
