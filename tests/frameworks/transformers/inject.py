"""pytest plugin: every transformers.Trainer gets transformers_bytecheckpoint.attach(self) right
after __init__ (async saves unless INJECT_ASYNC=0). Each attach is logged to INJECT_LOG."""
import functools
import os

import transformers
from transformers_bytecheckpoint import attach

_LOG = os.environ.get("INJECT_LOG", os.devnull)
_ASYNC = os.environ.get("INJECT_ASYNC", "1") != "0"


def _note(msg):
    try:
        with open(_LOG, "a") as f:
            f.write(f"[pid {os.getpid()}] {msg}\n")
    except OSError:
        pass


if not getattr(transformers.Trainer.__init__, "_bcp_injected", False):
    _orig_init = transformers.Trainer.__init__

    @functools.wraps(_orig_init)
    def __init__(self, *args, **kwargs):
        _orig_init(self, *args, **kwargs)
        try:
            attach(self, async_save=_ASYNC)
            _note(f"attached {os.environ.get('PYTEST_CURRENT_TEST', '?')}")
        except (NotImplementedError, ValueError) as e:
            _note(f"NOT attached (unsupported) {os.environ.get('PYTEST_CURRENT_TEST', '?')}: {e}")

    __init__._bcp_injected = True
    transformers.Trainer.__init__ = __init__
