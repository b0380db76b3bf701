"""PEFT models (LoRA, ...) under the Trainer: a checkpoint holds what the stock one holds, the adapter.

The stock Trainer saves a ``peft.PeftModel`` with ``PeftModel.save_pretrained``: per adapter, the
trainable weights ``get_peft_model_state_dict`` returns (``adapter_model.safetensors``, the frozen
base left out) and ``adapter_config.json``, plus a ``README.md``; its optimizer holds only the trainable
parameters. The adapter saves, instead of the model, ``state["adapter"] = {adapter name: bcp.ModuleView}``
whose tensors are exactly those of ``adapter_model.safetensors`` under the same names, loaded in place
and set with ``set_peft_model_state_dict`` (what ``PeftModel.load_adapter`` does once the adapter
exists); the optimizer is keyed by the PeftModel's parameter names, as for any model.

Where: one process and DDP (the REPLICATED route). FSDP, DeepSpeed and ``PeftMixedModel`` (which the
stock Trainer cannot save) keep the whole model in the checkpoint (docs/transformers.md).
peft is imported only when installed and the model is one of its classes.
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Dict, Iterable, Optional

import torch

import bytecheckpoint as bcp

from . import _routes as routes

KEY = "adapter"                       # the state key of the adapters (instead of "model")
WEIGHTS_NAME = "adapter_model.safetensors"


def model_of(trainer: Any, route: routes.Route) -> Optional[Any]:
    """The PeftModel the stock Trainer saves adapter-only, when this route saves it that way."""
    if route is not routes.REPLICATED or "peft" not in sys.modules:
        return None  # a PeftModel exists only once peft was imported
    from peft import PeftModel

    model = getattr(trainer.model, "_orig_mod", trainer.model)  # this route's trainer.model is not DDP-wrapped
    return model if isinstance(model, PeftModel) else None


def folder_of(output_dir: str, adapter: str) -> str:
    """Where PeftModel.save_pretrained puts an adapter's files: the folder, or a subfolder named after
    it for other adapters than "default"."""
    return output_dir if adapter == "default" else os.path.join(output_dir, adapter)


def views(model: Any, saved_keys: Optional[Iterable[str]] = None) -> Dict[str, "bcp.ModuleView"]:
    """{adapter name: ModuleView} of every adapter of `model` (as save_pretrained saves every one).
    For a load, `saved_keys` (the checkpoint's tensor keys) decide whether the embedding layers were
    saved with an adapter (save_embedding_layers="auto" decided that at save time, maybe by asking
    the Hub; asking again could answer differently)."""
    from peft.utils import get_peft_model_state_dict

    saved = None if saved_keys is None else set(saved_keys)
    in_checkpoint = None if saved is None else saved_adapters(saved)
    out = {}
    for name in model.peft_config:
        if in_checkpoint is not None and name not in in_checkpoint:
            continue  # an adapter added after that checkpoint: left as it is (stock loads the active one only)
        if saved is None:
            state_dict = _saving_state_dict(model, name)
        else:
            plain = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
            prefix = f"{KEY}/{name}/"
            embedding = any(k.startswith(prefix) and k[len(prefix):] not in plain for k in saved)

            def state_dict(n=name, e=embedding, p=plain):
                return get_peft_model_state_dict(model, adapter_name=n, save_embedding_layers=True) if e else p
        out[name] = bcp.ModuleView(model, state_dict, lambda sd, n=name: _set(model, sd, n))
    return out


_SAVING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> {adapter: _AdapterStateDict}


def _saving_state_dict(model: Any, adapter: str) -> "_AdapterStateDict":
    return _SAVING.setdefault(model, {}).setdefault(adapter, _AdapterStateDict(model, adapter))


class _AdapterStateDict:
    """get_peft_model_state_dict(model, adapter_name=adapter), as each save calls it (save_pretrained
    does), computed again only when it could differ. Its tensors are the model's own state dict
    tensors under other names, and it walks every module several times (on a 24-layer model about as
    long as the rest of an adapter save's stall). So the names it chose are kept, with a fingerprint
    of what they were chosen from: every state dict name, storage, shape and dtype, and the adapters'
    configs. A save whose fingerprint is the same takes the same names from model.state_dict(); any
    change (a resized embedding, another adapter, a replaced tensor) computes it again. Where a
    returned tensor is not one of the model's own (a transformed value), nothing is kept."""

    def __init__(self, model: Any, adapter: str) -> None:
        # weak: _SAVING's entry (keyed weakly by the model) must not keep the model alive
        self._model, self.adapter = weakref.ref(model), adapter
        self.fingerprint: Optional[tuple] = None
        self.names: Dict[str, str] = {}

    def __call__(self) -> Dict[str, Any]:
        from peft.utils import get_peft_model_state_dict

        model = self._model()
        full = model.state_dict()
        fingerprint = (tuple((n, id(c)) for n, c in model.peft_config.items()),
                       tuple((k, _identity(v)) for k, v in full.items()))
        if fingerprint == self.fingerprint:
            return {k: full[name] for k, name in self.names.items()}
        out = get_peft_model_state_dict(model, adapter_name=self.adapter)
        by_identity = {_identity(v): k for k, v in full.items()}
        names = {k: by_identity.get(_identity(v)) for k, v in out.items()}
        ok = all(n is not None for n in names.values())
        self.fingerprint, self.names = (fingerprint, names) if ok else (None, {})
        return out


def _identity(v: Any) -> tuple:
    if not isinstance(v, torch.Tensor):
        return ("object", id(v))
    return (v.data_ptr(), tuple(v.shape), v.dtype, v.device, v.storage_offset())


def saved_adapters(tensor_keys: Iterable[str]) -> set:
    return {k.split("/")[1] for k in tensor_keys if k.startswith(KEY + "/") and k.count("/") >= 2}


def _set(model: Any, state_dict: Dict[str, Any], adapter: str) -> None:
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state_dict, adapter_name=adapter)
    if result.unexpected_keys:
        raise bcp.StateMismatchError(
            f"adapter {adapter!r}: the checkpoint holds weights the model has no place for: "
            f"{sorted(result.unexpected_keys)[:8]}; build the PeftModel with the same PEFT config (LoraConfig "
            f"target_modules, r, ...) as the run that saved it")


def write_files(model: Any, output_dir: str) -> None:
    """README.md and, per adapter, adapter_config.json, as PeftModel.save_pretrained writes them (the
    stock Trainer's files of a PEFT model; peft_model.py save_pretrained: the model card, then per
    adapter its config with base_model_name_or_path filled in, inference_mode=True, and the base
    model's class when there is no task_type). adapter_model.safetensors is the adapter's
    safetensors pack, linked in before the checkpoint commits (_views.py)."""
    model.create_or_update_model_card(output_dir)
    for name, config in model.peft_config.items():
        folder = folder_of(output_dir, name)
        os.makedirs(folder, exist_ok=True)
        stale = os.path.join(folder, WEIGHTS_NAME)  # a link into an earlier save of this folder
        if os.path.lexists(stale):
            os.remove(stale)
        base = model.base_model if config.is_prompt_learning else model.base_model.model
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
        auto = None if config.task_type is not None else {"base_model_class": type(base).__name__,
                                                          "parent_library": type(base).__module__}
        inference_mode, config.inference_mode = config.inference_mode, True
        try:
            config.save_pretrained(folder, auto_mapping_dict=auto)
        finally:
            config.inference_mode = inference_mode
