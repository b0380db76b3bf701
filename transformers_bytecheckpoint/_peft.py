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
from typing import Any, Dict, Iterable, Optional

import bytecheckpoint as bcp

from . import _routes as routes

KEY = "adapter"                       # the state key of the adapters (instead of "model")
WEIGHTS_NAME = "adapter_model.safetensors"


def model_of(trainer: Any, route: routes.Route) -> Optional[Any]:
    """The PeftModel the stock Trainer saves adapter-only, when this route saves it that way."""
    if route is not routes.REPLICATED or "peft" not in sys.modules:
        return None  # a PeftModel exists only once peft was imported
    from peft import PeftModel

    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
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
    out = {}
    for name in model.peft_config:
        if saved is not None and name not in saved_adapters(saved):
            continue  # an adapter added after that checkpoint: left as it is (stock loads the active one only)
        if saved is None:
            def state_dict(n=name):
                return get_peft_model_state_dict(model, adapter_name=n)
        else:
            plain = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
            prefix = f"{KEY}/{name}/"
            embedding = any(k.startswith(prefix) and k[len(prefix):] not in plain for k in saved)

            def state_dict(n=name, e=embedding, p=plain):
                return get_peft_model_state_dict(model, adapter_name=n, save_embedding_layers=True) if e else p
        out[name] = bcp.ModuleView(model, state_dict, lambda sd, n=name: _set(model, sd, n))
    return out


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
    stock Trainer's files of a PEFT model), by save_pretrained itself given no weights; the weights
    file it then writes (empty) is removed: adapter_model.safetensors is the adapter's safetensors
    pack, linked in before the checkpoint commits (_views.py)."""
    weights = [os.path.join(folder_of(output_dir, name), WEIGHTS_NAME) for name in model.peft_config]
    for path in weights:  # a link into an earlier save of this folder: save_file would write through it
        if os.path.lexists(path):
            os.remove(path)
    model.save_pretrained(output_dir, is_main_process=True, state_dict={}, save_embedding_layers=False)
    for path in weights:
        if os.path.lexists(path):
            os.remove(path)
