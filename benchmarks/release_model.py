"""The model, training state and checks shared by both sides of benchmarks/bench_paper_release.py.

It imports only torch (and bench_real_model's model, itself torch only at import): the paper
release's worker runs it in the release's own venv, where `import bytecheckpoint` is the release,
and must never reach ours.
"""
from __future__ import annotations

import hashlib
from typing import Any, Tuple

import torch
from torch import nn

# bench_real_model imports only torch and the standard library at the top (bytecheckpoint inside its
# functions only), so the release's process may take the model from it.
from bench_real_model import Llama  # noqa: E402


def fsdp2_model_and_optim(blocks: int, vocab: int, trained: bool) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 (fully_shard per block, then the root) over the default process group, with AdamW.

    trained=True: after one step, the state that is saved (seed 0, the same input on every rank, so
    every run and both libraries hold the same values). trained=False: fresh (seed 1, no optimizer
    state yet), as a resume builds them."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0 if trained else 1)
    model = Llama(blocks, vocab=vocab)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if trained:
        ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
        model(ids).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _digest_into(h: "hashlib._Hash", name: str, value: Any) -> None:
    if isinstance(value, dict):
        for k in sorted(value, key=str):
            _digest_into(h, f"{name}.{k}", value[k])
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _digest_into(h, f"{name}.{i}", v)
    elif isinstance(value, torch.Tensor):
        full = _full(value).detach().cpu().contiguous()
        h.update(f"{name}:{full.dtype}:{tuple(full.shape)}".encode())
        h.update(full.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(f"{name}={value!r}".encode())


def state_fingerprint(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    """One digest of the model's and the optimizer's full (unsharded) state, keyed by parameter
    name: equal on any number of ranks for the same values (collective: gathers every DTensor)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    h = hashlib.blake2b(digest_size=16)
    _digest_into(h, "model", model_sd)
    _digest_into(h, "optimizer", optim_sd)
    return h.hexdigest()


def local_state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """The bytes of tensor data this rank holds (its shards of the parameters and AdamW moments)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    n = sum(local(t).nbytes for t in model.state_dict().values())
    for per_param in optim.state.values():
        n += sum(local(t).nbytes for t in per_param.values() if isinstance(t, torch.Tensor))
    return n
