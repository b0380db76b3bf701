"""Resuming a checkpoint written by torchtitan's own (DCP) CheckpointManager, through bytecheckpoint.

bytecheckpoint reads DCP folders as its own (core/foreign/dcp.py), resharded onto any layout. What
differs is the key layout torchtitan's DCP manager writes (components/checkpointer/dcp.py): the
model's FQNs at the top level, the optimizer as torchtitan's flat `state.<fqn>.<name>` /
`param_groups.<fqn>.<key>` dict, the LR schedulers' and train state's own state_dict()s, and the
dataloader's `{"dp_rank_<r>": bytes, "world_size": W}`. The load template mirrors that layout with
this run's tensors (so they are filled in place, resharded), then each component's
load_state_dict() runs as torchtitan's manager runs it. Each DP rank's data position continues at
another DP degree by the rule of _data (a whole shrink: DP 2 -> 1 exact).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import bytecheckpoint as bcp

from . import _compat, _data

MODEL, OPTIMIZER, DATALOADER, TRAIN_STATE = "model", "optimizer", "dataloader", "train_state"


def is_dcp(ckpt: bcp.Checkpointer, path: str) -> bool:
    return ckpt.metadata(path).info.get("format") == "dcp"


def _model_state(model_parts: list) -> Dict[str, Any]:
    return {k: v for part in model_parts for k, v in part.state_dict().items()}


def load(ckpt: bcp.Checkpointer, path: str, *, model_parts: list, optimizers: Any, states: Dict[str, Any],
         exclude: set, model_only: bool) -> Optional[str]:
    """Load the DCP checkpoint at `path` into this run's state; returns the data-order report (None:
    no DP positions were restored)."""
    model = _model_state(model_parts)
    if model_only:
        ckpt.load(path, dict(model), strict=False)
        _load_model(model_parts, model)
        return None
    state: Dict[str, Any] = dict(model)
    if OPTIMIZER not in exclude:
        state[OPTIMIZER] = optimizers.state_dict()  # torchtitan's flat, FQN-keyed form (its state made first)
    loader = states.get(DATALOADER)
    positions = _data.dp_states(loader) if loader is not None and DATALOADER not in exclude else None
    for key, value in states.items():
        if key in exclude or value is None or key == OPTIMIZER:
            continue
        state[key] = None if key == DATALOADER and positions is not None else value.state_dict()
    ckpt.load(path, state, strict=not exclude)
    _load_model(model_parts, model)
    if OPTIMIZER in state:
        optimizers.load_state_dict(state[OPTIMIZER])
    for key, value in states.items():
        if key in state and key != OPTIMIZER and not (key == DATALOADER and positions is not None):
            value.load_state_dict(state[key])
    if positions is None:
        return None
    return _restore_data(state[DATALOADER], loader, states.get(TRAIN_STATE), states)


def _load_model(model_parts: list, loaded: Dict[str, Any]) -> None:
    for part in model_parts:  # as torchtitan's ModelWrapper.load_state_dict (strict=False: other parts' keys)
        part.load_state_dict(loaded, strict=False)


def _restore_data(saved: Any, loader: Any, trainer: Any, states: Dict[str, Any]) -> str:
    """The DP positions of torchtitan's dataloader state, continued at this DP degree (_data.restore)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("world_size"), int):
        loader.load_state_dict(saved)
        return "dataloader state loaded as saved"
    ranks = {int(k[len("dp_rank_"):]): v for k, v in saved.items() if str(k).startswith("dp_rank_")}
    dp_rank, dp_world = _compat.dp_coordinates(loader)
    now = _compat.layout(trainer, loader) if _compat.is_trainer(trainer) else {"batch": 0, "batches_per_step": 0}
    plan = GivenPlan(ranks, saved["world_size"], dp_rank, dp_world, now)
    resumed, report = _data.restore(plan, loader, trainer, now)
    if resumed is not loader:
        _compat.replace_dataloader(trainer, resumed)
        states[DATALOADER] = resumed
    return report


class GivenPlan(_data.Plan):
    """A _data.Plan over positions already read (a DCP checkpoint holds them as plain values). A DCP
    checkpoint does not record the old per-rank batch layout: the global batch is taken as unchanged
    (torchtitan's global_batch_size), so each old rank's samples per step are this step's / k."""

    def __init__(self, ranks: Dict[int, bytes], saved_world: int, dp_rank: int, dp_world: int,
                 now: Dict[str, int]) -> None:
        super().__init__(saved_world, 0, dp_rank, dp_world)
        self._given = {r: ranks[r] for r in range(self.first, self.first + self.count) if r in ranks}
        per_step, k = now["batch"] * now["batches_per_step"], self.count
        self._layout = {"batch": per_step // k, "batches_per_step": 1} if per_step % k == 0 else {}
        if not self.why and len(self._given) != self.count:
            self.why = f"the checkpoint holds no position for saved dp ranks {self.first}..{self.first + k - 1}"

    @property
    def layout(self) -> Dict[str, Any]:
        return self._layout

    def positions(self) -> Dict[int, bytes]:
        return dict(self._given)
