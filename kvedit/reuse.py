"""Deprecated as a module: `kvedit.reuse` is the function (`kvedit.reuse(...)`); the module is
now `kvedit.prefix_reuse`. Importing from this path warns and forwards; calling it calls the function."""

from .deprecation import moved_module

moved_module(__name__, "kvedit.prefix_reuse", call="kvedit.prefix_reuse.reuse")
