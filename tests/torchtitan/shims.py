"""Test-only shims that let torchtitan 0.3.0's real Trainer run on a CPU-only machine with gloo.

None of this belongs in torchtitan_bytecheckpoint: each shim names the torchtitan or torch line it
works around (checked against torchtitan 0.3.0 and torch 2.13.0+cpu) and changes nothing a GPU run
would do. `install()` must run before anything from torchtitan is imported (the device is chosen
at import time); `after_build(trainer)` once the Trainer is built, before train().
"""
from __future__ import annotations

import types

import torch


def install() -> None:
    _cpu_device()
    _cpu_memory_stats()
    _set_timeout()
    _flex_attention_on_cpu()
    _pipeline_step_microbatches()


def _cpu_device() -> None:
    # torchtitan/tools/utils.py:55  `device_type = _get_available_device_type() or "cuda"`: with no
    # accelerator torchtitan picks "cuda" and every later call (set_device, the model's init device,
    # the process group's backend) fails. torch/_utils.py:810 returns None on a CPU-only build;
    # answering "cpu" makes torchtitan pick torch.cpu and the gloo backend.
    import torch._utils as tu

    tu._get_available_device_type = lambda: "cpu"


def _cpu_memory_stats() -> None:
    # torchtitan/components/metrics.py:42-50 and :62 call device_module.get_device_name,
    # get_device_properties(...).total_memory, reset_peak_memory_stats, empty_cache and memory_stats,
    # which torch.cpu (torch 2.13) does not have. Zeros: the logged memory numbers mean nothing here.
    cpu = torch.cpu
    if not hasattr(cpu, "get_device_name"):
        cpu.get_device_name = lambda device=None: "cpu"
    if not hasattr(cpu, "get_device_properties"):
        cpu.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=1 << 34)
    for name in ("reset_peak_memory_stats", "empty_cache"):
        if not hasattr(cpu, name):
            setattr(cpu, name, lambda *a, **k: None)
    if not hasattr(cpu, "memory_stats"):
        cpu.memory_stats = lambda device=None: {}


def _set_timeout() -> None:
    # torchtitan/distributed/utils.py:586-595 (set_pg_timeouts, after the first step) calls
    # barrier(device_ids=[device_module.current_device()]), which gloo refuses for torch.cpu's "cpu",
    # then torch.distributed.set_timeout, absent in torch 2.13. Keep the barrier, skip the rest: the
    # tests' launcher enforces its own time limit.
    import torch.distributed as dist

    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: dist.barrier()


def _flex_attention_on_cpu() -> None:
    # torchtitan/models/common/attention.py:366 runs FlexAttention through torch.compile'd
    # flex_attention (max_autotune, Triton); torch 2.13 has no FlexAttention backward on CPU. The
    # debug model's only LM backends are flex/varlen (models/common/config_utils.py:97 refuses
    # sdpa), so route the same call to SDPA with the block mask's own mask_mod materialised:
    # the same attention (document-causal), computed densely.
    from torch.nn.attention.flex_attention import create_mask

    from torchtitan.models.common import attention

    def dense(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        if score_mod is not None or return_aux.lse:
            raise NotImplementedError("test shim: score_mod / lse are not routed to SDPA")
        b, _, lq, _ = q.shape
        mask = create_mask(block_mask.mask_mod, b, None, lq, k.shape[2], device=q.device)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                               enable_gqa=enable_gqa)
        return out, types.SimpleNamespace(lse=None)

    attention.FlexAttention.compiled_flex_attn = staticmethod(dense)
    # attention.py:622 builds the block mask with torch.compile(create_block_mask): ~20 s of C++
    # compilation per process on CPU for the same mask eager create_block_mask builds.
    from torch.nn.attention.flex_attention import create_block_mask

    attention._compiled_create_block_mask = create_block_mask


def _pipeline_step_microbatches() -> None:
    # torchtitan/trainer.py:856 calls `pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...,
    # losses=..., loss_kwargs=..., return_outputs=False)`, a signature of a newer torch; torch 2.13's
    # step() (torch/distributed/pipelining/schedules.py:505) takes the whole batch and splits it.
    # Its _step_microbatches takes exactly the pre-split lists, so route the call there.
    from torch.distributed.pipelining import schedules

    def step(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
             return_outputs=True, loss_kwargs=None, **kwargs):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return original[type(self)](self, *args, losses=losses, return_outputs=return_outputs,
                                        loss_kwargs=loss_kwargs, **kwargs)
        # what step() does around _step_microbatches (schedules.py:769-772, 1972): the stages' backward flag
        # and their per-step runtime state reset
        for stage in getattr(self, "_stages", None) or [self._stage]:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        return self._step_microbatches(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs,
                                       losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs)

    original = {}
    for name in dir(schedules):
        cls = getattr(schedules, name)
        if isinstance(cls, type) and issubclass(cls, schedules._PipelineSchedule) and "step" in cls.__dict__:
            original[cls] = cls.__dict__["step"]
    for cls in list(original):
        cls.step = step
    for cls in [c for c in vars(schedules).values() if isinstance(c, type)
                and issubclass(c, schedules._PipelineSchedule) and c not in original]:
        base = next(b for b in cls.__mro__ if b in original)
        original[cls] = original[base]


def after_build(trainer) -> None:
    """On the built Trainer, before train()."""
    # torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:850 reduce-scatters gradients with
    # ReduceOp.PREMUL_SUM, which gloo rejects; FSDP2's own switch makes it SUM with a separate scale.
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
