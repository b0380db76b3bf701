"""pytest plugin, used with inject.py: lets only the suite's *own* reads of a checkpoint folder's
stock files read what the adapter stored in `checkpoint-<step>/bytecheckpoint/` instead (as the
Lightning suite's shim does for its `.ckpt` reads). transformers' code and the adapter are
untouched: a call is redirected only when the calling module is one of the suite's (tests.trainer.*),
the stock file is absent, and the folder's `bytecheckpoint/` is committed and holds that part.

* `os.path.isfile` / `os.path.exists` of `model.safetensors`, `optimizer.pt`, `scheduler.pt`,
  `scaler.pt`, `rng_state*.pth`: True when the part is there (`model`/`engine`, `optimizer`,
  `scheduler`, `scaler`, `trainer`).
* `safetensors.torch.load_file(<folder>/model.safetensors)`: the saved model's state dict
  (`bytecheckpoint.load_full`).

A checkpoint folder written with the adapter has its own `model.safetensors` (a hard link to the
checkpoint's safetensors pack, transformers_bytecheckpoint/_views.py), so the suite's reads of that
file, its `os.remove` of it and `from_pretrained` of the folder need no redirect; the redirect stays
for folders without it (sharded routes). Tests that still differ are listed in
tests/frameworks/run_transformers.py (none now).
"""
import os
import sys

import safetensors.torch

import bytecheckpoint as bcp
from bytecheckpoint.state.flatten import top_level_placeholders

_PARTS = {"model.safetensors": ("model", "engine"), "optimizer.pt": ("optimizer", "engine"),
          "scheduler.pt": ("scheduler",), "scaler.pt": ("scaler",)}
_SUITE = ("tests.trainer.",)


def _from_suite(depth: int = 2) -> bool:
    return sys._getframe(depth).f_globals.get("__name__", "").startswith(_SUITE)


def _saved(path) -> tuple:
    """(bytecheckpoint dir, its top-level keys) for <folder>/<stock file>, or (None, ())."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    ckpt = os.path.join(folder, "bytecheckpoint")
    if not os.path.isdir(ckpt) or not bcp.is_checkpoint(ckpt):
        return None, ()
    keys = set(top_level_placeholders(bcp.Checkpointer().metadata(ckpt).structure))
    wanted = _PARTS.get(name, ("trainer",) if name.startswith("rng_state") and name.endswith(".pth") else ())
    return ckpt, tuple(k for k in wanted if k in keys)


_isfile, _exists, _load_file = os.path.isfile, os.path.exists, safetensors.torch.load_file


def isfile(path):
    if _isfile(path) or not _from_suite():
        return _isfile(path)
    return bool(_saved(path)[1])


def exists(path):
    if _exists(path) or not _from_suite():
        return _exists(path)
    return bool(_saved(path)[1])


def load_file(filename, device="cpu"):
    if _exists(filename) or not _from_suite():
        return _load_file(filename, device=device)
    ckpt, parts = _saved(filename)
    if not parts or os.path.basename(os.fspath(filename)) != "model.safetensors":
        return _load_file(filename, device=device)
    state = bcp.load_full(ckpt, keys=[parts[0]])[parts[0]]
    return {k: v.to(device) for k, v in state.items()}


if not getattr(os.path.isfile, "_bcp_shim", False):
    isfile._bcp_shim = exists._bcp_shim = load_file._bcp_shim = True
    os.path.isfile, os.path.exists, safetensors.torch.load_file = isfile, exists, load_file
