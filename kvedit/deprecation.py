"""Old import paths kept for one release: each use warns with the new path.

:func:`moved_names` is a module-level ``__getattr__`` for names that moved to another module;
:func:`moved_module` turns a module that was renamed into a forwarding module, callable when a
function of the package took its name (``kvedit.focus`` is the function; ``kvedit/focus.py``
was its module), so ``import kvedit.focus`` cannot hide the function.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from collections.abc import Callable, Mapping

__all__ = ["moved_module", "moved_names"]

REMOVED_IN = "0.4"


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old path goes in kvedit {REMOVED_IN}",
        DeprecationWarning,
        stacklevel=3,
    )


def moved_names(module: str, names: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__``: ``names[name]`` is the module ``name`` moved to."""

    def __getattr__(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", f"{names[name]}.{name}")
        return getattr(importlib.import_module(names[name]), name)

    return __getattr__


class _MovedModule(types.ModuleType):
    """A renamed module's old name: attribute reads forward to the new module (and warn)."""

    def __getattr__(self, name: str) -> object:
        new = self.__dict__["_kvedit_new"]
        if name.startswith("__"):
            raise AttributeError(name)
        _warn(f"{self.__name__}.{name}", f"{new}.{name}")
        return getattr(importlib.import_module(new), name)

    def __call__(self, *args, **kwargs):
        call = self.__dict__["_kvedit_call"]
        if call is None:
            raise TypeError(f"module {self.__name__!r} is not callable")
        module, name = call.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


def moved_module(old: str, new: str, call: str | None = None) -> None:
    """Make module ``old`` (being imported) forward to ``new``; calling it calls ``call``
    (``"module.function"``), the function that shares the old module's name."""
    module = sys.modules[old]
    module.__dict__["_kvedit_new"] = new
    module.__dict__["_kvedit_call"] = call
    module.__class__ = _MovedModule
