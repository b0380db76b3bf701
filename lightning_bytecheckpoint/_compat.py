"""Every private Lightning attribute the adapter touches, and every Lightning class it patches.

Each access checks that the attribute is still there and otherwise fails with a message that
names the installed Lightning version and the range the adapter was tested with, instead of an
AttributeError deep inside a training run. Nothing else in this package touches a private name
of Lightning (docs/lightning.md, "Compatibility", lists them and why no public hook serves).
"""
from __future__ import annotations

from typing import Any, Callable

import lightning

LIGHTNING_VERSION = lightning.__version__
#: The Lightning versions this adapter's tests pass with (docs/lightning.md, "Compatibility").
TESTED_RANGE = ">=2.4,<2.7"
_MARK = "_bytecheckpoint_hook"


class LightningCompatError(RuntimeError):
    """The installed Lightning lacks something the adapter relies on."""


def _missing(what: str, used_for: str) -> LightningCompatError:
    return LightningCompatError(
        f"lightning_bytecheckpoint: Lightning {LIGHTNING_VERSION} has no {what} (used to {used_for}). The adapter is "
        f"tested with lightning{TESTED_RANGE}; install a version in that range or update lightning_bytecheckpoint.")


# ---------------------------------------------------------------- the strategy <-> plugin meeting point

def hook_checkpoint_io_setter(cls: type, on_assign: Callable[[Any, Any], bool]) -> None:
    """Wrap the setter of ``cls.checkpoint_io`` (once) so that ``on_assign(strategy, io)`` runs
    after every assignment. Lightning's connectors assign the plugin there, in every process,
    before anything runs; it is the only place where a CheckpointIO meets its strategy.

    ``on_assign`` returns True when it took the assignment over (the original setter, which
    some Fabric strategies make raise, is then not called)."""
    prop = cls.__dict__.get("checkpoint_io")
    if not isinstance(prop, property) or prop.fset is None:
        raise _missing(f"{cls.__qualname__}.checkpoint_io property with a setter", "meet the strategy it is given to")
    if getattr(prop.fset, _MARK, False):
        return
    original = prop.fset

    def fset(self: Any, io: Any) -> None:
        if not on_assign(self, io):
            original(self, io)

    setattr(fset, _MARK, True)
    setattr(cls, "checkpoint_io", property(prop.fget, fset, prop.fdel, prop.__doc__))


def store_checkpoint_io(strategy: Any, io: Any) -> None:
    """``strategy._checkpoint_io = io``: where every Lightning strategy keeps its plugin (the
    public setter of Fabric's FSDP/ModelParallel strategies refuses any plugin)."""
    if not hasattr(strategy, "_checkpoint_io"):
        raise _missing(f"{type(strategy).__qualname__}._checkpoint_io attribute", "attach the plugin to the strategy")
    strategy._checkpoint_io = io


# ---------------------------------------------------------------- strategy settings without a public setter

def use_sharded_state_dicts(strategy: Any) -> None:
    """ModelParallelStrategy: build sharded (DTensor) state dicts, not gathered ones
    (``save_distributed_checkpoint`` is a constructor argument only)."""
    if not hasattr(strategy, "_save_distributed_checkpoint"):
        raise _missing("ModelParallelStrategy._save_distributed_checkpoint attribute",
                       "make the strategy produce sharded state dicts")
    strategy._save_distributed_checkpoint = True


def fsdp_state_dict_type(strategy: Any) -> str:
    """FSDPStrategy's ``state_dict_type`` ("full" | "sharded"; a constructor argument only)."""
    value = getattr(strategy, "_state_dict_type", None)
    if value not in ("full", "sharded"):
        raise _missing("FSDPStrategy._state_dict_type attribute", "tell full from sharded state dicts")
    return value


# ---------------------------------------------------------------- Lightning's own loader

def legacy_load(io: Any, path: Any, map_location: Any = None, weights_only: Any = None) -> Any:
    """``TorchCheckpointIO.load_checkpoint`` (regular .ckpt files). Lightning < 2.5 has no
    ``weights_only`` parameter there (it was added with torch 2.6's default change); it is passed
    only where the installed version takes it."""
    import inspect

    kwargs = {} if map_location is None else {"map_location": map_location}
    if "weights_only" in inspect.signature(io.load_checkpoint).parameters:
        kwargs["weights_only"] = weights_only
    return io.load_checkpoint(path, **kwargs)


# ---------------------------------------------------------------- LightningModule.load_from_checkpoint

def hook_checkpoint_loader(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Route ``LightningModule.load_from_checkpoint``'s file read (``saving.pl_load``, an alias of
    ``fabric.utilities.cloud_io._load``) through ``wrap(original)`` (once)."""
    from lightning.pytorch.core import saving

    original = getattr(saving, "pl_load", None)
    if original is None or not callable(original):
        raise _missing("lightning.pytorch.core.saving.pl_load function",
                       "let LightningModule.load_from_checkpoint read checkpoint directories")
    if getattr(original, _MARK, False):
        return
    wrapped = wrap(original)
    setattr(wrapped, _MARK, True)
    saving.pl_load = wrapped


# ---------------------------------------------------------------- the local tier callback

def dump_checkpoint(trainer: Any) -> dict:
    """``trainer._checkpoint_connector.dump_checkpoint()``: the dict ``Trainer.save_checkpoint``
    hands to the strategy, built without writing it (the local tier writes it elsewhere). No
    public Lightning call returns it."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is None or not hasattr(connector, "dump_checkpoint"):
        raise _missing("Trainer._checkpoint_connector.dump_checkpoint", "build the checkpoint of a local-tier save")
    return connector.dump_checkpoint(weights_only=False)


# ---------------------------------------------------------------- the train loader (data order, data.py)

def hook_process_dataloader(cls: type, after: Callable[[Any, Any], Any]) -> None:
    """Wrap ``cls.process_dataloader`` (public; Lightning calls it on every loader it prepared,
    after injecting its DistributedSampler) once, so that ``after(strategy, loader)`` may replace
    the loader. No CheckpointIO hook sees the loaders."""
    original = cls.__dict__.get("process_dataloader")
    if not callable(original):
        raise _missing(f"{cls.__qualname__}.process_dataloader method", "make the train loader's position reshardable")
    if getattr(original, _MARK, False):
        return

    def process_dataloader(self: Any, dataloader: object) -> object:
        return after(self, original(self, dataloader))

    setattr(process_dataloader, _MARK, True)
    process_dataloader.__doc__ = original.__doc__
    setattr(cls, "process_dataloader", process_dataloader)


def update_dataloader(dataloader: Any, sampler: Any) -> Any:
    """``lightning.pytorch.utilities.data._update_dataloader``: the user's DataLoader (subclasses
    included) re-instantiated with another sampler, as Lightning injects its DistributedSampler.
    Public Lightning has no call that rebuilds a loader."""
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities import data as pl_data

    update = getattr(pl_data, "_update_dataloader", None)
    if not callable(update):
        raise _missing("lightning.pytorch.utilities.data._update_dataloader function",
                       "rebuild the train loader with a reshardable sampler")
    return update(dataloader, sampler, mode=RunningStage.TRAINING)


def pending_loader_states(trainer: Any) -> list:
    """The saved train loader states the fit loop hands its stateful loaders before the first
    batch (``FitLoop._combined_loader_states_to_load``; Lightning does so only when it restarts
    mid-epoch). The list itself: a train loader that no longer takes a saved position has it
    removed (Lightning would refuse the count), and at an epoch boundary, where Lightning hands
    nothing over, the adapter takes its positions from it. Lightning has no public view of them."""
    states = getattr(trainer.fit_loop, "_combined_loader_states_to_load", None)
    if not isinstance(states, list):
        raise _missing("FitLoop._combined_loader_states_to_load list", "hand saved train loader positions over")
    return states


# ---------------------------------------------------------------- the Trainer's log steps (_metrics.py)

class _MergedLogMetrics:
    """``trainer._logger_connector.log_metrics`` with ``merged(metrics)`` applied where Lightning
    logs at the training step (``step=None``: its own step, ``_batches_that_stepped``): a call with
    metrics, or a training batch's call at a ``log_every_n_steps`` step with none (the connector
    calls then only; ``_first_loop_iter`` is a bool inside a batch loop, None at epoch ends, where
    an empty call is no log step). Evaluation step logs pass their own step and go through untouched."""

    def __init__(self, connector: Any, original: Callable[..., Any], merged: Callable[[dict], dict], owner: Any) -> None:
        self.connector, self.original, self.merged, self.owner = connector, original, merged, owner

    def __call__(self, metrics: Any, step: Any = None) -> Any:
        if step is None and (metrics or getattr(self.connector, "_first_loop_iter", None) is not None):
            metrics = self.merged(metrics)
        return self.original(metrics, step)


def merge_into_logs(trainer: Any, owner: Any, merged: Callable[[dict], dict]) -> None:
    """Make ``merged`` add the plugin's waiting metrics to the metrics Lightning's logger connector
    hands its loggers at each log step (once per trainer; ``unmerge`` undoes it). The connector
    decides the cadence (``log_every_n_steps``) and the step; no public hook runs with its log
    calls (a Callback's ``self.log`` would enter the callback metrics)."""
    connector = getattr(trainer, "_logger_connector", None)
    current = getattr(connector, "log_metrics", None)
    if isinstance(current, _MergedLogMetrics) and current.owner is owner:
        return
    import inspect

    if (not callable(current) or list(inspect.signature(current).parameters)[:2] != ["metrics", "step"]
            or not hasattr(connector, "_first_loop_iter")):
        raise _missing("Trainer._logger_connector.log_metrics(metrics, step) method and _first_loop_iter",
                       "log the checkpoint/... metrics at the Trainer's log steps")
    connector.__dict__["log_metrics"] = _MergedLogMetrics(connector, current, merged, owner)


def unmerge(trainer: Any, owner: Any) -> None:
    connector = getattr(trainer, "_logger_connector", None)
    current = getattr(connector, "__dict__", {}).get("log_metrics")
    if isinstance(current, _MergedLogMetrics) and current.owner is owner:
        del connector.__dict__["log_metrics"]


def log_step(trainer: Any) -> int:
    """The step Lightning's logger connector logs training metrics at (``epoch_loop._batches_that_stepped``)."""
    step = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_batches_that_stepped", None)
    if not isinstance(step, int):
        raise _missing("FitLoop.epoch_loop._batches_that_stepped counter", "log checkpoint/... metrics at the log step")
    return step
