"""What the manager uses of torchtitan beyond the checkpoint contract, in one place (tested with
torchtitan 0.3.0). The contract itself (BaseCheckpointManager, its Config, the build() keywords)
is imported where it is used; the Trainer's attributes below are not part of it, so each access
fails with a message naming the version the adapter was written against."""
from __future__ import annotations

from typing import Any

from torchtitan.components.checkpointer import BaseCheckpointManager  # noqa: F401  (re-exported)
from torchtitan.components.dataloader import BaseDataLoader  # noqa: F401  (re-exported)
from torchtitan.config import TORCH_DTYPE_MAP  # noqa: F401  (re-exported)
from torchtitan.tools import filesystem  # noqa: F401  (re-exported)

TESTED = "torchtitan 0.3.0"


def _need(obj: Any, *names: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise RuntimeError(f"torchtitan_bytecheckpoint: the trainer ({type(obj).__name__}) has no {missing}; the "
                           f"data-parallel resume was written against {TESTED}'s Trainer")


def is_trainer(obj: Any) -> bool:
    """The `train_state` torchtitan hands every manager is the Trainer itself."""
    return all(hasattr(obj, n) for n in ("config", "dataloader", "tokenizer", "gradient_accumulation_steps"))


def layout(trainer: Any, dataloader: Any) -> dict:
    """Samples per loader batch and loader batches per optimizer step on one DP rank."""
    per_step = int(getattr(trainer, "gradient_accumulation_steps", 1)) * int(
        getattr(trainer, "num_pipeline_parallel_microbatches", 1))
    return {"batch": int(getattr(dataloader, "batch_size", 0) or 0), "batches_per_step": per_step}


def build_dataloader(trainer: Any, *, dp_world_size: int, dp_rank: int, local_batch_size: int) -> Any:
    """The trainer's own dataloader config built at another DP degree/rank (Trainer.__init__'s call)."""
    _need(trainer, "config", "tokenizer")
    return trainer.config.dataloader.build(dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=trainer.tokenizer,
                                           seq_len=trainer.config.training.seq_len,
                                           local_batch_size=local_batch_size, snapshot_every_n_steps=None)


def replace_dataloader(trainer: Any, loader: Any) -> None:
    """Trainer.train() iterates `self.dataloader` after `checkpointer.load()`: hand it the resumed one."""
    _need(trainer, "dataloader")
    trainer.dataloader = loader


def dp_coordinates(dataloader: Any) -> tuple:
    """(dp_rank, dp_world_size) of torchtitan's ParallelAwareDataloader."""
    _need(dataloader, "dp_rank", "dp_world_size")
    return int(dataloader.dp_rank), int(dataloader.dp_world_size)
