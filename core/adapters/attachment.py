"""The attach lifecycle every ``attach(<framework object>)`` handle shares (accelerate_bytecheckpoint,
transformers_bytecheckpoint): the checks ``attach`` makes before building the handle, the checkpointer it
builds or shares, and the handle's own lifecycle. Methods are wrapped on the framework *instance*
(entries in its ``__dict__``; the class and other instances are untouched), each as
``functools.partial(wrapper, original)``; ``remove()`` waits for pending saves, restores what each entry
was before and closes a checkpointer the handle built. A method someone wrapped again after attach is
left in place: the handle's wrapper is a pass-through once it is no longer ``active``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..checkpointer import Checkpointer

ATTACHMENT_ATTR = "_bytecheckpoint_attachment"  # on the framework object: its attachment
MISSING = object()                              # "no instance entry before attach"


def check_target(target: Any, cls: type, who: str, expected: str, kind: str) -> None:
    """``target`` is a ``cls`` not attached yet; ``who``: the package named in the errors,
    ``expected``: the type as the error names it ("an accelerate.Accelerator"), ``kind``: "Accelerator"."""
    if not isinstance(target, cls):
        raise TypeError(f"{who}.attach expects {expected}; got {type(target).__name__}")
    if getattr(target, ATTACHMENT_ATTR, None) is not None:
        raise RuntimeError(f"{who}.attach: this {kind} is already attached; remove() the first handle")


def checkpointer_for(checkpointer: Optional[Checkpointer], who: str, **settings: Any) -> Tuple[Checkpointer, bool]:
    """(the checkpointer, whether the attachment owns it): a shared one as given, else one built with
    ``Checkpointer.from_env(**settings)`` that the attachment closes."""
    if checkpointer is None:
        return Checkpointer.from_env(**settings), True
    if not isinstance(checkpointer, Checkpointer):
        raise TypeError(f"{who}.attach: checkpointer must be a bytecheckpoint.Checkpointer, got "
                        f"{type(checkpointer).__name__}")
    return checkpointer, False


class Attachment:
    """The handle's lifecycle. Subclasses set ``_metrics`` (a ``monitor.metrics.MetricsHandover`` with
    ``end()``) before calling ``__init__``, wrap methods with ``_wrap`` in their ``_install`` and call
    ``_restore`` in their ``_uninstall``."""

    _metrics: Any = None

    def __init__(self, checkpointer: Checkpointer, *, owns_checkpointer: bool, async_save: Optional[bool],
                 storage_options: Optional[dict]) -> None:
        self._ckpt = checkpointer
        self._owns = owns_checkpointer
        self._async = checkpointer.options.async_save if async_save is None else bool(async_save)
        # storage_options per call for a shared checkpointer (an owned one was built with them)
        self._storage: Dict[str, Any] = {}
        if storage_options is not None and not owns_checkpointer:
            self._storage["storage_options"] = storage_options
        self._active = False
        self._previous: List[Tuple[Any, str, Any]] = []   # (object, method name, its entry before attach)

    # ------------------------------------------------------------------ public
    @property
    def checkpointer(self) -> Checkpointer:
        return self._ckpt

    @property
    def active(self) -> bool:
        return self._active

    @property
    def async_save(self) -> bool:
        return self._async

    @property
    def pending(self) -> List[str]:
        """Targets of async saves still being written (the checkpointer's pending saves)."""
        return self._ckpt.pending_paths()

    def wait(self) -> None:
        """Block until every async save of the checkpointer is committed; re-raises a failure."""
        self._ckpt.wait()

    def remove(self) -> None:
        """Wait for pending saves, then restore the framework's own methods (and close the
        checkpointer if the attachment built it)."""
        if not self._active:
            return
        try:
            self.wait()
            if self._metrics is not None:
                self._metrics.end()  # what no framework log took, while its loggers are there
        finally:
            self._uninstall()
            if self._owns:
                self._ckpt.close()

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # ------------------------------------------------------------------ install
    def _uninstall(self) -> None:
        raise NotImplementedError

    def _wrap(self, obj: Any, name: str, original: Callable, wrapper: Callable) -> None:
        """``obj.name`` becomes ``wrapper(original, *args, **kwargs)`` (an instance entry)."""
        self._previous.append((obj, name, obj.__dict__.get(name, MISSING)))
        obj.__dict__[name] = functools.wraps(original)(functools.partial(wrapper, original))

    def _restore(self) -> None:
        """Every wrapped method back to its entry before attach, unless wrapped again since."""
        for obj, name, previous in self._previous:
            current = obj.__dict__.get(name)
            if getattr(getattr(current, "func", None), "__self__", None) is not self:
                continue  # wrapped again after attach: ours is a pass-through now (not active)
            if previous is MISSING:
                del obj.__dict__[name]
            else:
                obj.__dict__[name] = previous
        self._previous.clear()

    def _mark(self, target: Any) -> None:
        setattr(target, ATTACHMENT_ATTR, self)

    def _unmark(self, target: Any) -> None:
        if target.__dict__.get(ATTACHMENT_ATTR) is self:
            delattr(target, ATTACHMENT_ATTR)
