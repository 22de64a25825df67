"""Deprecated as a module: `kvedit.focus` is the function (`kvedit.focus(...)`); the module is
now `kvedit.focusing`. Importing from this path warns and forwards; calling it calls the function."""

from .deprecation import moved_module

moved_module(__name__, "kvedit.focusing", call="kvedit.focusing.focus")
